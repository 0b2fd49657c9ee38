"""Overlapped gradient reduction (``train.overlap_grad_reduce``) changes no bit.

Each case trains 4 fp32 iterations through the real engine twice on the same forked
gloo ranks, overlap off then on, and asserts that losses, grad norms, every parameter's
gradient as the optimizer steps it and the final weights are bitwise equal. The
non-overlapped path is the one ``tests/test_parity.py`` compares with the plain PyTorch
loop, so equality here carries that parity over.

Evidence that the overlap happened: the step's ``GradSync`` counts the buckets it
launched from a gradient hook, i.e. during the backward; every case must have launched
some. The interleaved case must also have flushed some (buckets of parameters outside
the layers, armed at chunk 0's last backward after their gradients landed). The
layouts cover colocated DP 4 with 0.01 MB buckets (many per module) and empty encoder
slices (a zero-row forward and backward: their hooks still fire), a language
TP 2 × DP 2 whose DTensor buckets launch during the backward too (placements aligned at
the launch), language PP 2 × DP 2 (overlap with the last micro-batch's backward) and
language CP 2 × DP 2 (the ``dp_cp`` replica group), language TP 2 × DP 2 with sequence
parallelism (late buckets: TP-partial norm weights) and a MoE language model with EP 2
in DP 4 (its expert buckets late). ZeRO-1 modules:
``tests/test_overlap_zero.py``; buckets whose hooks fire partly or never, frozen parts
and each branch of ``GradSync`` on its own: ``tests/test_grad_sync.py``.
"""

from __future__ import annotations

import pytest

from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grad_sync import GradSync, backward_module_order
from tests.common import coloc, colocated, engine_run, noncolocated, par
from tests.moe import MOE_NO_AUX
from tests.parity import TINY_BUCKETS, assert_bitwise_equal, world_size

NUM_ITERS = 4
OVERLAP = ["train.overlap_grad_reduce=true"]
SMALL_MB = ["train.micro_batch_size=4"]  # 4 micro-batches; DP slices of 1-2 samples

# name: (overrides, some bucket must launch during the backward)
CASES: dict[str, tuple[list[str], bool]] = {
    "coloc-dp4-mb4-empty-slices": (colocated(4) + SMALL_MB + TINY_BUCKETS, True),
    "coloc-vision-dp4-language-tp2dp2": (
        coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2}) + TINY_BUCKETS, True),
    "language-pp2dp2-mb4": (noncolocated({}, {}, {"pipeline": 2, "data": 2}) + SMALL_MB
                            + TINY_BUCKETS, True),
    "language-cp2dp2": (noncolocated({}, {}, {"context": 2, "data": 2}), True),
    # Interleaved: each chunk's parameters are armed before that chunk's last backward.
    "language-pp2vp2dp2-mb4": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2,
                                                  "data": 2})
                               + SMALL_MB + TINY_BUCKETS + ["modules.language.num_layers=4"],
                               True),
    # Sequence parallel: the buckets holding the TP-partial norm weights are late.
    "language-tp2dp2-sp": (noncolocated({}, {}, {"tensor": 2, "data": 2}) + TINY_BUCKETS
                           + ["modules.language.parallel.sequence_parallel=true"], True),
    # Dense buckets over dp 4 launch early; the expert buckets (over expt_dp 2) are late.
    "moe-ep2-dp4": (colocated(4) + MOE_NO_AUX + par("language", expert=2) + TINY_BUCKETS, True),
}


def on_off_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """The engine with overlap off, then on, in this rank; with the GradSync counts."""
    off = engine_run(rank, world, overrides, num_iters)
    counts: list[tuple[int, int, int]] = []
    finish = GradSync.finish

    def counting_finish(self: GradSync) -> None:
        finish(self)
        counts.append((self.num_launched_early, len(self.buckets), self.num_flushed))

    GradSync.finish = counting_finish  # this forked rank only
    on = engine_run(rank, world, overrides + OVERLAP, num_iters)
    return {"off": off, "on": on, "counts": counts}


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_is_bitwise_equal(name):
    overrides, overlaps = CASES[name]
    overrides = [f"train.iters={NUM_ITERS}", *overrides]
    results = run_ranks(world_size(overrides), on_off_run, overrides, NUM_ITERS,
                        timeout_s=300)
    for rank, res in enumerate(results):
        assert_bitwise_equal(res["off"], res["on"], rank)
        assert len(res["counts"]) == NUM_ITERS, f"rank {rank}: the reducer did not run"
    early = sum(launched for res in results for launched, _, _ in res["counts"])
    assert (early > 0) == overlaps, f"{early} buckets launched during the backward"
    if TINY_BUCKETS[0] in overrides:
        assert max(n for res in results for _, n, _ in res["counts"]) > 3, "few buckets"
    if "vp2" in name:  # the flush launched buckets whose hooks fired before arming
        assert sum(f for res in results for _, _, f in res["counts"]) > 0


def test_backward_module_order():
    assert backward_module_order(["vision", "language", "audio"]) == [
        "language", "audio", "vision"]
