"""SIGTERM / SIGINT as a request to stop cleanly, not an immediate death.

Schedulers (SLURM, Kubernetes, torchrun's agent on shutdown) send SIGTERM and wait a
grace period before SIGKILL. The handler only records the signal; the training loop
finishes its step, agrees with every other rank that it is time to stop (a rank that got
no signal must not be left waiting in a collective), saves and exits 0. A second signal
restores the previous handler and re-sends itself, so a user pressing Ctrl-C twice still
gets an immediate stop.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Record SIGTERM / SIGINT while installed; restore the previous handlers on exit.

    Args:
        signums: the signals to catch.

    Example:
        >>> stop = StopSignals().install()
        >>> ...  # train; check ``stop.received`` after each step
        >>> stop.restore()
    """

    def __init__(self, signums: tuple[int, ...] = STOP_SIGNALS) -> None:
        self.signums = signums
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

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

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.received is None:
            self.received = signum
            return
        # Second signal: the user insists. Let the previous behaviour happen now.
        self.restore()
        signal.raise_signal(signum)
