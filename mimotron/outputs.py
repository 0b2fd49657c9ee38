"""Outputs of the file-writing commands (``export``, ``plot``): checks and failures.

The output folder is checked before any input is read, so a long read is not wasted on
output that could never be written, and the error names the folder instead of
surfacing as a traceback from deep inside a writer. New files get the mode any plain
new file gets (0o666 less the umask), whatever the writer library does.

A command that fails prints one line, ``mimotron <command>: <what went wrong>``, and
exits non-zero: 2 for a usage problem (a path that is not what it should be, an output
folder it cannot write), 1 for anything else. With the environment variable
``MIMOTRON_DEBUG=1`` (what ``--debug`` sets) the full traceback is printed first.
"""

from __future__ import annotations

import os
import sys
import traceback
import uuid
from pathlib import Path

DEBUG_ENV = "MIMOTRON_DEBUG"
EXIT_FAILED, EXIT_USAGE = 1, 2


def debug_enabled() -> bool:
    """Whether ``MIMOTRON_DEBUG`` asks for full tracebacks (any value but ``""``/``0``)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_error(command: str, exc: BaseException, code: int, show_type: bool = True) -> int:
    """Print ``exc`` as one line (the traceback first under ``MIMOTRON_DEBUG``); ``code``.

    Args:
        command: the subcommand, for the prefix.
        exc: the exception being handled.
        code: the exit code to return.
        show_type: prefix the exception's type, which is part of what an unexpected
            error says (``OSError: [Errno 28] No space left on device``); off for
            messages written for the user (``ValueError``, ``CheckpointError``).

    Returns:
        ``code``.
    """
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    text = f"{type(exc).__name__}: {exc}" if show_type else str(exc)
    # Multi-line messages (a list of damaged files) still make one line.
    print(f"mimotron {command}: {' '.join(text.split())}", file=sys.stderr, flush=True)
    return code


def check_output_dir(path: Path) -> None:
    """Check that ``path`` is, or can be made, a folder this process can write into.

    Nothing is left behind: a missing folder is not created; a probe file is written in
    the folder (or in its nearest existing parent) and removed. Probing by writing, not
    ``os.access``, also catches read-only file systems and holds for root.

    Raises:
        ValueError: the folder or a parent is not a directory, or is not writable
            (names it).
    """
    path = Path(path)
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"output folder {str(path)!r} is invalid: {existing} exists and is "
                         "not a directory")
    probe = existing / f".mimotron-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.touch(exist_ok=False)
    except OSError as exc:
        where = "" if existing == path else f" (its parent {existing} is not writable)"
        raise ValueError(f"output folder {str(path)!r} is invalid: {existing} is not "
                         f"writable{where}: {exc.strerror}") from None
    probe.unlink()


def new_file_mode(folder: Path) -> int:
    """The permission bits a plain new file gets in ``folder`` (0o666 less the umask).

    Found by creating a probe file, so the process umask is read without changing it
    (``os.umask`` can only be read by setting it, which races with other threads).
    """
    probe = Path(folder) / f".mimotron-mode-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        probe.unlink()
