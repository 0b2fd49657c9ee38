"""Shared test configuration: a small model, layout helpers, and a multi-step runner.

Every engine test trains this small version of the demo model so that a multi-rank case
takes seconds; layouts are written as ``key=value`` overrides of ``configs/digits.toml``.
"""

from __future__ import annotations

from pathlib import Path

from mimotron.config import load_config
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.step import default_forward_step, train_step_mimo

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
MODULES = ("vision", "audio", "language")

# The demo model, shrunk; warm-up short enough for runs of a few iterations.
SMALL_MODEL = [
    "modules.vision.hidden_size=32", "modules.vision.num_layers=1",
    "modules.audio.hidden_size=32", "modules.language.hidden_size=64",
    "train.global_batch_size=16", "train.micro_batch_size=8", "scheduler.warmup_iters=2",
]
# For training-math tests: clipping at 0.5 so clipping is exercised; no evaluation.
BASE = [*SMALL_MODEL, "optimizer.lr=3e-3", "optimizer.clip_grad=0.5", "eval.interval=1000"]
NUM_ITERS = 5


def par(module: str, **kw: int) -> list[str]:
    """Overrides of one module's ``parallel`` table."""
    return [f"modules.{module}.parallel.{k}={v}" for k, v in kw.items()]


def colocated(dp: int) -> list[str]:
    """Every module on ranks ``[0, dp)`` with data parallelism ``dp``."""
    return [item for m in MODULES for item in par(m, data=dp, rank_offset=0)]


ONE_RANK = colocated(1)


def train_steps(rank: int, world: int, overrides: list[str], num_iters: int) -> list[tuple]:
    """Train ``num_iters`` iterations through the real engine on this rank.

    Returns:
        Per iteration ``(loss, grad_norm, skipped, num_loss_tokens)``.
    """
    cfg = load_config(DIGITS, BASE + overrides)
    run = setup_mimo(cfg, init_runtime())
    out = []
    for _ in range(num_iters):
        loss, skipped, grad_norm, _ = train_step_mimo(
            default_forward_step, run.train_data_iterator, run.model, run.optimizer,
            run.schedulers, run.global_state, run.communicator, infra=run.infra)
        out.append((loss["loss"], grad_norm, skipped, loss["num_tokens"]))
    return out
