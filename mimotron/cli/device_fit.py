"""``--device-memory``: the size of one device, as ``mimotron plan`` reads it.

:func:`parse_device_memory` reads a size (``80GB``, ``80GiB``, ``81920MiB``, a byte
count); :func:`mimotron.planner.fit.fit_lines` compares every rank's estimated peak
with it (``mimotron plan --device-memory``), and ``mimotron plan --auto`` searches
layouts that fit it.
"""

from __future__ import annotations

import re

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
"""Accepted suffixes (any case): decimal ``KB``/``MB``/``GB``/``TB``, binary ``KiB`` …"""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_VALID = ("a byte count or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), "
          "e.g. 80GB, 80GiB or 81920MiB")


def parse_device_memory(text: str) -> int:
    """Bytes of one device from ``--device-memory``: ``80GB`` (10^9), ``80GiB`` (2^30) …

    Args:
        text: a byte count (``85899345920``) or a positive number with a unit of
            :data:`UNITS` (``80GB``, ``79.5 GiB``, ``81920MiB``).

    Returns:
        The size in bytes (rounded down).

    Raises:
        ValueError: one line naming the value and the accepted forms.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in UNITS):
        raise ValueError(f"--device-memory={text!r} is invalid: expected {_VALID}")
    size = int(float(match.group(1)) * UNITS[unit or "b"])
    if size <= 0:
        raise ValueError(f"--device-memory={text!r} is invalid: expected a positive size, "
                         f"{_VALID}")
    return size
