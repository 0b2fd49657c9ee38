"""Forwards in flight: the memory estimate's count against the plan and the executor.

The estimate (``mimotron.estimate.memory``) takes each stage's peak of held forwards from
its training plan. Checked here three ways:

* against a replay written out in this file of the rank plans ``build_rank_actions``
  returns, for several ``(pipeline, virtual_pipeline, micro-batches, stage)``, plus the
  interleaved figure at pipeline 8 x virtual 2 (23 chunk forwards on stage 0, where the
  1F1B count is 8);
* against the executor itself: a fake-device dry run of a layout with an interleaved
  encoder and a 1F1B encoder feeding an interleaved language model, recording on every
  rank the most ``(chunk, micro-batch)`` forwards ``StageRunner`` holds for backward;
* the bytes: under interleaving each held chunk forward weighs its chunk's share, the
  module's ends weigh on their chunk only.
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.dryrun import dry_run
from mimotron.estimate.memory import (
    activation_bytes,
    ends_bytes_per_sample,
    estimate_memory,
    interleaved_chunks_in_flight,
    microbatches_in_flight,
)
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import check_layout
from mimotron.pipeline import schedules
from mimotron.pipeline.actions import BACKWARD, FORWARD
from mimotron.pipeline.interleaved_actions import build_rank_actions
from tests.common import BASE, DIGITS, noncolocated


def _replayed_peak(layout, module: str, stage: int, num_microbatches: int) -> int:
    """Most forwards whose backward has not run, replaying the plan's computes."""
    held: set[tuple[int, int]] = set()
    peak = 0
    for a in build_rank_actions(layout, module, stage, num_microbatches):
        if a.kind == FORWARD:
            held.add((a.chunk, a.microbatch))
            peak = max(peak, len(held))
        elif a.kind == BACKWARD:
            held.remove((a.chunk, a.microbatch))
    assert not held
    return peak


def _language_chain(pipeline: int, virtual: int, num_microbatches: int,
                    vision_virtual: int = 1) -> list[str]:
    """vision (PP 2, optionally interleaved) | audio | language (PP p x VP v)."""
    return [*noncolocated({"pipeline": 2, "virtual_pipeline": vision_virtual}, {},
                          {"pipeline": pipeline, "virtual_pipeline": virtual}),
            f"modules.language.num_layers={pipeline * virtual}", "modules.vision.num_layers=4",
            "train.micro_batch_size=8", f"train.global_batch_size={8 * num_microbatches}"]


@pytest.mark.parametrize("pipeline,virtual,num_microbatches,vision_virtual", [
    (2, 2, 2, 1), (2, 2, 4, 2), (2, 3, 6, 1), (3, 2, 6, 2), (4, 2, 8, 1), (4, 4, 4, 2),
])
def test_in_flight_is_the_plans_peak(pipeline, virtual, num_microbatches, vision_virtual):
    cfg = load_config(DIGITS, _language_chain(pipeline, virtual, num_microbatches,
                                              vision_virtual))
    layout = check_layout(cfg)
    for (module, stage) in [(m, s) for m, p in layout.modules.items()
                            for s in range(p.parallel.pipeline)]:
        want = _replayed_peak(layout, module, stage, num_microbatches)
        assert microbatches_in_flight(cfg, layout, module, stage) == want, (module, stage)
        if layout.modules[module].parallel.virtual_pipeline > 1:
            assert interleaved_chunks_in_flight(cfg, module, stage, layout) == want


def test_pipeline_8_by_virtual_2_holds_23_chunk_forwards():
    cfg = load_config(DIGITS, _language_chain(8, 2, 16))
    layout = check_layout(cfg)
    counts = [interleaved_chunks_in_flight(cfg, LANGUAGE, s, layout) for s in range(8)]
    # Megatron's warm-up (p - r - 1) * 2 + (v - 1) * p, plus the first steady forward.
    assert counts == [(8 - r - 1) * 2 + 8 + 1 for r in range(8)] == [23, 21, 19, 17, 15,
                                                                      13, 11, 9]
    # Stage 0 holds 23 chunk forwards of half its layers each: 11.5 stage forwards' worth,
    # where the 1F1B count of its position would give 8.
    both_chunks = activation_bytes(cfg, LANGUAGE, 64, in_flight=2, stage=3)  # one stage's
    held = activation_bytes(cfg, LANGUAGE, 64, stage=3, layout=layout)
    assert held == pytest.approx(17 / 2 * both_chunks, abs=1)
    rank = layout.modules[LANGUAGE].rank_at(pp=3)
    (est,) = estimate_memory(cfg, layout, 64, [rank])[rank]
    assert est.activations == activation_bytes(cfg, LANGUAGE, 64, stage=3, layout=layout)


def test_interleaved_ends_weigh_on_their_chunk_only():
    """Stage 0's first chunk holds the embedding's ends, the last stage's last chunk the
    loss: each counted for the forwards of that chunk held at the peak."""
    cfg = load_config(DIGITS, _language_chain(2, 2, 4))
    layout = check_layout(cfg)
    vocab, samples = 64, cfg.train.micro_batch_size
    no_ends = activation_bytes(cfg, LANGUAGE, vocab, in_flight=2, stage=0) // 2  # per chunk
    _, last = ends_bytes_per_sample(cfg, LANGUAGE, cfg.data.seq_length, vocab)
    held = [0, 0]  # replay stage 1's plan: chunk forwards held per chunk
    peak = 0
    for a in build_rank_actions(layout, LANGUAGE, 1, 4):
        if a.kind in (FORWARD, BACKWARD):
            held[a.chunk] += 1 if a.kind == FORWARD else -1
            peak = max(peak, (held[0] + held[1]) * no_ends + held[1] * last * samples)
    assert activation_bytes(cfg, LANGUAGE, vocab, stage=1, layout=layout) == peak
    # The even spread of the old count would put a ceil(n / v) of ends on each chunk.
    assert peak < activation_bytes(cfg, LANGUAGE, vocab, in_flight=3, stage=1)


def test_executor_holds_what_the_estimate_counts(monkeypatch):
    """The dry run's executor, every rank: the most forwards ``StageRunner`` keeps."""
    peaks: dict[int, int] = {}
    forward = schedules.StageRunner.forward

    def recording(self, k, received, chunk=0):
        out = forward(self, k, received, chunk)
        rank = self.ctx.rank
        peaks[rank] = max(peaks.get(rank, 0), len(self._saved))
        return out

    monkeypatch.setattr(schedules.StageRunner, "forward", recording)
    cfg = load_config(DIGITS, [*BASE, *_language_chain(2, 2, 4, vision_virtual=2),
                               "log.dir=/tmp/mimotron-test-in-flight"])
    layout = check_layout(cfg)
    dry_run(cfg, steps=1, evaluate=False, checkpoint=False)
    expected = {r: microbatches_in_flight(cfg, layout, role.module, role.pp)
                for r in range(layout.world_size) for role in layout.roles(r)}
    assert peaks == expected
    # The audio encoder (1F1B, rank 2) feeding the interleaved language model warms up
    # beyond its position's count (total - position = 4 - 1) to keep the ring fed; the
    # interleaved vision encoder holds 8 chunk forwards (2 stage forwards' worth each).
    assert expected == {0: 8, 1: 8, 2: 4, 3: 5, 4: 3}
