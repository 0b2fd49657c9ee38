"""``mimotron train``: validate, launch ranks if needed, train, summarise.

Outside a launcher, a layout needing N > 1 ranks re-runs this command on N local ranks
(:mod:`mimotron.cli.launch`, in place of ``torchrun --standalone``). Under ``torchrun``
(``TORCHELASTIC_RUN_ID`` or ``RANK`` set, single- or multi-node) each rank checks
WORLD_SIZE against the layout and trains. A bad config exits 2 with one line, before any
process group exists. Every rank dies with its launcher (:mod:`mimotron.lifeline`).

Signals: the first SIGTERM/SIGINT, whoever sends it to whichever process, stops the run
after the current step with a save (:mod:`mimotron.checkpoint.signals`); the launcher
then says which iteration was saved (exit 0) or that nothing was (exit 1). Once that save
is complete, later signals are ignored; one during the save aborts it (recorded as
"aborted during the save of iteration N"). A signal while the ranks start stops them
before the first step ("before training began: nothing to save", exit 1): the launcher
starts them with the signals blocked, and a rank unblocks them once its handlers are in
place. A failure after a complete stop save is reported with the save.

Failures: a rank that raises records its failure (:mod:`mimotron.failures`, in a
directory the launcher passes down as ``MIMOTRON_FAILURE_DIR``), prints one line (and
its traceback when the error is a bug, not a checkpoint/disk/config error, or when
``MIMOTRON_DEBUG=1``) and aborts its process groups; its peers, blocked on it in a
collective, fail fast (the connection closes) or at the latest after
``train.pg_timeout_s``, record themselves as collateral and say so in one line (exit
code 3). The launcher records a rank that dies without a report (a signal, the OOM
killer) when it sees it, and a rank it finds stopped (SIGSTOP) as stalled; once the root
cause is known it kills the remaining ranks and this command exits 1 naming the root
cause: the first rank that recorded an error of its own, died or stalled, else the first
collateral one; the other failed ranks are listed as collateral.
Exit codes: 0 success, 1 training failed (or diverged), 2 invalid config or a refused
run (log.dir in use by another run: :mod:`mimotron.run_lock`; a finished run launched
again: "nothing to train"), 3 (a rank's own code) stopped because a peer failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any

from mimotron.config.limits import check_local_ranks
from mimotron.config.load import load_config
from mimotron.config.schema import MimoConfig
from mimotron.failures import (
    FAILURE_DIR_ENV,
    FailureRecord,
    consequence_note,
    death_summary,
    first_per_rank,
    is_peer_loss,
    one_line,
    read_failures,
    record_exception,
    record_failure,
    root_cause,
)
from mimotron.parallel.layout import check_layout

EXIT_FAILED, EXIT_CONFIG, EXIT_PEER_FAILED = 1, 2, 3
DEBUG_ENV = "MIMOTRON_DEBUG"


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def run_train(config: str, overrides: list[str]) -> int:
    """Exit code 0 on success; 2 on a bad config or a refused run; 1 when training fails."""
    from mimotron.run_dir import RunRefused, prepare_run_dir
    from mimotron.run_lock import run_lock

    with contextlib.ExitStack() as held:  # The run lock, until the ranks have ended.
        try:
            cfg = load_config(config, overrides)
            env_world = int(os.environ["WORLD_SIZE"]) if _under_launcher() else None
            layout = check_layout(cfg, env_world_size=env_world)
            check_local_ranks(layout.world_size, launched=not _under_launcher())
            if not _under_launcher():  # Every sample checked once, before any rank starts.
                from mimotron.config.context_length import context_length_note
                from mimotron.data.run_data import check_data

                check_data(cfg)
                note = context_length_note(cfg)
                if note:
                    print(f"mimotron train: {note}", file=sys.stderr)
            held.enter_context(run_lock(cfg))  # Before anything in the run dir is touched.
            # Before any launch: a bad checkpoint.load, an unwritable directory, a previous
            # run a fresh start would clobber (moved aside by one process with overwrite).
            prepare_run_dir(cfg)
        except RunRefused as exc:  # In use, or nothing left to train: not the config's.
            print(f"mimotron train: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        except (ValueError, RuntimeError) as exc:  # RuntimeError: CheckpointError
            print(f"mimotron train: invalid config: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        if not _under_launcher() and layout.world_size > 1:
            return _launch(config, overrides, layout.world_size, cfg)
        return _train_this_rank(cfg)


def _launch(config: str, overrides: list[str], world_size: int, cfg: MimoConfig) -> int:
    """Re-run ``mimotron train`` on ``world_size`` local ranks; report how they ended."""
    from mimotron.checkpoint.signals import read_stop_record
    from mimotron.cli.launch import Launcher, failure_folder
    from mimotron.cli.lines import whole_lines

    # One thread per rank: ranks share the cores (torchrun sets this too, quietly).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    argv = [sys.executable, "-m", "mimotron", "train", config, *overrides]
    restore_streams = whole_lines()  # The launcher's lines share the ranks' terminal.
    launcher = Launcher(argv, world_size, "", cfg.train.pg_timeout_s)
    try:
        # A stop signal between creating the failure folder and removing it goes to the
        # launcher (which passes it on), never kills this process with the folder left.
        with launcher.handling_signals(), failure_folder() as failure_dir:
            launcher.failure_dir = failure_dir
            trace_dir = _trace_dir(failure_dir)
            result = launcher.run()
            stop = read_stop_record(failure_dir)
            records = read_failures(failure_dir)
            code = _report(result, launcher.killed, stop, records, world_size, cfg)
            return code if code or trace_dir is None else _replay(trace_dir, world_size)
    finally:
        restore_streams()


def _trace_dir(failure_dir: str) -> str | None:
    """Where the ranks record their communication when ``MIMOTRON_NCCL_CHECK=1``."""
    from mimotron.commcheck import CHECK_ENV, TRACE_ENV

    if os.environ.get(CHECK_ENV) != "1":
        return None
    os.environ[TRACE_ENV] = os.path.join(failure_dir, "trace")  # the ranks inherit it
    return os.environ[TRACE_ENV]


def _replay(trace_dir: str, world_size: int) -> int:
    """Replay a successful launch's communication under NCCL's rules; the exit code."""
    from mimotron.commcheck import replay_folder

    if len(os.listdir(trace_dir) if os.path.isdir(trace_dir) else []) < world_size:
        return 0  # a rank stopped before recording (a stop signal): nothing to replay
    report = replay_folder(trace_dir)
    if not report.ok:
        _say(f"the ranks' communication would hang under NCCL: {report.text}")
        return EXIT_FAILED
    return 0


def _report(result: Any, killed: set[int], stop: dict[str, Any] | None,
            records: list[FailureRecord], world_size: int, cfg: MimoConfig) -> int:
    """Say how a launch ended (a failure's root cause, a signal stop's save); exit code."""
    from mimotron.checkpoint import CheckpointError, read_latest

    latest = None
    with contextlib.suppress(CheckpointError, OSError):  # Only for the report.
        latest = read_latest(cfg.checkpoint_dir) if cfg.checkpoint_dir.is_dir() else None
    where = f"latest checkpoint: iteration {latest}" if latest is not None else \
        f"no checkpoint in {cfg.checkpoint_dir}"
    if result.aborted:
        _say(f"aborted by a second Ctrl-C: the ranks were killed without saving ({where})")
        return EXIT_FAILED
    signal_name = result.signal_name or (stop or {}).get("signal") or "a signal"
    aborted = [r for r in records if r.kind == "aborted"]
    if aborted:  # A second signal insisted while the stop's save was written.
        _say(f"stopped by {signal_name}, then {aborted[0].summary}: not saved ({where})")
        return EXIT_FAILED
    failed = {r: c for r, c in result.failed.items() if r not in killed}
    if failed or records:
        verdict, code = _failure_verdict(result.exit_codes, records, world_size, killed)
        if stop is not None and stop.get("saved") is not None:
            # The stop's save was complete; something failed on the way out after it.
            _say(f"stopped by {signal_name}; saved iteration {stop['saved']} to "
                 f"{cfg.checkpoint_dir}, then {verdict}")
            return code
        _say(verdict)
        if result.signal_name or stop is not None:
            _say(f"stopped by {signal_name}: not saved ({where})")
        return code
    if stop is not None:
        return _report_stop(stop, cfg)
    if result.signal_name:
        _say(f"{result.signal_name} arrived after training finished; nothing left to stop")
    return 0


def _say(text: str) -> None:
    print(f"mimotron train: {text}", file=sys.stderr, flush=True)


def _report_stop(stop: dict[str, Any], cfg: MimoConfig) -> int:
    """The ranks stopped on a signal: say what they saved; 0 only when they did."""
    saved = stop.get("saved")
    if stop.get("began") is False:
        _say(f"stopped by {stop.get('signal')} before training began: nothing to save")
        return EXIT_FAILED
    if saved is None:
        _say(f"stopped by {stop.get('signal')} after iteration {stop.get('iteration')}: "
             "not saved")
        return EXIT_FAILED
    _say(f"stopped by {stop.get('signal')}; saved iteration {saved} to {cfg.checkpoint_dir} "
         "(resume with checkpoint.load=auto)")
    return 0


def _failure_verdict(exit_codes: dict[int, int], records: list[FailureRecord],
                     world_size: int, killed: set[int]) -> tuple[str, int]:
    """Name the root cause of a failed launch (see the module docstring).

    Returns:
        ``(verdict, exit code)``: the verdict starts with ``rank R failed (``.

    Args:
        exit_codes: global rank -> exit code (negative: the signal that ended it).
        records: the failure records (the ranks' own and the launcher's), in order.
        world_size: number of ranks.
        killed: ranks the launcher killed once the cause was known (collateral).
    """
    records = first_per_rank(records)
    recorded = {r.rank for r in records}
    # The launcher records deaths as it sees them; this only covers a record lost to a
    # full disk.
    after = max((r.seq for r in records), default=-1) + 1
    unreported = sorted(r for r, c in exit_codes.items()
                        if c != 0 and r not in recorded and r not in killed)
    records += [FailureRecord(after + i, rank, "died", death_summary(exit_codes[rank]))
                for i, rank in enumerate(unreported)]
    root = root_cause(records)
    if root is None:
        return "the ranks were stopped without reporting an error", EXIT_FAILED
    stopped = sorted(set(range(world_size)) - {r.rank for r in records} - {root.rank})
    note = consequence_note(records, root, stopped=stopped)
    code = root.exit_code if root.exit_code is not None else exit_codes.get(root.rank, 1)
    if root.kind in ("died", "stalled", "aborted"):
        what = f"({root.summary})"
    elif root.kind == "peer":
        what = f"(exit code {code}) after losing a peer; no rank reported its own error"
    else:
        what = f"(exit code {code}): {root.summary}"
    return (f"rank {root.rank} failed {what}{note}",
            EXIT_CONFIG if code == EXIT_CONFIG and root.kind == "error" else EXIT_FAILED)


def _debug() -> bool:
    """``MIMOTRON_DEBUG=1`` (``mimotron --debug``): full tracebacks from every rank."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _traceback(always: bool = False) -> str:
    """The current exception's traceback, when it is a bug or debugging is on."""
    return f"\n{traceback.format_exc()}" if always or _debug() else ""


def _train_this_rank(cfg: MimoConfig) -> int:
    from mimotron.checkpoint.signals import StopSignals, unblock_stop_signals
    from mimotron.cli.lines import whole_lines
    from mimotron.lifeline import die_with_parent, launched_parent

    parent = launched_parent()
    if parent is not None:
        die_with_parent(parent)
    restore_streams = whole_lines()  # Ranks share the terminal: never half a line.
    # Before set-up, so a stop signal during it is kept; the loop adopts these handlers.
    stop = StopSignals().install()
    # The launcher starts ranks with the stop signals blocked (a signal during the imports
    # and config checks above must neither kill a rank nor raise KeyboardInterrupt);
    # unblocking delivers a pending one to the handlers just installed.
    unblock_stop_signals()
    try:
        return _train_rank(cfg, stop)
    finally:
        stop.restore()
        restore_streams()


def _train_rank(cfg: MimoConfig, stop: Any) -> int:
    import torch

    from mimotron.commcheck import finish_recording, start_recording
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import run_training
    from mimotron.training.metrics import TrainingDivergedError

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runtime = init_runtime(cfg.train.pg_timeout_s)
    prefix = f"mimotron train: rank {runtime.rank}"
    failure_dir = os.environ.get(FAILURE_DIR_ENV)
    recorder = start_recording(runtime.rank)  # None unless the launcher asks for a trace
    try:
        run_training(cfg, runtime)
        finish_recording(recorder)
    except ValueError as exc:
        # A user error found while building the run (e.g. a schedule the config allows
        # but the model cannot take).
        record_exception(failure_dir, runtime.rank, exc, EXIT_CONFIG)
        print(f"{prefix}: invalid config: {exc}{_traceback()}", file=sys.stderr, flush=True)
        _abort()
        return EXIT_CONFIG
    except TrainingDivergedError as exc:
        # Every rank raises at the same iteration: one line, and a clean shutdown.
        record_exception(failure_dir, runtime.rank, exc, EXIT_FAILED)
        if runtime.is_main:
            print(f"mimotron train: {exc}", file=sys.stderr, flush=True)
        _shutdown()
        return EXIT_FAILED
    except KeyboardInterrupt:
        # A signal insisted while the stop's save was being written (see signals.py).
        summary = _abort_summary(stop)
        record_failure(failure_dir, runtime.rank, "aborted", summary, EXIT_FAILED)
        print(f"{prefix}: {summary}; this save is incomplete", file=sys.stderr, flush=True)
        _abort()
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - report, abort peers, exit non-zero
        return _rank_failed(exc, runtime.rank, failure_dir)
    _shutdown()
    return 0


def _abort_summary(stop: Any) -> str:
    """What a KeyboardInterrupt in the training loop interrupted (for the failure record)."""
    import signal

    name = signal.Signals(stop.aborted_by or signal.SIGINT).name
    if stop.saving_iteration is None:
        return f"interrupted by a second {name}"
    return f"aborted during the save of iteration {stop.saving_iteration} by a second {name}"


def _rank_failed(exc: Exception, rank: int, failure_dir: str | None) -> int:
    """Record, report (one line; a traceback for a bug) and abort; the exit code."""
    from mimotron.checkpoint.files import CheckpointError

    # Record first: this rank's connections stay open until it aborts or exits, so
    # no peer can fail "because of" it before the record exists.
    peer = is_peer_loss(exc)
    record_failure(failure_dir, rank, "peer" if peer else "error", one_line(exc),
                   EXIT_PEER_FAILED if peer else EXIT_FAILED)
    prefix = f"mimotron train: rank {rank}"
    if peer:
        # A peer died or timed out under us: one line; the peer's own report is the one
        # to read.
        print(f"{prefix}: stopped because a peer failed ({one_line(exc)}){_traceback()}",
              file=sys.stderr, flush=True)
        _abort()
        return EXIT_PEER_FAILED
    # Checkpoint, disk and directory errors are the environment's, not a bug: one line.
    bug = not isinstance(exc, (CheckpointError, OSError))
    print(f"{prefix} failed: {type(exc).__name__}: {exc}{_traceback(always=bug)}",
          file=sys.stderr, flush=True)
    _abort()
    return EXIT_FAILED


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _abort() -> None:
    """Tear down without waiting on peers (they may be stuck in a collective)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        return
    abort = getattr(dist, "abort_process_group", None) or getattr(
        c10d, "_abort_process_group", None)
    # Best effort on the way out: the group may already be broken, and some backends
    # (gloo) cannot abort; exiting closes their connections anyway.
    with contextlib.suppress(Exception):
        if abort is not None:
            abort()
