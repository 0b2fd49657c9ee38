"""A bug planted in the engine's document separation fails packed parity.

The plain loop (``tests.reference``) computes the decoder's attention with its own core
(``tests.reference_attention``), so the engine's per-document attention is compared
against something it does not share. Here the engine's attention plan is made to merge
each odd document into the one before it (document 1 sees document 0, 3 sees 2; RoPE
positions still restart), in the forked engine ranks only: the comparison with the
plain loop must fail at the first iteration, while the same run without the bug passes.
"""

from __future__ import annotations

import pytest

import mimotron.models.language as language
from mimotron.models.attention import Documents
from tests.common import colocated, engine_run
from tests.parity import (
    LOSS_REL,
    assert_steps_match,
    assert_weights_match,
    engine_results,
    packed_reference,
)
from tests.reference import PACKING

NUM_ITERS = 2  # the planted bug shows at the first iteration
ONE_RANK = colocated(1)


def _merge_pairs(bounds: tuple[int, ...]) -> tuple[int, ...]:
    """``(0, b1, b2, b3, ..., S)`` -> ``(0, b2, ..., S)``: document ``2i + 1`` joins ``2i``."""
    return (*bounds[:-1:2], bounds[-1])


def _leaky_engine_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """``engine_run`` with the language model's attention plans built over merged pairs of
    documents (this forked rank only); reports how many plans it built."""
    real_plan = language.attention_segments
    plans = []

    def leaky_plan(docs: Documents, *args: object, **kwargs: object) -> object:
        plans.append(docs.num_rows)
        merged = Documents(docs.seq_len, tuple(_merge_pairs(b) for b in docs.bounds))
        return real_plan(merged, *args, **kwargs)

    language.attention_segments = leaky_plan
    out = engine_run(rank, world, overrides, num_iters)
    out["leaky_plans"] = len(plans)
    return out


def test_planted_document_leak_fails_packed_parity():
    """One rank, 2 packed iterations: clean engine == plain loop; leaky engine != at step 0."""
    ref = packed_reference(PACKING, NUM_ITERS)
    clean = engine_results(PACKING + ONE_RANK, NUM_ITERS, world=1)
    assert_steps_match(clean, ref)
    assert_weights_match(clean, ref)

    leaky = engine_results(PACKING + ONE_RANK, NUM_ITERS, _leaky_engine_run, world=1)
    # The bug sat where the engine builds its attention (once per forward at least).
    assert leaky[0]["leaky_plans"] >= NUM_ITERS, "the engine no longer calls attention_segments"
    loss, want = leaky[0]["steps"][0][0], ref.losses[0]
    assert abs(loss - want) > 10 * LOSS_REL * want, f"step 0 loss {loss} vs {want}"
    with pytest.raises(AssertionError, match="iteration 0: loss"):
        assert_steps_match(leaky, ref)
