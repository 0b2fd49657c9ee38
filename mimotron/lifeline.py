"""A rank dies with its launcher.

A launcher killed with ``kill -9`` (or by the out-of-memory killer) gets no chance to stop
its ranks. Left alone they would go on training as orphans, and a resubmitted job would
then write the same run directory concurrently. :func:`die_with_parent` ties a rank to the
process that started it, twice over:

* Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills the
  rank the moment its parent exits. It fires when the parent *thread* that forked the rank
  exits; ``mimotron train``'s launcher and torch's elastic agent (``torchrun``) both start
  their ranks from their main thread, so that thread's end is the process's end.
* A watchdog thread that checks ``os.getppid()`` every second, for systems without
  ``prctl`` and for the moment between the fork and the ``prctl`` call (a parent that died
  then has already handed the rank to another parent).

SIGKILL, not SIGTERM: without its launcher nobody reports what the ranks did, and a
resubmitted job may already be reading the directory a graceful save would write.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "MIMOTRON_LAUNCHER_PID"
LAUNCHER_RUN_ID_PREFIX = "mimotron-"  # + the launcher pid: its TORCHELASTIC_RUN_ID
_PR_SET_PDEATHSIG = 1  # From <linux/prctl.h>.


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int, interval_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(interval_s)
    os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(parent: int | None = None, interval_s: float = 1.0) -> bool:
    """Make this process end (SIGKILL) when the process that launched it is gone.

    Args:
        parent: the launcher's pid; None = the current parent. When the current parent is
            already someone else (the launcher died before this call), the process kills
            itself at once.
        interval_s: how often the watchdog thread checks the parent.

    Returns:
        Whether the kernel's parent-death signal is in place (the watchdog always is).
    """
    expected = os.getppid() if parent is None else parent
    armed = _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != expected:  # The launcher died before the signal was armed.
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=_watch_parent, args=(expected, interval_s), daemon=True,
                     name="mimotron-lifeline").start()
    return armed


def launched_parent() -> int | None:
    """The launcher pid this rank should die with, when it was started by one.

    ``mimotron train``'s launcher names itself in ``MIMOTRON_LAUNCHER_PID``; under
    ``torchrun`` (``TORCHELASTIC_RUN_ID`` set) the parent is torch's elastic agent.

    Returns:
        The pid, or None when this process was not started by a launcher.
    """
    named = os.environ.get(LAUNCHER_PID_ENV)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    # Only with the run id the same launcher set: a pid leaked into some other process's
    # environment (a torchrun started from a rank's shell) names a stranger, and a rank
    # whose parent is not that pid would kill itself at once.
    if named and run_id == f"{LAUNCHER_RUN_ID_PREFIX}{named}":
        with contextlib.suppress(ValueError):
            return int(named)
    if run_id:
        return os.getppid()
    return None

