"""``mimotron train``: validate, launch ranks if needed, train, summarise.

Outside a launcher, a layout needing N > 1 ranks re-runs this command under torch's
elastic launcher (``torchrun --standalone --nproc-per-node N``). Under ``torchrun``
(``TORCHELASTIC_RUN_ID`` set) each rank checks WORLD_SIZE against the layout and trains.
A bad config exits 2 with one line, before any process group exists.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

from mimotron.config import MimoConfig, load_config
from mimotron.parallel.layout import plan_layout


def _under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def run_train(config: str, overrides: list[str]) -> int:
    """Exit code 0 on success; 2 on a bad config; 1 when training fails."""
    try:
        cfg = load_config(config, overrides)
        env_world = int(os.environ["WORLD_SIZE"]) if _under_launcher() else None
        layout = plan_layout(cfg, env_world_size=env_world)
    except ValueError as exc:
        print(f"mimotron train: invalid config: {exc}", file=sys.stderr)
        return 2
    if not _under_launcher() and layout.world_size > 1:
        return _launch(config, overrides, layout.world_size)
    return _train_this_rank(cfg)


def _launch(config: str, overrides: list[str], world_size: int) -> int:
    """Re-run ``mimotron train`` on ``world_size`` local ranks with torch's launcher."""
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
    except ChildFailedError as exc:
        first = min(exc.failures)
        failure = exc.failures[first]
        print(f"mimotron train: rank {failure.rank} failed (exit code {failure.exitcode}); "
              f"see its error above. {failure.message or ''}".strip(), file=sys.stderr)
        return 1
    return 0


def _train_this_rank(cfg: MimoConfig) -> int:
    import torch

    from mimotron.runtime import init_runtime
    from mimotron.training.loop import run_training

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    runtime = init_runtime(cfg.train.pg_timeout_s)
    try:
        summary = run_training(cfg, runtime)
    except Exception as exc:  # noqa: BLE001 - report, abort peers, exit non-zero
        print(f"mimotron train: rank {runtime.rank} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        traceback.print_exc()
        _abort()
        return 1
    if runtime.is_main or summary.get("is_logging_rank"):
        _print_summary(cfg, summary)
    _shutdown()
    return 0


def _print_summary(cfg: MimoConfig, summary: dict) -> None:
    ev = summary.get("eval", {})
    print(f"done: {summary['iteration']} iterations in {summary['wall_time_s']:.1f} s | "
          f"final loss {summary.get('loss', float('nan')):.4f} | "
          + " | ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "eval_samples")
          + f" | metrics: {cfg.log_dir / 'metrics.jsonl'}", flush=True)


def _shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _abort() -> None:
    """Tear down without waiting on peers (they may be stuck in a collective)."""
    import torch.distributed as dist

    if dist.is_initialized():
        # Best effort on the way out: the group may already be broken.
        with contextlib.suppress(Exception):
            if hasattr(dist, "abort_process_group"):
                dist.abort_process_group()
