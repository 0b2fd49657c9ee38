"""Files mimotron writes in a run folder: never through a link, always naming the file.

A run folder (log.dir, checkpoint.dir) may be shared with other users, or hold what an
earlier job left. A symbolic link planted there under a name mimotron writes
(``mimotron.lock``, ``metrics.jsonl``, ``wandb_run_id``, ...) would make the trainer
overwrite whatever file the link points to, or create the file a dangling link names.
So every writer here opens with ``O_NOFOLLOW`` and refuses a link, or anything else that
is not a plain file (a directory, a fifo), with one line naming the file and what it is.

Whole-file writes go to a temporary file with a fresh random name (``O_EXCL``: never an
existing name, never a link), then ``os.replace`` it into place: a rename replaces a
link at the target rather than following it, and a reader sees the old content or the
new, never half of it.

A write that fails (a full disk, an I/O error) raises :class:`RunFileError`, an
``OSError`` with the same errno whose message names the file: a bare ``[Errno 28] No
space left on device`` does not say which disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, TextIO


class UnsafeRunFile(ValueError):
    """A name mimotron writes in a run folder is a link or not a plain file (names it)."""


class RunFileError(OSError):
    """Writing a run folder's file failed; the message names the file (errno kept)."""


def write_error(path: Path, exc: OSError) -> OSError:
    """``exc`` as a :class:`RunFileError` naming ``path`` (unchanged if it is one already)."""
    if isinstance(exc, RunFileError):
        return exc
    reason = exc.strerror or str(exc) or type(exc).__name__
    return RunFileError(exc.errno, f"cannot write {path}: {reason}")


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file"


def _refusal(path: Path, mode: int) -> UnsafeRunFile:
    what = _kind(mode)
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            what += f" (to {os.readlink(path)})"
    return UnsafeRunFile(f"{path} is {what}, not a plain file: mimotron does not write "
                         "through links or into special files in a run folder; remove it "
                         "(or move it aside) and start again")


def check_plain(path: Path) -> None:
    """Refuse ``path`` when it exists and is not a plain file (a link, even dangling).

    Raises:
        UnsafeRunFile: one line naming the file and what it is.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _refusal(Path(path), mode)


def open_fd(path: Path, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that never follows a link at ``path`` and opens plain files only.

    Args:
        path: the file.
        flags: ``os.O_*`` flags (``O_NOFOLLOW`` and ``O_CLOEXEC`` are added).
        mode: permission bits of a file it creates (less the umask).

    Returns:
        The open descriptor (the caller closes it).

    Raises:
        UnsafeRunFile: ``path`` is a link (dangling or not), a directory, a fifo...
        RunFileError: any other failure, naming the file.
    """
    path = Path(path)
    try:
        # O_NONBLOCK: opening a fifo for writing would otherwise wait for a reader.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            check_plain(path)  # Names what it is; a race that removed it falls through.
        raise write_error(path, exc) from None
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise _refusal(path, st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_text(path: Path, how: Literal["w", "a"]) -> TextIO:
    """A text file opened for writing (``"w"``: truncated) or appending (``"a"``).

    Raises:
        UnsafeRunFile: ``path`` is a link or not a plain file.
        RunFileError: it cannot be opened (names it).
    """
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if how == "w" else os.O_APPEND)
    return os.fdopen(open_fd(path, flags), how)


def write_text(path: Path, text: str) -> None:
    """Write ``text`` as the whole of ``path`` (created or truncated; never via a link).

    Raises:
        UnsafeRunFile: ``path`` is a link or not a plain file.
        RunFileError: it cannot be written (a full disk; names it).
    """
    data = text.encode()
    fd = open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while data:  # os.write may write less than asked (a nearly full disk).
            data = data[os.write(fd, data):]
    except OSError as exc:
        raise write_error(Path(path), exc) from None
    finally:
        os.close(fd)


def read_text(path: Path) -> str:
    """The text of a plain file of the run folder (a link is refused, not read).

    Raises:
        UnsafeRunFile: ``path`` is a link or not a plain file.
        FileNotFoundError: it does not exist.
    """
    check_plain(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            check_plain(path)
        raise
    with os.fdopen(fd) as f:
        return f.read()


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A fresh temporary file beside ``path``, moved over it when the block succeeds.

    For writers that take a file name (a profiler, numpy): the temporary name is new
    and random, so nothing can be planted there; a link at ``path`` is replaced, not
    followed; on failure the temporary file is removed and ``path`` is left as it was.

    Yields:
        The temporary file's path (empty, mode 0o666 less the umask).

    Raises:
        RunFileError: creating, filling or moving it failed (names ``path``).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    try:
        # O_EXCL: a new file, never an existing name or a link; 0o666 less the umask.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o666))
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(path, exc) from None
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temp file, fsync, rename).

    Raises:
        RunFileError: the write failed (a full disk: names ``path``); ``path`` is unchanged.
    """
    with replacing(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
