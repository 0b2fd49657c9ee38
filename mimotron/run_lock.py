"""One run per run directory: a lock file in log.dir, held for the whole run.

Two launches of the same run (a resubmitted job while the first still runs, a second
terminal) would otherwise both train, both save ``iter_*`` folders under the same names
and both append to one ``metrics.jsonl``: records are lost and ``latest`` names whichever
save came last. So the process that owns a run holds ``<log.dir>/mimotron.lock``:

* ``mimotron train``'s launcher (or the single process of a one-rank run), from before it
  looks at the run directory until its ranks have ended;
* under ``torchrun`` (or any launcher that sets ``RANK``), rank 0, for its whole life.
  The other ranks do not lock: rank 0 is the one that moves files and writes metrics,
  and a refused rank 0 ends the job (torchrun stops its peers).

The lock is an exclusive ``fcntl.flock`` on the file, so the kernel releases it when the
holder dies, however it dies (``kill -9`` included); the file names the holder's pid,
host and start time for the refusal. A second launch is refused with one line naming
them, before any rank starts. A file left behind by a holder that died without removing
it is no longer locked: it is taken over with a note. Where the file system does not
support ``flock`` (some network file systems) the pid decides instead: a live pid on this
host, or any pid on another host (which cannot be checked from here), refuses. The lock
file is never opened through a link (:mod:`mimotron.run_files`): a link, a directory or
any other non-plain file under its name refuses the launch, naming what it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mimotron.config.schema import MimoConfig
from mimotron.lifeline import LAUNCHER_PID_ENV, LAUNCHER_RUN_ID_PREFIX
from mimotron.run_dir import RunRefused
from mimotron.run_files import UnsafeRunFile, open_fd, write_error

LOCK_FILE = "mimotron.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` names a running process on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # Someone else's process: alive.
    return True


def _describe(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since "
            f"{holder.get('since', '?')}")


class RunLock:
    """An exclusive lock on one run directory (see the module docstring).

    Args:
        log_dir: the run's log.dir (created if missing).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.path = self.log_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or refuse.

        Raises:
            RunRefused: another live run holds it (one line naming its pid and host), or
                the lock file is a link, a directory or another non-plain file.
            ValueError: log.dir cannot be created or written (a full disk names the
                lock file).
        """
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(10):  # Retried only when the holder removed the file meanwhile.
                if self._try_once():
                    return
        except UnsafeRunFile as exc:  # A link or a folder where the lock file goes.
            raise RunRefused(f"log.dir={str(self.log_dir)!r}: {exc}") from None
        except OSError as exc:
            hint = "" if exc.errno == errno.ENOSPC else (
                " (it must be a directory this user can create files in)")
            raise ValueError(f"log.dir={str(self.log_dir)!r} is not writable: "
                             f"{exc.strerror or exc}{hint}") from None
        raise RunRefused(f"log.dir={str(self.log_dir)!r}: cannot take {self.path}: it keeps "
                         "being replaced by another process")

    def _try_once(self) -> bool:
        """One attempt: True when held, False when the file was replaced under us."""
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # Never through a link.
        try:
            flocked = self._flock(fd)
            # lstat: a link put in its place is a replacement too (and refused next time).
            if os.fstat(fd).st_ino != os.lstat(self.path).st_ino:
                os.close(fd)  # The holder released and removed it: lock the new one.
                return False
        except FileNotFoundError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        previous = _read(fd)
        if previous and not flocked and self._unverifiable_or_alive(previous):
            os.close(fd)
            raise RunRefused(self._refusal(previous))
        if previous:
            print(f"mimotron: took over the stale run lock {self.path} of "
                  f"{_describe(previous)} ({_why_stale(previous)}: that run ended without "
                  "removing it)", file=sys.stderr, flush=True)
        try:
            _write(fd, {"pid": os.getpid(), "host": socket.gethostname(),
                        "since": time.strftime("%Y-%m-%d %H:%M:%S")})
        except OSError as exc:  # A full disk: name the file.
            os.close(fd)
            raise write_error(self.path, exc) from None
        self._fd = fd
        return True

    def _flock(self, fd: int) -> bool:
        """Lock ``fd``; False where the file system has no flock; RunRefused when held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunRefused(self._refusal(_read(fd))) from None
        except OSError as exc:
            if exc.errno in _NO_FLOCK:
                return False
            raise
        return True

    @staticmethod
    def _unverifiable_or_alive(holder: dict[str, Any]) -> bool:
        """Without flock: a holder on another host cannot be checked, so it counts."""
        if holder.get("host") != socket.gethostname():
            return True
        pid = holder.get("pid")
        return isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid)

    def _refusal(self, holder: dict[str, Any]) -> str:
        return (f"log.dir={str(self.log_dir)!r} is in use by another run ({_describe(holder)}"
                f"; lock file {self.path}): wait for it to end, stop it, or use another "
                "log.dir")

    def release(self) -> None:
        """Remove the lock file and let go (the file first, while still holding it)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                # Removed while held: a launch that opened it meanwhile sees its file
                # replaced once it gets the lock, and locks a new one.
                self.path.unlink()
        os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _why_stale(holder: dict[str, Any]) -> str:
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) \
            and not _pid_alive(pid):
        return f"pid {pid} no longer runs"
    return "nobody holds its lock"


def _read(fd: int) -> dict[str, Any]:
    """The holder recorded in the lock file (empty when none or unreadable)."""
    try:
        data = os.pread(fd, 4096, 0)
        holder = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _write(fd: int, holder: dict[str, Any]) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)


def holds_run_lock() -> bool:
    """Whether this process must hold the run lock: the launcher or one process of a
    run, or rank 0 under an external launcher; never a rank ``mimotron train`` started
    (its launcher holds the lock)."""
    named = os.environ.get(LAUNCHER_PID_ENV)
    if named and os.environ.get("TORCHELASTIC_RUN_ID") == f"{LAUNCHER_RUN_ID_PREFIX}{named}":
        return False
    return os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def run_lock(cfg: MimoConfig) -> Iterator[RunLock | None]:
    """Hold the run lock of ``cfg``'s log.dir while the block runs, if this process must.

    Yields:
        The held lock, or None in a process that does not lock (see
        :func:`holds_run_lock`).

    Raises:
        RunRefused: another run holds the lock.
        ValueError: log.dir cannot be created or written.
    """
    if not holds_run_lock():
        yield None
        return
    with RunLock(cfg.log_dir) as lock:
        yield lock
