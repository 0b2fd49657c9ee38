"""Every class of layout the validator accepts trains like the plain PyTorch loop.

Each case trains ``NUM_ITERS`` fp32 iterations through the real engine on forked gloo
ranks (``tests.common.engine_run``) and compares with ``tests.reference.reference_run``,
a one-process loop that shares no training code with the engine. Per iteration: the
loss and the global grad norm (<= 1e-4 relative), the loss-token count (exact) and the
grad norm after clipping of every module whose model gradients the optimizer steps
(<= 1e-4; a SUM-vs-AVG slip in one module cannot hide behind Adam's scale invariance;
ZeRO-sharded modules step fragments instead and are covered by the global norm and the
final weights). At the end: every parameter, gathered to full shape,
within 1e-4 relative L2 of the reference, and bitwise identical on every rank that holds
a copy (DP replicas, TP duplicates).

Several cases use micro-batches of 4 samples so that encoder DP slices regularly hold no
sample of their modality: that is the empty-slice path (header-only transfers, empty
encoder calls) where the colocated encoder-TP bug lived; ``EMPTY_SLICE_EVIDENCE`` checks
that the path really ran.
"""

from __future__ import annotations

import pytest
import torch

from tests.common import coloc, colocated, noncolocated
from tests.parity import (
    LOSS_REL,
    PARITY,
    SMALL_MB,
    WEIGHT_REL,
    assert_matches_reference,
    checked_modules,
    engine_results,
    reference,
)
from tests.reference import ReferenceRun

ZERO = [f"modules.{m}.parallel.shard_optimizer=true" for m in ("vision", "audio", "language")]
LR_OVERRIDES = ["modules.vision.optimizer.lr=1e-2", "modules.audio.optimizer.lr=5e-4",
                "modules.language.optimizer.warmup_iters=4"]
# Each module clips against the global norm with its own threshold (0 = never clipped).
CLIP_OVERRIDES = ["modules.vision.optimizer.clip_grad=0.05",
                  "modules.language.optimizer.clip_grad=0"]
VISION_2_LAYERS = ["modules.vision.num_layers=2"]

# name: (layout, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    # ---- colocated: every module on every rank, degrees differ per module
    # (vision DP 4 beside language TP 2 x DP 2: the ZeRO row below and
    # tests/test_overlap_grad_reduce.py; audio TP 2 x DP 2 beside language DP 4: the row
    # beside language TP 2 x DP 2)
    "coloc-dp2": (colocated(2), []),
    "coloc-dp4-mb4": (colocated(4), SMALL_MB),
    "coloc-audio-tp2dp2-language-tp2dp2-mb4": (
        coloc({"data": 4}, {"tensor": 2, "data": 2}, {"tensor": 2, "data": 2}), SMALL_MB),
    "coloc-vision-tp2dp2-language-dp4-mb4": (
        coloc({"tensor": 2, "data": 2}, {"data": 4}, {"data": 4}), SMALL_MB),
    "coloc-vision-tp2-audio-tp2-language-tp2": (
        coloc({"tensor": 2, "data": 1}, {"tensor": 2, "data": 1}, {"tensor": 2, "data": 1}),
        SMALL_MB),
    "coloc-dp2-zero": (colocated(2), ZERO),
    "coloc-dp2-frozen-vision": (colocated(2), ["modules.vision.freeze=true"]),
    # ---- non-colocated: disjoint blocks vision | audio | language
    "fan-out-language-dp2-mb4": (noncolocated({}, {}, {"data": 2}), SMALL_MB),
    "fan-in-vision-dp2": (noncolocated({"data": 2}, {}, {}), []),
    "language-tp2": (noncolocated({}, {}, {"tensor": 2}), []),
    # (Language TP 2 x DP 2 fed by DP 1 encoders: the SP + ZeRO row below.)
    "fan-in-vision-dp2-into-language-tp2": (noncolocated({"data": 2}, {}, {"tensor": 2}), []),
    "vision-tp2": (noncolocated({"tensor": 2}, {}, {}), []),
    "audio-tp2": (noncolocated({}, {"tensor": 2}, {}), []),
    "vision-tp2dp2-fan-in-mb4": (noncolocated({"tensor": 2, "data": 2}, {}, {}), SMALL_MB),
    "language-pp2": (noncolocated({}, {}, {"pipeline": 2}), []),
    "language-pp2-mb2": (noncolocated({}, {}, {"pipeline": 2}), ["train.micro_batch_size=2"]),
    "language-pp2-one-microbatch": (noncolocated({}, {}, {"pipeline": 2}),
                                    ["train.micro_batch_size=16"]),
    "language-tp2pp2": (noncolocated({}, {}, {"tensor": 2, "pipeline": 2}), []),
    "language-pp2-uneven-layers": (
        noncolocated({}, {}, {"pipeline": 2})
        + ["modules.language.parallel.layers_per_stage=[1, 2]"],
        ["modules.language.num_layers=3"]),
    "vision-pp2-language-pp2": (noncolocated({"pipeline": 2}, {}, {"pipeline": 2}),
                                VISION_2_LAYERS),
    "vision-pp2dp2-mb4": (noncolocated({"pipeline": 2, "data": 2}, {}, {}),
                          VISION_2_LAYERS + SMALL_MB),
    "language-dp2-zero": (noncolocated({}, {}, {"data": 2}),
                          ["modules.language.parallel.shard_optimizer=true"]),
    # ZeRO-1 with TP: each TP rank shards its local shards over its DP group.
    "coloc-encoders-dp4-zero-language-tp2dp2-zero": (
        coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2}), ZERO),
    # ... with sequence parallelism (TP-partial norm gradients: late buckets) and both
    # overlaps (reduce-scatters launched from hooks, gathers landed by the next forward).
    "language-tp2dp2-sp-zero-overlap": (
        noncolocated({}, {}, {"tensor": 2, "data": 2})
        + ["modules.language.parallel.shard_optimizer=true",
           "modules.language.parallel.sequence_parallel=true",
           "train.overlap_grad_reduce=true", "train.overlap_param_gather=true",
           "train.grad_bucket_mb=0.05"], []),
    "frozen-audio-language-dp2": (noncolocated({}, {}, {"data": 2}),
                                  ["modules.audio.freeze=true"]),
    "per-module-lr-language-tp2": (noncolocated({}, {}, {"tensor": 2}), LR_OVERRIDES),
    "per-module-clip-coloc-dp2": (colocated(2), CLIP_OVERRIDES),
}


# Cases whose micro-batch slices are small enough to be empty at times, and the evidence
# that the empty-slice path ran: encoder calls with no sample of their modality, and (across
# a module boundary) transfers that carried only a shape header.
EMPTY_SLICE_EVIDENCE = {
    "coloc-audio-tp2dp2-language-tp2dp2-mb4": ("empty_encoder_outputs",),
    "coloc-vision-tp2dp2-language-dp4-mb4": ("empty_encoder_outputs",),
    "fan-out-language-dp2-mb4": ("header_only_sends",),
    "vision-tp2dp2-fan-in-mb4": ("empty_encoder_outputs", "header_only_sends"),
    "vision-pp2dp2-mb4": ("empty_encoder_outputs", "header_only_sends"),
}


def run_case(name: str) -> list[dict]:
    """The engine's results on every rank, checked against the plain loop."""
    layout, extra = CASES[name]
    overrides = PARITY + layout + extra
    results = engine_results(overrides)
    assert_matches_reference(results, reference(extra), checked_modules(overrides))
    return results


def test_reference_trains():
    ref = reference([])
    assert ref.losses[-1] < 0.8 * ref.losses[0]
    assert all(n > 0 for n in ref.grad_norms)
    moved = [n for n in ref.weights if not torch.equal(ref.weights[n], ref.initial[n])]
    assert len(moved) == len(ref.weights)  # every parameter really trains


def _as_engine_results(ref: ReferenceRun) -> list[dict]:
    """One rank's results that repeat the plain loop's numbers (one gradient per module)."""
    grad = {"vision": "modality_submodules.vision.g", "audio": "modality_submodules.audio.g",
            "language": "language_model.g"}
    return [{"steps": [(loss, norm, False, tokens) for loss, norm, tokens in
                       zip(ref.losses, ref.grad_norms, ref.num_tokens, strict=True)],
             "grad_sq": [{grad[m]: v * v for m, v in norms.items()} for norms in ref.module_norms],
             "weights": dict(ref.weights)}]


@pytest.mark.parametrize("slip", ["loss", "grad_norm", "module_norm", "weight"])
def test_the_comparison_catches_a_slip_at_the_last_iteration(slip):
    """The plain loop's own numbers pass; 3x the tolerance off, at the last iteration only
    (or in one final weight), fails naming where."""
    ref = reference([])
    modules = set(ref.module_norms[0])
    assert_matches_reference(_as_engine_results(ref), ref, modules)
    (res,) = results = _as_engine_results(ref)
    last, off = len(ref.losses) - 1, 1 + 3 * LOSS_REL
    if slip in ("loss", "grad_norm"):
        step = list(res["steps"][last])
        step[slip == "grad_norm"] *= off
        res["steps"][last] = tuple(step)
        where = f"iteration {last}: {slip.replace('_', ' ')}"
    elif slip == "module_norm":
        res["grad_sq"][last]["language_model.g"] *= off * off
        where = f"iteration {last}: module language grad norm"
    else:
        name = next(iter(ref.weights))
        res["weights"][name] = ref.weights[name] * (1 + 3 * WEIGHT_REL)
        where = f"{name}: relative L2"
    with pytest.raises(AssertionError, match=where):
        assert_matches_reference(results, ref, modules)


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_plain_loop(name):
    results = run_case(name)
    for evidence in EMPTY_SLICE_EVIDENCE.get(name, ()):
        assert sum(r[evidence] for r in results) > 0, f"{evidence}: the empty-slice path never ran"
