"""Output folders: checked before work starts, and the mode new files get there.

``mimotron export`` and ``mimotron plot`` check their output folder before reading any
input, so a long read is not wasted on output that could never be written, and the
error names the folder instead of surfacing as a traceback from deep inside a writer.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


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
