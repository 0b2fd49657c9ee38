"""SIGTERM / SIGINT as a request to stop cleanly, not an immediate death.

Schedulers (Slurm, Kubernetes, torchrun's agent on shutdown) send SIGTERM and wait a
grace period before SIGKILL. The handler only records the signal; the training loop
finishes its step, agrees with every other rank that it is time to stop (a rank that got
no signal must not be left waiting in a collective), saves and exits 0.

One stop request often arrives several times: Slurm's ``scancel`` signals every process
of the job, so a rank gets its own SIGTERM *and* the launcher's forward; ``timeout`` and
shell wrappers signal their child and then its whole process group. So repeats are
ignored while the stop is on its way to the save. Only a signal that arrives while the
stop's save is being written, and at least ``duplicate_window_s`` after the first (copies
of one request arrive within milliseconds), restores the previous handler and re-sends
itself: someone insists on stopping now, at the price of that save (the rank notes the
iteration it was saving in :attr:`StopSignals.saving_iteration`). Once that save is
complete (:meth:`StopSignals.save_complete`) every later signal is ignored: the run is on
its way out with its progress saved, and dying in the final evaluation or shutdown would
only make the launcher report a failure.

Under ``mimotron train``'s launcher a rank starts with SIGTERM and SIGINT *blocked*
(inherited through ``exec``), so a signal that arrives while it imports torch or reads
its config stays pending; :func:`unblock_stop_signals`, called right after the handlers
are installed, delivers it to them. (At a terminal, the launcher also aborts on a second
Ctrl-C: see :mod:`mimotron.cli.launch`.)

When a rank stops on a signal it leaves a stop record (:func:`write_stop_record`) in the
launcher's ``MIMOTRON_FAILURE_DIR``, so the launcher reports what happened: the
iteration saved, or that nothing was.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW_S = 1.0
STOP_RECORD = "stopped.json"


class StopSignals:
    """Record SIGTERM / SIGINT while installed; restore the previous handlers on exit.

    Args:
        signums: the signals to catch.
        duplicate_window_s: repeats within this many seconds of the first signal are
            copies of it, ignored even once the save began.

    Attributes:
        received: the first signal's number, or None.
        saving: True while the stop's save is being written (:meth:`begin_save` to
            :meth:`save_complete`): only then does an insisting signal abort.
        saved: the stop's save is complete (or there was nothing to save): every later
            signal is ignored.
        saving_iteration: the iteration the stop's save writes, once it began.
        aborted_by: the signal that aborted the save, or None.

    Example:
        >>> stop = StopSignals().install()
        >>> ...  # train; check ``stop.received`` after each step
        >>> stop.restore()
    """

    def __init__(self, signums: tuple[int, ...] = STOP_SIGNALS,
                 duplicate_window_s: float = DUPLICATE_WINDOW_S) -> None:
        self.signums = signums
        self.duplicate_window_s = duplicate_window_s
        self.received: int | None = None
        self.saving = False
        self.saved = False
        self.saving_iteration: int | None = None
        self.aborted_by: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    @classmethod
    def adopt_or_install(cls) -> tuple[StopSignals, bool]:
        """The instance already catching SIGTERM (e.g. installed before set-up), or a new one.

        A signal that arrived while the run was being built must not be lost, so the
        rank's entry point installs handlers first and the training loop adopts them.

        Returns:
            ``(instance, owned)``: ``owned`` is True when this call installed it (the
            caller then restores it).
        """
        current = signal.getsignal(signal.SIGTERM)
        owner = getattr(current, "__self__", None)
        if isinstance(owner, StopSignals) and owner.installed:
            return owner, False
        return cls().install(), True

    @property
    def installed(self) -> bool:
        """Whether the handlers are in place (only possible on the main thread)."""
        return bool(self._previous)

    def install(self) -> StopSignals:
        """Install the handlers; a no-op off the main thread (Python's rule for signals).

        Returns:
            self, so construction and installation chain.
        """
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return self
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def name(self) -> str:
        """The received signal's name (``SIGTERM``), or ``""``."""
        return signal.Signals(self.received).name if self.received is not None else ""

    def begin_save(self, iteration: int) -> None:
        """The stop's save of ``iteration`` begins: from now on an insisting signal aborts."""
        self.saving, self.saving_iteration = True, iteration

    def save_complete(self) -> None:
        """The stop's save is written (or there is none): ignore every later signal."""
        self.saving, self.saved = False, True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        now = time.monotonic()
        if self.received is None:
            self.received, self._first_at = signum, now
            return
        if not self.saving or now - self._first_at < self.duplicate_window_s:
            # The same stop request again (a forward, a wrapper), or the save is already
            # complete and the run on its way out: nothing to do.
            return
        # While the save is written, a later signal insists: the previous behaviour.
        self.aborted_by = signum
        self.restore()
        signal.raise_signal(signum)


def block_stop_signals() -> set[int]:
    """Block SIGTERM/SIGINT in the calling thread (children it starts inherit the mask).

    Returns:
        The stop signals that were blocked before (to pass to :func:`unblock_stop_signals`
        when restoring a previous state).
    """
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    return {s for s in STOP_SIGNALS if s in before}


def unblock_stop_signals(keep: set[int] | frozenset[int] = frozenset()) -> None:
    """Unblock SIGTERM/SIGINT (but ``keep``); pending ones are delivered to the handlers now.

    Args:
        keep: stop signals to leave blocked (those :func:`block_stop_signals` found
            blocked already).
    """
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [s for s in STOP_SIGNALS if s not in keep])


def write_stop_record(directory: str | os.PathLike | None, signal_name: str, iteration: int,
                      saved: int | None, began: bool = True) -> None:
    """Tell the launcher that the ranks stopped on a signal and what they saved.

    Best effort (no directory: not launched by ``mimotron train``; the rank's own log line
    says the same).

    Args:
        directory: the launcher's failure directory, or None.
        signal_name: e.g. ``"SIGTERM"``.
        iteration: the last iteration trained.
        saved: the iteration of the checkpoint written on the way out, or None.
        began: False when the signal came before the first step (nothing to save).
    """
    if directory is None:
        return
    path = Path(directory) / STOP_RECORD
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"signal": signal_name, "iteration": iteration,
                                   "saved": saved, "began": began}))
        os.replace(tmp, path)


def read_stop_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The ranks' stop record (:func:`write_stop_record`), or None when there is none."""
    try:
        record = json.loads((Path(directory) / STOP_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
