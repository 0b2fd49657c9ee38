"""Reading a LLaVA data file piecewise: JSONL lines by byte offset, JSON lists converted.

No process holds or parses the whole file. A **JSONL** file is scanned once for its line
starts (:func:`jsonl_line_spans`, in blocks); each sample is then read alone from its byte
span (:func:`read_jsonl_sample`). A **JSON list** file is converted once, streaming, into
a JSONL file of one item per line (:func:`json_list_to_jsonl`; the index keeps it), so it
is read the same way afterwards.

The file is read as UTF-8; a BOM at its start is dropped. Bytes that are not UTF-8 make
only their sample bad (a :class:`SampleError` in its place, skippable like any bad
sample) and are named with the line (JSONL, from 1) or item (JSON list, from 0) the
dataset reports. JSONL lines end at ``"\\n"`` only (``"\\r\\n"`` too: JSON ignores the
``"\\r"``), since JSON strings may hold U+2028 and other line separators. The samples
themselves are checked by :mod:`~mimotron.data.llava_check`.
"""

from __future__ import annotations

import codecs
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

_BLOCK_BYTES = 8 << 20  # Read unit of the scans: a bounded buffer whatever the file size.
_BOM = b"\xef\xbb\xbf"


class SampleError(Exception):
    """A check failed; carries the reason (and the id once known)."""

    def __init__(self, reason: str, sample_id: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.sample_id = reason, sample_id


def is_json_list(path: str | Path) -> bool:
    """Whether the file's first non-blank character (after a BOM) is ``[``.

    Raises:
        ValueError: the file is missing.
    """
    file = checked_file(path)
    with open(file, "rb") as f:
        while block := f.read(1 << 16):
            head = block.removeprefix(_BOM).lstrip()
            if head:
                return head.startswith(b"[")
    return False


def checked_file(path: str | Path) -> Path:
    """``path`` as a :class:`Path`, checked to be a file.

    Raises:
        ValueError: no such file.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.path={str(file)!r} is invalid: expected a LLaVA JSON or JSONL file")
    return file


def jsonl_line_spans(path: str | Path, progress: Callable[[], None] | None = None
                     ) -> np.ndarray:  # fmt: skip
    """``[lines, 2]`` int64 byte spans ``[start, end)`` of every line, newline excluded.

    Line ``k`` (from 0) is the file's line ``k + 1``; blank lines are kept (the check
    skips them), so positions are line numbers. The file is read in blocks.

    Args:
        path: the JSONL file.
        progress: called after every block (rank 0 tells waiting ranks it is alive).
    """
    ends: list[np.ndarray] = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        start = len(_BOM) if f.read(len(_BOM)) == _BOM else 0
        f.seek(0)
        base = 0
        while block := f.read(_BLOCK_BYTES):
            ends.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 0x0A) + base)
            base += len(block)
            if progress is not None:
                progress()
    newlines = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    starts = np.concatenate([[start], newlines + 1]).astype(np.int64)
    stops = np.concatenate([newlines, [size]]).astype(np.int64)
    if starts[-1] >= size:  # nothing after the last newline
        starts, stops = starts[:-1], stops[:-1]
    return np.stack([starts, np.maximum(stops, starts)], axis=1)


def parse_line(data: bytes, converted: bool = False) -> Any:
    """One JSONL line's value: parsed JSON, ``None`` for a blank line, or a SampleError.

    Args:
        data: the line's bytes.
        converted: a line of :func:`json_list_to_jsonl`'s output, whose strings carry a
            JSON list's non-UTF-8 bytes as escaped lone surrogates.
    """
    line = data.decode("utf-8", errors="surrogateescape")
    if not line.strip():
        return None
    bad = _undecodable(line)
    if bad:
        return SampleError(bad)
    try:
        value = json.loads(line)
    except ValueError as exc:
        return SampleError(f"not valid JSON: {exc}")
    return _utf8_checked(value) if converted else value


def read_jsonl_sample(path: str | Path, offset: int, size: int, converted: bool = False,
                      crc: int | None = None) -> Any:  # fmt: skip
    """The sample at byte span ``[offset, offset + size)`` (see :func:`parse_line`).

    Only those bytes are read: a rank never holds the file.

    Args:
        path: the JSONL file.
        offset: the line's first byte.
        size: the line's length in bytes.
        converted: as :func:`parse_line`.
        crc: the CRC-32 of the bytes the check read (the index row's): other bytes mean
            the file changed after the check, a :class:`SampleError`.
    """
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        return SampleError(f"the data file ended at byte {offset + len(data)}: it changed "
                           "after it was checked")  # fmt: skip
    if crc is not None and zlib.crc32(data) != crc:
        return SampleError(changed_message("the line"))
    return parse_line(data, converted)


def changed_message(what: str) -> str:
    """Why a sample whose bytes differ from those its check read is not loaded."""
    return (f"{what} changed after the check (its bytes differ from those the index was "
            "built from; the next run checks it again)")  # fmt: skip


def json_list_to_jsonl(path: str | Path, out: Path,
                       progress: Callable[[], None] | None = None) -> int:  # fmt: skip
    """Convert a JSON list file to a JSONL file of one item per line; the item count.

    Streams: the list is decoded item by item from a bounded buffer (an item larger than
    the buffer grows it). Item ``k`` is written to line ``k + 1`` as ASCII JSON, so bytes
    that were not UTF-8 stay visible to the check (as escaped lone surrogates).

    Raises:
        ValueError: the file is not one valid JSON list (names the file and the error).
    """
    file = checked_file(path)
    reader = _TextReader(file)
    count = 0
    with open(out, "w", encoding="ascii") as sink:
        reader.expect("[")
        if reader.peek() == "]":
            reader.take()
        else:
            while True:
                sink.write(json.dumps(reader.value(), ensure_ascii=True) + "\n")
                count += 1
                if progress is not None and count % 4096 == 0:
                    progress()
                if reader.take() == "]":
                    break
                reader.back()
                reader.expect(",")
        if reader.peek() != "":
            reader.fail("extra data after the list")
    return count


class _TextReader:
    """A UTF-8 file decoded incrementally (``surrogateescape``) into a bounded buffer."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self._stream = open(file, "rb")  # noqa: SIM115 - closed at the end of the file
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self._json = json.JSONDecoder()
        self.buf, self.pos, self.eof, self._consumed = "", 0, False, 0
        self._fill(strip_bom=True)

    def _fill(self, strip_bom: bool = False) -> bool:
        """Read one more block; False at the end of the file."""
        if self.eof:
            return False
        block = self._stream.read(_BLOCK_BYTES)
        text = self._decoder.decode(block, final=not block)
        if strip_bom:
            text = text.removeprefix("\ufeff")
        if self.pos > _BLOCK_BYTES:  # Drop what was consumed: the buffer stays bounded.
            self._consumed += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        self.buf += text
        if not block:
            self.eof = True
            self._stream.close()
        return True

    def _skip_blanks(self) -> None:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self._fill():
                return

    def peek(self) -> str:
        """The next non-blank character, ``""`` at the end (not consumed)."""
        self._skip_blanks()
        return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def take(self) -> str:
        """The next non-blank character, consumed."""
        char = self.peek()
        self.pos += len(char)
        return char

    def back(self) -> None:
        self.pos -= 1

    def expect(self, char: str) -> None:
        if self.take() != char:
            self.fail(f"expected {char!r}")

    def value(self) -> Any:
        """The next JSON value; reads more while it may be cut by the buffer's end."""
        self._skip_blanks()
        while True:
            try:
                item, end = self._json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if self._fill():
                    continue
                self.pos = exc.pos
                self.fail(exc.msg)
            # A value ending at the buffer's end may go on (a number): read on, decode again.
            if end == len(self.buf) and self._fill():
                continue
            self.pos = end
            return item

    def fail(self, why: str) -> None:
        """Raise the whole-file error (the list itself is broken)."""
        if not self.eof:
            self._stream.close()
        raise ValueError(f"data.path={str(self.file)!r} is not a valid JSON list: "
                         f"{_printable(why)} (near character {self._consumed + self.pos})")


def _undecodable(text: str) -> str:
    """Why ``text`` (decoded with ``surrogateescape``) is not UTF-8, or ``""``."""
    try:
        text.encode("utf-8")  # In C: only text with a lone surrogate is walked below.
        return ""
    except UnicodeEncodeError:
        pass
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
