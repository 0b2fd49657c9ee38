"""Mixed precision and fp16 dynamic loss scaling through the real engine.

* bf16 and fp16 (``torch.autocast``; fp32 weights and optimizer state) follow the fp32
  loss curve over 20 iterations of the digits task. Tolerance, per iteration, relative
  to the fp32 loss: 5% for bf16, 1% for fp16. Why: the curves start identical and drift
  apart only through rounding, which compounds over steps; a rounding unit is 2^-8 for
  bf16 and 2^-11 for fp16, and on this machine the largest per-iteration gaps measured
  were 1.3% (bf16) and 0.2% (fp16), so the bounds leave 4-5x headroom while the loss
  itself falls by ~75% over the run (a broken precision path misses by far more). The
  curves must also differ from fp32 (autocast really ran).
* Encoder outputs (what crosses the bridge) are in the compute dtype.
* fp16 uses the loss scale (1024 here): the schedule multiplies the loss by
  ``optimizer.get_loss_scale()`` and ``prepare_grads`` divides the gradients, so the
  grad norm matches fp32 (a missing unscale or scale would be off by 1024x).
* Overflow, non-colocated (vision rank 0, audio rank 1, language rank 2): an inf put
  into one vision gradient on rank 0 at one iteration makes every rank skip that step,
  no scheduler advances, no weight moves, and every module's scale follows its own
  settings identically on every rank: hysteresis 1 halves audio's and language's,
  vision's own ``hysteresis = 2`` absorbs the overflow; backward then uses the minimum.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimotron.config import load_config
from mimotron.forked_ranks import run_groups, run_ranks
from mimotron.runtime import compute_dtype, init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import autocast_factory, default_forward_step
from tests.common import BASE as COMMON_BASE
from tests.common import MODULES, ONE_RANK

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
BASE = [
    *COMMON_BASE,
    # fp16: a scale that does not overflow at the start, no growth within a test.
    "optimizer.initial_loss_scale=1024", "optimizer.loss_scale_window=1000",
]
NONCOLOCATED = [f"modules.{m}.parallel.{k}={v}" for i, m in enumerate(MODULES)
                for k, v in (("data", 1), ("rank_offset", i))]
NUM_CURVE_ITERS = 20
TOLERANCE = {"bf16": 0.05, "fp16": 0.01}


def _step(run) -> tuple:  # noqa: ANN001 - MimoRun
    loss, skipped, grad_norm, _ = train_step_mimo(
        default_forward_step, run.train_data_iterator, run.model, run.optimizer,
        run.schedulers, run.global_state, run.communicator, infra=run.infra)
    return loss["loss"], skipped, grad_norm, float(run.optimizer.get_loss_scale())


def _curve(rank: int, world: int, precision: str) -> tuple[list[tuple], list[torch.dtype]]:
    cfg = load_config(DIGITS, BASE + ONE_RANK + [f"train.precision={precision}"])
    run = setup_mimo(cfg, init_runtime())
    steps = [_step(run) for _ in range(NUM_CURVE_ITERS)]
    # What an encoder hands to the bridge: its output under the step's autocast.
    mb = next(run.train_data_iterator)[0]
    with torch.no_grad(), autocast_factory(precision, run.global_state.runtime.device)():
        dtypes = [run.model.encode(m, mb[m]).dtype for m in ("vision", "audio")]
    return steps, dtypes


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[tuple], list[torch.dtype]]]:
    # Three independent one-rank runs, side by side (the cores they leave idle).
    precisions = ("fp32", "bf16", "fp16")
    results = run_groups([(1, _curve, (p,), {}) for p in precisions], timeout_s=240)
    return {p: r[0] for p, r in zip(precisions, results, strict=True)}


@pytest.fixture(scope="module")
def curves(runs: dict) -> dict[str, list[tuple]]:
    return {p: r[0] for p, r in runs.items()}


def test_encoder_outputs_cross_in_the_compute_dtype(runs: dict) -> None:
    assert {p: r[1] for p, r in runs.items()} == {
        p: [compute_dtype(p)] * 2 for p in ("fp32", "bf16", "fp16")}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(curves: dict, precision: str) -> None:
    ref, got = curves["fp32"], curves[precision]
    assert ref[-1][0] < 0.5 * ref[0][0]  # the reference really learns
    gaps = [abs(g[0] - r[0]) / r[0] for g, r in zip(got, ref, strict=True)]
    assert max(gaps) <= TOLERANCE[precision], gaps
    assert max(gaps) > 1e-6  # autocast really computed in lower precision
    assert not any(g[1] for g in got)
    expected_scale = 1024.0 if precision == "fp16" else 1.0
    assert all(g[3] == expected_scale for g in got)


def test_fp16_gradients_are_unscaled(curves: dict) -> None:
    for g, r in zip(curves["fp16"], curves["fp32"], strict=True):
        assert g[2] == pytest.approx(r[2], rel=0.05)  # measured <= 1.9%; scale is 1024


# ---- overflow in one encoder on one rank ----------------------------------------------

INJECT_AT = 2  # 0-based iteration whose vision gradient gets an inf (on rank 0 only)
NUM_OVERFLOW_ITERS = 5


def _overflow(rank: int, world: int) -> dict:
    cfg = load_config(DIGITS, BASE + NONCOLOCATED + [
        "train.precision=fp16", "optimizer.hysteresis=1", "scheduler.warmup_iters=0",
        "modules.vision.optimizer.hysteresis=2"])
    run = setup_mimo(cfg, init_runtime())
    fired = []

    def poison(p: torch.Tensor) -> None:
        p.grad.view(-1)[0] = float("inf")
        fired.append(True)

    out: dict = {"steps": [], "scales": [], "moved": []}
    for it in range(NUM_OVERFLOW_ITERS):
        handle = None
        if rank == 0 and it == INJECT_AT:
            param = next(run.model.modality_submodules["vision"].parameters())
            handle = param.register_post_accumulate_grad_hook(poison)
        before = [p.detach().clone() for p in run.model.parameters()]
        out["steps"].append(_step(run))
        if handle is not None:
            handle.remove()
        out["moved"].append(any(not torch.equal(a, p) for a, p in
                                zip(before, run.model.parameters(), strict=True)))
        out["scales"].append({n: float(i.loss_scaler.scale)
                              for n, i in run.optimizer.module_infos.items()})
    out["fired"] = bool(fired)
    out["sched_steps"] = {n: s.num_steps for n, s in run.schedulers.items()}
    out["modules"] = sorted(run.schedulers)
    return out


def test_inf_in_one_encoder_skips_everywhere_and_backs_off_every_scale() -> None:
    results = run_ranks(3, _overflow, timeout_s=240)
    assert results[0]["fired"]  # the inf really landed in a vision gradient
    assert [r["modules"] for r in results] == [["vision"], ["audio"], ["language"]]
    want_skipped = [it == INJECT_AT for it in range(NUM_OVERFLOW_ITERS)]
    for rank, r in enumerate(results):
        assert [s[1] for s in r["steps"]] == want_skipped, f"rank {rank}"
        assert r["steps"][INJECT_AT][2] is None  # no grad norm for a skipped step
        assert r["moved"] == [not s for s in want_skipped], f"rank {rank}: weights"
        for it, scales in enumerate(r["scales"]):
            want = 1024.0 if it < INJECT_AT else 512.0
            assert scales == {"audio": want, "language": want, "vision": 1024.0}, (
                f"rank {rank} iter {it}")
            assert r["steps"][it][3] == want  # the minimum of the scales
        # Schedulers advance on successful steps only.
        assert all(n == NUM_OVERFLOW_ITERS - 1 for n in r["sched_steps"].values())
    # Every rank agrees on the loss (it is reduced from the language rank).
    assert all(r["steps"][it][0] == results[2]["steps"][it][0]
               for r in results for it in range(NUM_OVERFLOW_ITERS))
