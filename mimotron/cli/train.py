"""``mimotron train``: validate, launch ranks if needed, train, summarise.

Outside a launcher, a layout needing N > 1 ranks re-runs this command under torch's
elastic launcher (``torchrun --standalone --nproc-per-node N``). Under ``torchrun``
(``TORCHELASTIC_RUN_ID`` or ``RANK`` set, single- or multi-node) each rank checks
WORLD_SIZE against the layout and trains. A bad config exits 2 with one line, before any
process group exists.

Failures: a rank that raises records its failure (:mod:`mimotron.failures`, in a
directory the launcher passes down as ``MIMOTRON_FAILURE_DIR``), prints its traceback
and aborts its process groups; its peers, blocked on it in a collective, fail fast (the
connection closes) or at the latest after ``train.pg_timeout_s``, record themselves as
collateral and say so in one line (exit code 3). The launcher stops every rank and this
command exits 1 naming the root cause, whatever order the ranks exited in: the first
rank that recorded an error of its own, else a rank that died without a report (a
signal), else the first collateral one; the other failed ranks are listed as collateral.
Known limit: torch's launcher gives no time of death, so a rank killed by a signal is
ordered after every recorded error; if a peer then fails with an error not recognised as
a lost peer, that peer is named instead (the test harness, which sees deaths as they
happen, has no such gap).
Exit codes: 0 success, 1 training failed (or diverged), 2 invalid config, 3 (a rank's
own code) stopped because a peer failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from typing import Any

from mimotron.config import MimoConfig, load_config
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
from mimotron.parallel.layout import plan_layout

EXIT_FAILED, EXIT_CONFIG, EXIT_PEER_FAILED = 1, 2, 3


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def run_train(config: str, overrides: list[str]) -> int:
    """Exit code 0 on success; 2 on a bad config; 1 when training fails."""
    try:
        cfg = load_config(config, overrides)
        env_world = int(os.environ["WORLD_SIZE"]) if _under_launcher() else None
        layout = plan_layout(cfg, env_world_size=env_world)
        from mimotron.run_dir import prepare_run_dir

        # Before any launch: a bad checkpoint.load, an unwritable directory, a previous
        # run a fresh start would clobber (moved aside by one process with overwrite).
        prepare_run_dir(cfg)
    except (ValueError, RuntimeError) as exc:  # RuntimeError: CheckpointError
        print(f"mimotron train: invalid config: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not _under_launcher() and layout.world_size > 1:
        return _launch(config, overrides, layout.world_size)
    return _train_this_rank(cfg)


def _launch(config: str, overrides: list[str], world_size: int) -> int:
    """Re-run ``mimotron train`` on ``world_size`` local ranks with torch's launcher."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={world_size}", "--max-restarts=0",
        "--monitor-interval=0.5", "-m", "mimotron", "train", config, *overrides,
    ])
    # One thread per rank: ranks share the cores (torchrun sets this too, quietly).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    with tempfile.TemporaryDirectory(prefix="mimotron-failures-") as failure_dir:
        previous = os.environ.get(FAILURE_DIR_ENV)
        os.environ[FAILURE_DIR_ENV] = failure_dir  # The ranks inherit it.
        try:
            run(args)
        except SignalException as exc:
            # SIGTERM/SIGINT reached the launcher, which passed it on: the ranks finish
            # their step, save (when checkpointing is configured) and stop.
            print(f"mimotron train: stopped by signal {exc.sigval.name}; the ranks saved "
                  "and exited (resume with checkpoint.load=auto)", file=sys.stderr)
            return 0
        except ChildFailedError as exc:
            return _report_failure(exc.failures, read_failures(failure_dir), world_size)
        finally:
            if previous is None:
                os.environ.pop(FAILURE_DIR_ENV, None)
            else:
                os.environ[FAILURE_DIR_ENV] = previous
    return 0


def _report_failure(failures: dict[int, Any], records: list[FailureRecord],
                    world_size: int) -> int:
    """Name the root cause of a failed launch (see the module docstring); the exit code.

    Args:
        failures: global rank -> torch's ``ProcessFailure`` for the ranks the launcher saw
            exit non-zero (before it stopped the others).
        records: the ranks' failure records, in failure order.
        world_size: number of ranks.
    """
    records = first_per_rank(records)
    recorded = {r.rank for r in records}
    # Ranks that exited without a record (a signal, a crash) come after every record: the
    # launcher noticed them only when it polled.
    unreported = sorted(set(failures) - recorded)
    records += [FailureRecord(len(records) + i, rank, "died",
                              death_summary(failures[rank].exitcode))
                for i, rank in enumerate(unreported)]
    root = root_cause(records)
    if root is None:  # No rank recorded anything (e.g. the ranks ran an older mimotron).
        rank = min(failures)
        root = FailureRecord(0, rank, "died", death_summary(failures[rank].exitcode))
    stopped = sorted(set(range(world_size)) - {r.rank for r in records} - {root.rank})
    note = consequence_note(records, root, stopped=stopped)
    code = root.exit_code
    if code is None:
        code = failures[root.rank].exitcode if root.rank in failures else EXIT_FAILED
    if root.kind == "died":
        what = f"({root.summary})"
    elif root.kind == "peer":
        what = f"(exit code {code}) after losing a peer; no rank reported its own error"
    else:
        what = f"(exit code {code}); its error is printed above"
    print(f"mimotron train: rank {root.rank} failed {what}{note}", file=sys.stderr)
    return EXIT_CONFIG if code == EXIT_CONFIG and root.kind == "error" else EXIT_FAILED


def _train_this_rank(cfg: MimoConfig) -> int:
    import torch

    from mimotron.runtime import init_runtime
    from mimotron.training.loop import run_training
    from mimotron.training.metrics import TrainingDivergedError

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runtime = init_runtime(cfg.train.pg_timeout_s)
    prefix = f"mimotron train: rank {runtime.rank}"
    failure_dir = os.environ.get(FAILURE_DIR_ENV)
    try:
        run_training(cfg, runtime)
    except ValueError as exc:
        # A user error found while building the run (e.g. a schedule the config allows
        # but the model cannot take).
        record_exception(failure_dir, runtime.rank, exc, EXIT_CONFIG)
        print(f"{prefix}: invalid config: {exc}", file=sys.stderr, flush=True)
        _abort()
        return EXIT_CONFIG
    except TrainingDivergedError as exc:
        # Every rank raises at the same iteration: one line, and a clean shutdown.
        record_exception(failure_dir, runtime.rank, exc, EXIT_FAILED)
        if runtime.is_main:
            print(f"mimotron train: {exc}", file=sys.stderr, flush=True)
        _shutdown()
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - report, abort peers, exit non-zero
        # Record first: this rank's connections stay open until it aborts or exits, so
        # no peer can fail "because of" it before the record exists.
        peer = is_peer_loss(exc)
        record_failure(failure_dir, runtime.rank, "peer" if peer else "error", one_line(exc),
                       EXIT_PEER_FAILED if peer else EXIT_FAILED)
        if not peer:
            print(f"{prefix} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            _abort()
            return EXIT_FAILED
        # A peer died or timed out under us: one line; the peer's own report is the one
        # to read.
        print(f"{prefix}: stopped because a peer failed ({one_line(exc)})",
              file=sys.stderr, flush=True)
        _abort()
        return EXIT_PEER_FAILED
    _shutdown()
    return 0


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
