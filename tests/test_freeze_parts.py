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

``mimotron plan``'s estimate and the FLOP count follow: gradients, optimizer state and
buckets of the projectors only, a frozen tower's activations as autograd saves them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mimotron.checkpoint.export import read_full_model
from mimotron.config import load_config
from mimotron.estimate.flops import model_flops_per_iteration, projector_flops
from mimotron.estimate.memory import activation_bytes, estimate_memory
from mimotron.forked_ranks import run_ranks
from mimotron.models.build import build_module
from mimotron.models.freeze import freeze_part
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, coloc, noncolocated
from tests.parity import (
    LOSS_REL,
    PARITY,
    RECORD_FIELDS,
    assert_matches_reference,
    assert_weights_match,
    engine_results,
    reference,
    train,
    training_records,
)
from tests.reference import ReferenceRun, frozen
from tests.saved_bytes import per_sample

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
    results = engine_results(overrides, NUM_ITERS)
    ref = reference(SPLIT_MODEL + STAGE1, NUM_ITERS)
    # Only the projectors have gradients: the frozen modules' norms are absent.
    assert_matches_reference(results, ref, {"vision", "audio"})
    merged = {n: w for r in results for n, w in r["weights"].items()}
    assert_only_projectors_moved(merged, ref)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def test_stage1_colocated_with_fsdp_and_zero_matches_the_plain_loop_and_resumes_bitwise(
        tmp_path: Path) -> None:
    base = PARITY + COLOCATED + STAGE1 + LOOP + ["train.exit_interval=10"]
    straight, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    run_ranks(2, train, [*BASE, *base, f"log.dir={straight}"], timeout_s=300)  # saves 5 and 10
    half = straight / "checkpoints" / "iter_0000005"
    run_ranks(2, train, [*BASE, *base, f"log.dir={resumed_dir}", f"checkpoint.load={half}"],
              timeout_s=300)
    got = training_records(straight, RECORD_FIELDS)
    assert [r["iteration"] for r in got] == list(range(1, NUM_ITERS + 1))
    # Bitwise: losses, norms, zero counts, lr, data position.
    assert training_records(resumed_dir, RECORD_FIELDS) == got[5:]
    weights, meta = read_full_model(straight / "checkpoints")
    assert meta["iteration"] == NUM_ITERS
    resumed, _ = read_full_model(resumed_dir / "checkpoints")
    assert all(torch.equal(resumed[n], w) for n, w in weights.items())

    ref = reference(STAGE1, NUM_ITERS)
    for it, rec in enumerate(got):
        assert _rel(rec["loss"], ref.losses[it]) <= LOSS_REL, (it, rec["loss"], ref.losses[it])
        assert _rel(rec["grad_norm"], ref.grad_norms[it]) <= LOSS_REL, it
        assert rec["num_zeros"] == ref.num_zeros[it], it  # projectors' entries only
        assert sorted(rec["lr"]) == ["audio", "vision"]  # no schedule for the LM
    assert_weights_match([{"weights": weights}], ref)
    assert_only_projectors_moved(weights, ref)


def test_the_plan_and_the_flops_count_only_what_trains():
    cfg = load_config(DIGITS, BASE + noncolocated({}, {}, {"data": 2}) + STAGE1)
    est = {e.module: e for es in estimate_memory(cfg, check_layout(cfg), 64).values()
           for e in es}
    trainable = load_config(DIGITS, BASE + noncolocated({}, {}, {"data": 2}))
    flops, unfrozen = (model_flops_per_iteration(c, 64, {"vision": 16, "audio": 16})
                       for c in (cfg, trainable))
    lm = est["language"]  # frozen, but it back-propagates to the projectors
    assert lm.grads == lm.optimizer == lm.reduce_bucket == 0 and lm.workspace > 0
    assert flops["language"] == unfrozen["language"] * 2 / 3
    for name in ("vision", "audio"):
        mod = cfg.modules[name]
        part = build_module(cfg, name, 64)
        projector = sum(p.numel() for p in part.projector.parameters())
        assert est[name].num_params > projector
        assert (est[name].grads, est[name].optimizer) == (4 * projector, 8 * projector)
        # Activations: what autograd saves per sample with the tower frozen.
        freeze_part(part, mod)
        shape = ((mod.in_channels, mod.image_size, mod.image_size) if mod.kind == "vit"
                 else (mod.num_freq_bins, mod.num_frames))
        measured = per_sample(part, lambda n, s=shape: torch.randn(n, *s), "fp32", loss=False)
        samples = cfg.train.micro_batch_size // mod.parallel.data
        assert activation_bytes(cfg, name, 64, in_flight=1) == measured * samples
        # The tower runs forward only, the projector forward and backward.
        extra = 2 * projector_flops(mod, cfg.modules["language"].hidden_size, 16)
        assert flops[name] == unfrozen[name] / 3 + extra
