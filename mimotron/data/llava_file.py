"""Reading a LLaVA data file: a JSON list or JSONL file -> one raw value per sample.

The file is read as UTF-8; a BOM at its start is dropped. Bytes that are not UTF-8 make
only their sample bad (a :class:`SampleError` in its place, skippable like any bad
sample) and are named with the line (JSONL, from 1) or item (JSON list, from 0) the
dataset reports. JSONL lines end at ``"\\n"`` only (``"\\r\\n"`` too: JSON ignores the
``"\\r"``), since JSON strings may hold U+2028 and other line separators. The samples
themselves are checked by :class:`~mimotron.data.llava.LlavaDataset`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class SampleError(Exception):
    """A check failed; carries the reason (and the id once known)."""

    def __init__(self, reason: str, sample_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.sample_id = reason, sample_id


def read_raw_samples(path: str | Path) -> list[tuple[str, Any]]:
    """``(location, parsed JSON or SampleError)`` of every sample of a JSON list or JSONL file.

    A file whose first non-blank character is ``[`` is one JSON list; anything else is
    JSONL (blank lines are ignored; a line that is not JSON is a bad sample).

    Raises:
        ValueError: the file is missing, or a JSON list file does not parse.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.path={str(file)!r} is invalid: expected a LLaVA JSON or JSONL file")
    # Bytes that are not UTF-8 become lone surrogates, so they are found per sample (a
    # bad sample, skippable) instead of failing the whole file; a leading BOM is dropped.
    text = file.read_bytes().decode("utf-8", errors="surrogateescape").removeprefix("\ufeff")
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"data.path={str(file)!r} is not a valid JSON list: "
                             f"{_printable(str(exc))}") from exc  # fmt: skip
        return [(f"item {i}", _utf8_checked(item)) for i, item in enumerate(items)]
    out: list[tuple[str, Any]] = []
    # JSONL lines end at "\n" only: JSON strings may hold U+2028 and other separators.
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        bad = _undecodable(line)
        if bad:
            out.append((f"line {n}", SampleError(bad)))
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except ValueError as exc:
            out.append((f"line {n}", SampleError(f"not valid JSON: {exc}")))
    return out


def _undecodable(text: str) -> str:
    """Why ``text`` (decoded with ``surrogateescape``) is not UTF-8, or ``""``."""
    for column, char in enumerate(text, start=1):
        if "\udc80" <= char <= "\udcff":
            return (f"not valid UTF-8: byte 0x{ord(char) - 0xDC00:02x} at character "
                    f"{column} (save the file as UTF-8)")  # fmt: skip
    return ""


def _utf8_checked(item: Any) -> Any:
    """``item``, or a :class:`SampleError` if one of its strings held bytes that are not UTF-8."""
    stack = [item]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            bad = _undecodable(value)
            if bad:
                return SampleError(bad)
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return item


def _printable(text: str) -> str:
    """``text`` with undecodable bytes shown as ``\\xNN`` (a message must print)."""
    return text.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="backslashreplace")
