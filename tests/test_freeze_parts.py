"""Freezing by part: LLaVA's stage 1 trains the projectors alone, like the plain loop.

``modules.<m>.freeze = "encoder"`` freezes an encoder's tower and trains its projector;
with ``modules.language.freeze = true`` only the projectors train (stage 1). Each case
trains 10 fp32 iterations through the real engine and compares with
``tests.reference.reference_run`` (which freezes the same parameters by name, on its
own): losses, grad norms, zero-gradient counts, per-module grad norms where the harness
sees them, and the final weights; every frozen tower and language model weight must be
bitwise its initial value, every projector weight must have moved.

* a split layout (vision PP 2 | audio | language PP 2): the vision stage without a
  projector holds nothing that trains, and the frozen language model passes gradients
  back through its own pipeline to the projectors;
* a colocated layout (vision FSDP2 over DP 2, audio ZeRO-1 over DP 2, language TP 2),
  run by the training loop with checkpoints, which also resumes bit for bit: iterations
  6-10 resumed from the checkpoint at 5 equal those of the straight run (metrics
  records and final weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mimotron.checkpoint.export import read_full_model
from mimotron.config import load_config
from mimotron.runtime import init_runtime
from mimotron.testing import run_ranks
from mimotron.training.loop import run_training
from tests.common import BASE, DIGITS, coloc, engine_run, noncolocated
from tests.reference import ReferenceRun, frozen, reference_run
from tests.test_parity import (
    LOSS_REL,
    PARITY,
    assert_module_norms_match,
    assert_steps_match,
    assert_weights_match,
    world_size,
)

NUM_ITERS = 10
STAGE1 = ["modules.vision.freeze=encoder", "modules.audio.freeze=encoder",
          "modules.language.freeze=true"]
SPLIT = noncolocated({"pipeline": 2}, {}, {"pipeline": 2})
SPLIT_MODEL = ["modules.vision.num_layers=2"]  # two vision stages
COLOCATED = [*coloc({"data": 2}, {"data": 2}, {"tensor": 2, "data": 1}),
             "modules.vision.parallel.fsdp=true",
             "modules.audio.parallel.shard_optimizer=true"]
LOOP = ["log.interval=1", "log.progress=false", "eval.iters=1", "checkpoint.interval=5",
        "checkpoint.load=auto"]
FIELDS = ("iteration", "loss", "grad_norm", "num_zeros", "lr", "consumed_samples")


def _reference(extra: list[str]) -> ReferenceRun:
    return reference_run(tuple(PARITY + extra), NUM_ITERS)


def assert_only_projectors_moved(weights: dict[str, torch.Tensor], ref: ReferenceRun) -> None:
    """Frozen weights bitwise as initialised (every layout initialises alike); projector
    weights moved."""
    cfg = load_config(DIGITS, BASE + STAGE1)
    assert sorted(weights) == sorted(ref.initial)
    for name, value in weights.items():
        if frozen(cfg, name):
            assert torch.equal(value, ref.initial[name]), f"{name} moved"
        else:
            assert ".projector." in name, name
            assert not torch.equal(value, ref.initial[name]), f"{name} did not move"


def test_stage1_on_a_split_layout_matches_the_plain_loop():
    overrides = PARITY + SPLIT + SPLIT_MODEL + STAGE1
    results = run_ranks(world_size(overrides), engine_run, overrides, NUM_ITERS,
                        timeout_s=300)
    ref = _reference(SPLIT_MODEL + STAGE1)
    assert_steps_match(results, ref)
    # Only the projectors have gradients: the frozen modules' norms are absent.
    assert_module_norms_match(results, ref, {"vision", "audio"})
    assert_weights_match(results, ref)
    merged = {n: w for r in results for n, w in r["weights"].items()}
    assert_only_projectors_moved(merged, ref)


def _train(rank: int, world: int, overrides: list[str]) -> None:
    run_training(load_config(DIGITS, BASE + overrides), init_runtime())


def _records(log_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in FIELDS} for r in lines if "loss" in r]


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def test_stage1_colocated_with_fsdp_and_zero_matches_the_plain_loop_and_resumes_bitwise(
        tmp_path: Path) -> None:
    base = PARITY + COLOCATED + STAGE1 + LOOP + ["train.exit_interval=10"]
    straight, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    run_ranks(2, _train, [*base, f"log.dir={straight}"], timeout_s=300)  # saves 5 and 10
    half = straight / "checkpoints" / "iter_0000005"
    run_ranks(2, _train, [*base, f"log.dir={resumed_dir}", f"checkpoint.load={half}"],
              timeout_s=300)
    got = _records(straight)
    assert [r["iteration"] for r in got] == list(range(1, NUM_ITERS + 1))
    # Bitwise: losses, norms, zero counts, lr, data position.
    assert _records(resumed_dir) == got[5:]
    weights, meta = read_full_model(straight / "checkpoints")
    assert meta["iteration"] == NUM_ITERS
    resumed, _ = read_full_model(resumed_dir / "checkpoints")
    assert all(torch.equal(resumed[n], w) for n, w in weights.items())

    ref = _reference(STAGE1)
    for it, rec in enumerate(got):
        assert _rel(rec["loss"], ref.losses[it]) <= LOSS_REL, (it, rec["loss"], ref.losses[it])
        assert _rel(rec["grad_norm"], ref.grad_norms[it]) <= LOSS_REL, it
        assert rec["num_zeros"] == ref.num_zeros[it], it  # projectors' entries only
        assert sorted(rec["lr"]) == ["audio", "vision"]  # no schedule for the LM
    assert_weights_match([{"weights": weights}], ref)
    assert_only_projectors_moved(weights, ref)
