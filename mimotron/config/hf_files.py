"""Checks of one ``.safetensors`` file, and how every loader opens one.

A truncated or malformed ``.safetensors`` file used to fail inside every rank, after
launch, with the ``safetensors`` library's message (which names no file) and a traceback
per rank. :func:`check_safetensors` reads only the file's header, as the format defines
it (an 8-byte little-endian length, then that many bytes of JSON mapping each tensor to
its dtype, shape and ``data_offsets`` into the data that follows) and checks that the
header fits the file, parses, and places every tensor within the file with the size its
dtype and shape need. The first problem is one line naming the file; a Hugging Face
folder's files are checked so before launch
(:func:`mimotron.config.hf_folder.check_weight_files`).
:func:`open_safetensors` is how every loader opens such a file: a header the
``safetensors`` library refuses is reported the same way, naming the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

# Bytes per element of every dtype the safetensors format defines.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}
MAX_HEADER_BYTES = 100 * 2**20
"""The ``safetensors`` library refuses larger headers too."""


def _bad(file: Path, why: str) -> ValueError:
    return ValueError(f"{file} is not a valid safetensors file: {why}")


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
    """``(header, data size)`` of a safetensors file, the header's length checked."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise _bad(file, f"{size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise _bad(file, f"the header claims {length} bytes, but the file has "
                             f"{size - 8} after the length (truncated or not safetensors)")
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(file, f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(file, "its header is not a JSON object")
    return header, size - 8 - length


def _check_entry(file: Path, name: str, entry: Any, data_size: int) -> None:
    """One tensor's dtype, shape and offsets against the data that follows the header."""
    if not isinstance(entry, dict):
        raise _bad(file, f"tensor {name!r} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise _bad(file, f"tensor {name!r} has dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _bad(file, f"tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise _bad(file, f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise _bad(file, f"tensor {name!r} lies at bytes {begin}-{end} of the data, but the "
                         f"file holds {data_size} (truncated?)")
    need = math.prod(shape) * _DTYPE_BYTES[dtype]
    if end - begin != need:
        raise _bad(file, f"tensor {name!r} of shape {shape} {dtype} needs {need} bytes, "
                         f"its data_offsets span {end - begin}")


def check_safetensors(file: str | Path) -> None:
    """Check one safetensors file's header against its size (no tensor data is read).

    Args:
        file: the ``.safetensors`` file.

    Raises:
        ValueError: ``<file> is not a valid safetensors file: <why>`` (one line).
    """
    path = Path(file)
    try:
        header, data_size = _read_header(path)
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc.strerror or exc}") from None
    for name, entry in header.items():
        if name != "__metadata__":
            _check_entry(path, name, entry, data_size)


@contextlib.contextmanager
def open_safetensors(file: str | Path) -> Iterator[Any]:
    """``safe_open(file, framework="pt")``, a damaged file named in one line.

    The library's own error names no file (``header too large``, ``incomplete metadata,
    file not fully covered``); here the header is checked by :func:`check_safetensors`
    then, so the message says what is wrong with which file. A good file costs nothing
    extra.

    Raises:
        ValueError: ``<file> is not a valid safetensors file: <why>`` (damaged header,
            truncated data), or ``<file> cannot be read: ...``.
    """
    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        check_safetensors(file)  # raises the precise reason when it can tell one
        raise _bad(Path(file), f"its header is damaged ({exc})") from None
    with handle:
        yield handle


def read_safetensors(file: str | Path) -> dict[str, Any]:
    """Every tensor of a safetensors file (``safetensors.torch.load_file``), a damaged
    file named as by :func:`open_safetensors`.

    Raises:
        ValueError: ``<file> is not a valid safetensors file: <why>``.
    """
    with open_safetensors(file) as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
