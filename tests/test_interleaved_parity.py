"""Interleaved 1F1B (virtual pipeline stages) trains like the plain PyTorch loop.

Every layout class the validator accepts with ``virtual_pipeline > 1`` — the language
model interleaved behind encoder blocks, an interleaved encoder handing off from its
last virtual stage into an interleaved language model, and interleaving with data or
tensor parallelism — trains ``NUM_ITERS`` fp32 iterations
through the real engine on forked gloo ranks and is compared with
``tests.reference.reference_run`` (one process, whole batch, ``torch.optim.AdamW``):
loss, grad norm and token count per iteration, per-module grad norms, final weights
(the checks of ``tests/test_parity.py``). Four micro-batches per step, so the ring
carries several groups of ``pipeline`` micro-batches per chunk.
"""

from __future__ import annotations

from unittest import mock

import pytest

from mimotron.config import load_config
from tests.common import noncolocated
from tests.parity import (
    NUM_ITERS,
    PARITY,
    assert_matches_reference,
    engine_results,
    run_against_plain_loop,
)
from tests.reference import reference_run

FOUR_MB = ["train.micro_batch_size=4"]  # 16 samples: 4 micro-batches, a multiple of p = 2
LANGUAGE_4 = ["modules.language.num_layers=4"]  # 2 stages x 2 chunks of one layer
VISION_4 = ["modules.vision.num_layers=4"]
PP2VP2 = {"pipeline": 2, "virtual_pipeline": 2}

# name: (layout, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "language-pp2vp2": (noncolocated({}, {}, PP2VP2), LANGUAGE_4 + FOUR_MB),
    "vision-pp2vp2-language-pp2vp2": (noncolocated(PP2VP2, {}, PP2VP2),
                                      VISION_4 + LANGUAGE_4 + FOUR_MB),
    "language-pp2vp2-dp2": (noncolocated({}, {}, {**PP2VP2, "data": 2}), LANGUAGE_4 + FOUR_MB),
    "language-pp2vp2-dp2-zero": (noncolocated({}, {}, {**PP2VP2, "data": 2,
                                                    "shard_optimizer": "true"}),
                                 LANGUAGE_4 + FOUR_MB),
    "language-cp2pp2vp2": (noncolocated({}, {}, {**PP2VP2, "context": 2}),
                           LANGUAGE_4 + FOUR_MB),
    # TP with sequence parallelism: TP's interleaved path and SP's, at once (no separate
    # TP-only row).
    "language-tp2pp2vp2-sp": (noncolocated({}, {}, {**PP2VP2, "tensor": 2,
                                                 "sequence_parallel": "true"}),
                              LANGUAGE_4 + FOUR_MB),
}


@pytest.mark.parametrize("name", list(CASES))
def test_interleaved_layout_matches_plain_loop(name):
    run_against_plain_loop(*CASES[name])


def _without_encoders(path, overrides):
    """``load_config`` with the encoder modules removed (a language model alone)."""
    cfg = load_config(path, overrides)
    for name in cfg.encoder_names:
        del cfg.modules[name]
    return cfg


@pytest.mark.parametrize("virtual", [1, 2])
def test_language_model_alone_pipelines(virtual):
    """One module with pipeline stages is a pipeline (it was planned as colocated and
    failed on stage 1); with and without interleaving it trains like the plain loop."""
    layout = [f"modules.language.parallel.{k}={v}" for k, v in
              (("data", 1), ("rank_offset", 0), ("pipeline", 2), ("virtual_pipeline", virtual))]
    overrides = PARITY + layout + LANGUAGE_4 + FOUR_MB
    with mock.patch("tests.common.load_config", _without_encoders), \
            mock.patch("tests.reference.load_config", _without_encoders):
        results = engine_results(overrides, NUM_ITERS, world=2)
        # The extra (default) override keeps reference.py's data cache key apart from
        # runs with the encoders.
        ref = reference_run(tuple(PARITY + LANGUAGE_4 + FOUR_MB + ["modules.vision.num_layers=1"]),
                            NUM_ITERS)
    assert_matches_reference(results, ref, {"language"})
