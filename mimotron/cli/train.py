"""``mimotron train``: validate, launch ranks if needed, train, summarise.

Outside a launcher, a layout needing N > 1 ranks re-runs this command under torch's
elastic launcher (``torchrun --standalone --nproc-per-node N``). Under ``torchrun``
(``TORCHELASTIC_RUN_ID`` or ``RANK`` set, single- or multi-node) each rank checks
WORLD_SIZE against the layout and trains. A bad config exits 2 with one line, before any
process group exists.

Failures: a rank that raises prints its traceback and aborts its process groups; its
peers, blocked on it in a collective, fail fast (the connection closes) or at the
latest after ``train.pg_timeout_s``, and report themselves as collateral in one line
(exit code 3); the launcher then stops every rank and this command exits 1 naming the
rank that failed first. Exit codes: 0 success, 1 training failed (or diverged), 2
invalid config, 3 (a rank's own code) stopped because a peer failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

from mimotron.config import MimoConfig, load_config
from mimotron.parallel.layout import plan_layout

EXIT_FAILED, EXIT_CONFIG, EXIT_PEER_FAILED = 1, 2, 3
PEER_FAILURE_GRACE_S = 2.0


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def run_train(config: str, overrides: list[str]) -> int:
    """Exit code 0 on success; 2 on a bad config; 1 when training fails."""
    try:
        cfg = load_config(config, overrides)
        env_world = int(os.environ["WORLD_SIZE"]) if _under_launcher() else None
        layout = plan_layout(cfg, env_world_size=env_world)
        if cfg.checkpoint.load != "none":
            from mimotron.checkpoint import resolve_load

            # A missing checkpoint path is a config error: catch it before any launch.
            resolve_load(cfg.checkpoint.load, cfg.checkpoint_dir)
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
    try:
        run(args)
    except SignalException as exc:
        # SIGTERM/SIGINT reached the launcher, which passed it on: the ranks finish their
        # step, save (when checkpointing is configured) and stop — a requested stop.
        print(f"mimotron train: stopped by signal {exc.sigval.name}; the ranks saved and "
              "exited (resume with checkpoint.load=auto)", file=sys.stderr)
        return 0
    except ChildFailedError as exc:
        # The root cause is a rank that failed on its own, not one stopped by a peer.
        # (Negative codes are signals: ranks the launcher stopped after the failure.)
        failures = sorted(exc.failures.items(), key=lambda kv: (
            kv[1].exitcode == EXIT_PEER_FAILED or kv[1].exitcode < 0, kv[0]))
        rank, failure = failures[0]
        print(f"mimotron train: rank {rank} failed (exit code {failure.exitcode}); its "
              "error is printed above", file=sys.stderr)
        return EXIT_CONFIG if failure.exitcode == EXIT_CONFIG else EXIT_FAILED
    return 0


def _train_this_rank(cfg: MimoConfig) -> int:
    import torch

    from mimotron.runtime import init_runtime
    from mimotron.training.loop import run_training
    from mimotron.training.metrics import TrainingDivergedError

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runtime = init_runtime(cfg.train.pg_timeout_s)
    prefix = f"mimotron train: rank {runtime.rank}"
    try:
        run_training(cfg, runtime)
    except ValueError as exc:
        # A user error found while building the run (e.g. a schedule the config allows
        # but the model cannot take).
        print(f"{prefix}: invalid config: {exc}", file=sys.stderr, flush=True)
        _abort()
        return EXIT_CONFIG
    except TrainingDivergedError as exc:
        # Every rank raises at the same iteration: one line, and a clean shutdown.
        if runtime.is_main:
            print(f"mimotron train: {exc}", file=sys.stderr, flush=True)
        _shutdown()
        return EXIT_FAILED
    except Exception as exc:  # noqa: BLE001 - report, abort peers, exit non-zero
        if not _peer_failure(exc):
            print(f"{prefix} failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            _abort()
            return EXIT_FAILED
        # A peer died or timed out under us: one line; the peer's own report is the one
        # to read.
        print(f"{prefix}: stopped because a peer failed ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr, flush=True)
        _abort()
        # Let the rank that failed first exit first, so the launcher (which polls every
        # 0.5 s) reports the root cause rather than this collateral stop.
        time.sleep(PEER_FAILURE_GRACE_S)
        return EXIT_PEER_FAILED
    _shutdown()
    return 0


def _peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says another rank failed (closed connection, timeout) rather than us."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer",
                            "Timed out", "timed out", "Socket Timeout"))


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
