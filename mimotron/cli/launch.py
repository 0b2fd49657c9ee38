"""Start N local ranks, pass stop signals on once, and watch for deaths and stalls.

``mimotron train`` runs a multi-rank layout on one machine through this launcher (under
``torchrun`` it is not used). It does what ``torchrun --standalone`` does for the ranks
(a TCP store they rendezvous on, ``RANK``/``WORLD_SIZE``/... in their environment) and
what torch's elastic agent cannot do for this project:

* **Signals.** The first SIGTERM or SIGINT is passed on to every rank once; the ranks
  finish their step, save and exit 0 (:mod:`mimotron.checkpoint.signals`). Repeats are
  not passed on (under Slurm each rank gets its own copy anyway). The ranks start with
  SIGTERM/SIGINT blocked and unblock them once their handlers are installed, so a signal
  during their start-up is kept, not fatal; a rank still starting when the signal comes
  gets it once, when it has been started. torch's agent instead
  re-signals the ranks on every repeat and kills them after 30 s, whether or not they
  finished saving. Only a second Ctrl-C at a terminal (stdin a TTY, at least
  ``DUPLICATE_WINDOW_S`` after the first) kills the ranks at once, unsaved.
* **Deaths.** Every 50 ms it polls the ranks; a rank that exited non-zero without a
  failure record is recorded as ``"died"`` when seen. So a death lands in the failure
  records' order up to a poll late, possibly after a peer's error about it; a peer's error
  recognised as a peer loss, or one naming a connection within a few seconds of the death,
  does not hide it (:func:`mimotron.failures.root_cause`); any other error does.
* **Stalls.** A rank whose process is stopped (state ``T``, e.g. SIGSTOP) for
  ``pg_timeout_s``, or while a peer already failed, is recorded as ``"stalled"``. Its
  peers time out after the same ``pg_timeout_s``, counted from when they began waiting,
  often a little before the stop: their reports may come first. So every poll that sees
  a failure records the stopped ranks before it decides anything; the peers' timeouts
  are peer losses (:data:`mimotron.failures.PEER_LOSS_MARKERS`) and the stall, not the
  order of arrival, is the root cause.
* **Teardown.** Once a failure's root cause is known (or ``SETTLE_S`` after the first
  failure), the remaining ranks are killed: blocked on a dead peer, they cannot save.

The ranks are in the launcher's process group (a terminal's Ctrl-C or ``kill -TERM
-PGID`` reaches them all, as Slurm's signals do) and die with the launcher
(:mod:`mimotron.lifeline`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from mimotron.checkpoint.signals import (
    DUPLICATE_WINDOW_S,
    block_stop_signals,
    unblock_stop_signals,
)
from mimotron.failures import (
    FAILURE_DIR_ENV,
    death_summary,
    read_failures,
    record_failure,
    root_cause,
)
from mimotron.lifeline import LAUNCHER_PID_ENV, LAUNCHER_RUN_ID_PREFIX

POLL_S = 0.05
FAILURE_FOLDER_PREFIX = "mimotron-failures-"  # + the launcher's pid + "-" + random
SETTLE_S = 5.0  # After a failure, how long to wait for the root cause to be recorded.


@dataclass
class LaunchResult:
    """What happened to the ranks of one launch.

    Attributes:
        exit_codes: global rank -> exit code (negative: killed by that signal).
        signal_name: the first stop signal the launcher received (``"SIGTERM"``), or "".
        aborted: the ranks were killed at once (a second Ctrl-C at the terminal).
    """

    exit_codes: dict[int, int] = field(default_factory=dict)
    signal_name: str = ""
    aborted: bool = False

    @property
    def failed(self) -> dict[int, int]:
        """Ranks that exited non-zero, with their exit codes."""
        return {r: c for r, c in self.exit_codes.items() if c != 0}


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T``...), ``""`` if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


class Launcher:
    """Run ``argv`` as ``world_size`` local ranks (see the module docstring).

    Args:
        argv: the command each rank runs (e.g. ``[python, -m, mimotron, train, ...]``).
        world_size: number of ranks.
        failure_dir: the shared failure directory (``MIMOTRON_FAILURE_DIR``).
        pg_timeout_s: the ranks' process-group timeout; a rank stopped this long stalls.
    """

    def __init__(self, argv: list[str], world_size: int, failure_dir: str,
                 pg_timeout_s: float) -> None:
        self.argv, self.world_size = argv, world_size
        self.failure_dir, self.pg_timeout_s = failure_dir, pg_timeout_s
        self.result = LaunchResult()
        self._procs: list[subprocess.Popen] = []
        self._first_signal_at: float | None = None
        self._stopped_since: dict[int, float] = {}
        self._failed_at: float | None = None
        self._killed: set[int] = set()  # Ranks this launcher killed in teardown.
        self._forwarded: set[int] = set()  # Ranks the stop signal was passed on to.
        self._ended = False  # Every rank has exited (a signal now has nothing to stop).

    def run(self) -> LaunchResult:
        """Start the ranks and wait for all of them; SIGTERM/SIGINT are handled meanwhile."""
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        with self.handling_signals():
            self._start_and_wait(store.port)
        return self.result

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT go to this launcher while the block runs (see ``_on_signal``).

        ``run`` takes them itself; a caller that prepares things the launch must not leave
        behind (its failure folder) takes them from before it creates them until after it
        removes them: a signal before ``run`` is passed on to the ranks once they start,
        one after the ranks ended is noted, and neither kills the caller half-way.
        """
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM,
                                                                   signal.SIGINT)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _start_and_wait(self, port: int) -> None:
        try:
            # The ranks start with the stop signals blocked (the mask survives exec) and
            # unblock them once their handlers are in place: a signal during their
            # start-up waits for the handler instead of killing them.
            kept = block_stop_signals()
            try:
                for rank in range(self.world_size):
                    self._procs.append(subprocess.Popen(self.argv, env=self._env(rank, port)))
            finally:
                unblock_stop_signals(keep=kept)
            if self.result.signal_name:  # A signal came while the ranks were starting.
                self._forward(signal.Signals[self.result.signal_name])
            while len(self.result.exit_codes) < self.world_size:
                self._poll()
                time.sleep(POLL_S)
        finally:
            for proc in self._procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            self._ended = True

    def _env(self, rank: int, port: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size), GROUP_RANK="0", ROLE_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            # The ranks join this launcher's store (as torchrun's ranks join its agent's).
            TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_RUN_ID=f"{LAUNCHER_RUN_ID_PREFIX}{os.getpid()}",
            **{FAILURE_DIR_ENV: self.failure_dir, LAUNCHER_PID_ENV: str(os.getpid())},
        )
        return env

    def _poll(self) -> None:
        """One pass: record exits and stalls; tear down once a failure's cause is known."""
        now = time.monotonic()
        for rank, proc in enumerate(self._procs):
            if rank in self.result.exit_codes:
                continue
            code = proc.poll()
            if code is None:
                continue
            self.result.exit_codes[rank] = code
            if code != 0 and rank not in self._killed:
                self._failed_at = self._failed_at or now
                if rank not in {r.rank for r in read_failures(self.failure_dir)}:
                    record_failure(self.failure_dir, rank, "died", death_summary(code))
        if self._failed_at is None and read_failures(self.failure_dir):
            self._failed_at = now  # A rank recorded a failure and is on its way out.
        # Stalls only now, once this pass has seen any failure: a peer that timed out on a
        # stopped rank may report first, and the stopped rank must be on record before
        # the root cause is judged and the ranks without a record are killed.
        for rank, proc in enumerate(self._procs):
            if rank not in self.result.exit_codes:
                self._check_stall(rank, proc.pid, now)
        if self._failed_at is None:
            return
        records = read_failures(self.failure_dir)
        root = root_cause(records)
        if now - self._failed_at > SETTLE_S:
            self._kill_all()
        elif root is not None and root.kind != "peer":
            # Ranks without a record are blocked on the failed one: stop them now. Those
            # with one are printing their report and exiting; they get SETTLE_S, except
            # stalled ones: stopped, they can neither print nor exit.
            self._kill_all(spare={r.rank for r in records if r.kind != "stalled"})

    def _check_stall(self, rank: int, pid: int, now: float) -> None:
        if process_state(pid) != "T":
            self._stopped_since.pop(rank, None)
            return
        since = self._stopped_since.setdefault(rank, now)
        if now - since >= self.pg_timeout_s or self._failed_at is not None:
            recorded = {r.rank for r in read_failures(self.failure_dir)}
            if rank not in recorded:
                record_failure(self.failure_dir, rank, "stalled",
                               f"stalled: its process was stopped (SIGSTOP?) for "
                               f"{now - since:.0f} s; peers give up after "
                               f"train.pg_timeout_s={self.pg_timeout_s:g}")
            self._failed_at = self._failed_at or now

    def _kill_all(self, spare: set[int] | frozenset[int] = frozenset()) -> None:
        for rank, proc in enumerate(self._procs):
            if rank not in spare and proc.poll() is None:
                self._killed.add(rank)
                proc.kill()

    def _forward(self, signum: int) -> None:
        """Pass the stop signal on to each started rank that did not get it yet."""
        for rank, proc in enumerate(self._procs):
            if rank not in self._forwarded and proc.poll() is None:
                self._forwarded.add(rank)
                proc.send_signal(signum)

    @property
    def killed(self) -> set[int]:
        """Ranks the launcher killed after another rank's failure (collateral)."""
        return set(self._killed)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self._ended:  # The report is being written; the failure folder then removed.
            print(f"mimotron train: {name} after the ranks ended: nothing left to stop",
                  file=sys.stderr, flush=True)
            return
        if self._first_signal_at is None:
            self._first_signal_at = now
            self.result.signal_name = name
            hint = " (Ctrl-C again to abort without saving)" if _at_terminal() else ""
            print(f"mimotron train: {name}: the ranks finish their step, save and stop"
                  f"{hint}", file=sys.stderr, flush=True)
            self._forward(signum)
            return
        if signum == signal.SIGINT and _at_terminal() \
                and now - self._first_signal_at >= DUPLICATE_WINDOW_S:
            self.result.aborted = True
            self._kill_all()
        # Otherwise a copy of the same request: the ranks are on it already.


@contextlib.contextmanager
def failure_folder() -> Iterator[str]:
    """The launch's shared failure folder (``MIMOTRON_FAILURE_DIR``), removed afterwards.

    Its name carries the launcher's pid: a launcher killed outright (``kill -9``, the
    out-of-memory killer) cannot remove its folder, so each launch first removes this
    user's folders whose launcher no longer runs. Call it inside
    :meth:`Launcher.handling_signals`, so that a stop signal cannot end the launcher
    between creating the folder and removing it.

    Yields:
        The folder's path.
    """
    _remove_orphaned_folders()
    with tempfile.TemporaryDirectory(prefix=f"{FAILURE_FOLDER_PREFIX}{os.getpid()}-") as path:
        yield path


def _remove_orphaned_folders() -> None:
    """Remove failure folders of this user's launchers that are gone (best effort)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FAILURE_FOLDER_PREFIX}*"):
        pid = folder.name[len(FAILURE_FOLDER_PREFIX):].partition("-")[0]
        try:
            if not pid.isdigit() or folder.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # Alive (or a reused pid): leave the folder alone.
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            continue


def _at_terminal() -> bool:
    """Whether a person can press Ctrl-C here (stdin is a terminal)."""
    try:
        return os.isatty(sys.stdin.fileno())
    except (OSError, ValueError, AttributeError):
        return False
