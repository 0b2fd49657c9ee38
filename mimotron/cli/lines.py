"""Whole lines on a shared terminal or pipe: one ``write`` system call per line.

The ranks of a local launch share the launcher's stdout and stderr. Python cuts lines
wherever its buffering says: block buffering (the default for a pipe) flushes wherever
the buffer fills, and unbuffered or line-buffered mode (``PYTHONUNBUFFERED=1``, common
in containers) writes ``print``'s text and its final newline in two calls. Another rank's
output then lands in the middle of a line. :func:`whole_lines` puts a
:class:`LineWriter` in front of each stream: it keeps a partial line until its newline
arrives and writes every complete line with a single ``os.write``, which a pipe or
terminal never splits (lines are far below ``PIPE_BUF``, 4 KiB).
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO


class LineWriter(io.TextIOBase):
    """A text stream that writes only complete lines, each in one system call.

    A line is complete at ``"\n"``, or at ``"\r"`` (a line redrawn in place on a terminal).

    Args:
        stream: the stream to replace (its file descriptor and encoding are used).
    """

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self._fd = stream.fileno()
        self._encoding = getattr(stream, "encoding", None) or "utf-8"
        self._pending = ""

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The wrapped stream's encoding."""
        return self._encoding

    def writable(self) -> bool:
        """Always True."""
        return True

    def fileno(self) -> int:
        """The wrapped stream's file descriptor."""
        return self._fd

    def isatty(self) -> bool:
        """Whether the wrapped stream is a terminal."""
        return self._stream.isatty()

    def write(self, text: str) -> int:
        """Buffer ``text``; write out every line it completes, one call per line."""
        self._stream.flush()  # Anything written to the old stream before goes first.
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._write_all(f"{line}\n".encode(self._encoding, "backslashreplace"))
        # A progress line a terminal redraws in place ends at "\r": whole too, written now.
        cut = self._pending.rfind("\r") + 1
        if cut:
            redrawn, self._pending = self._pending[:cut], self._pending[cut:]
            self._write_all(redrawn.encode(self._encoding, "backslashreplace"))
        return len(text)

    def flush(self) -> None:
        """A partial line waits for its newline: flushing it would split the line."""

    def close_pending(self) -> None:
        """Write a last partial line, if any (at exit)."""
        if self._pending:
            pending, self._pending = self._pending, ""
            self._write_all(pending.encode(self._encoding, "backslashreplace"))

    def _write_all(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._fd, data):]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def whole_lines() -> Callable[[], None]:
    """Put :class:`LineWriter` s in front of ``sys.stdout`` and ``sys.stderr``.

    Streams without a file descriptor (e.g. captured by a test) are left alone.

    Returns:
        A function that writes any partial last line and puts the streams back.
    """
    originals = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    for name, stream in originals.items():
        if stream is None or isinstance(stream, LineWriter):
            continue
        try:
            setattr(sys, name, LineWriter(stream))
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            continue

    def restore() -> None:
        for name, stream in originals.items():
            current = getattr(sys, name)
            if isinstance(current, LineWriter) and current is not stream:
                current.close_pending()
            setattr(sys, name, stream)

    return restore
