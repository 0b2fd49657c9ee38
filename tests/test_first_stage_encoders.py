"""Encoders on the language model's first pipeline stage train like the plain loop.

The first-stage placement (Megatron's LLaVA placement): the language model spans the
world with ``pipeline > 1`` and every encoder spans only the ranks of its first stage.
Those ranks run the encoders and the bridges (over their own group) on the step's
micro-batches before the language stages and their backward after; ranks of later
stages hold the language model only (:mod:`mimotron.pipeline.colocated_pipeline`).

Each parity case trains 12 fp32 iterations (lr 3e-3, clipping at 0.5) through the real
engine on 4 forked gloo ranks against :func:`tests.reference.reference_run` (one
process, no engine code): losses, global and per-module grad norms at 1e-4 relative,
final weights at 1e-4 relative L2; the runs are replayed under NCCL's rules
(``tests/conftest.py``). Cases: vision DP 2 under FSDP2 and audio TP 2 on the first stage
of language DP 2 x PP 2 under ZeRO-1; language TP 2 (sequence parallel) x PP 2 with a
frozen vision encoder; language PP 4, the encoders on rank 0 alone; encoder batching with
the overlapped gradient reduction; language CP 2 x PP 2 with encoder batching.
Also: a resume in the middle gives the same records bit for bit; the validator's
rules, the bridge's ranks and the plan's per-rank memory (pure).
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.estimate.memory import estimate_memory
from mimotron.estimate.widths import bridged_rows_bytes
from mimotron.parallel.layout import (
    check_layout,
    encoders_on_first_stage,
    first_stage_ranks,
    is_colocated_pipeline,
    placement_name,
)
from mimotron.pipeline.colocated import ColocatedTransport, bridge_geometry
from mimotron.pipeline.communicators import communicators_of
from mimotron.pipeline.edges import build_edges
from tests.common import BASE, DIGITS, coloc, par
from tests.parity import SMALL_MB, TINY_BUCKETS, run_against_plain_loop
from tests.resume_chain import straight_and_resumed

ITERS = 12
SP = ["modules.language.parallel.sequence_parallel=true"]
DP2_PP2 = coloc({"data": 2}, {"tensor": 2, "data": 1}, {"data": 2, "pipeline": 2})
TP2_PP2 = coloc({"tensor": 2, "data": 1}, {"data": 2}, {"tensor": 2, "data": 1, "pipeline": 2})
PP4 = coloc({"data": 1}, {"data": 1}, {"data": 1, "pipeline": 4})
FOUR_LAYERS = ["modules.language.num_layers=4"]
OVERLAP = ["train.encoder_batching=true", "train.overlap_grad_reduce=true", *TINY_BUCKETS]
CP2_PP2 = coloc({"data": 2}, {"tensor": 2, "data": 1}, {"context": 2, "data": 1, "pipeline": 2})
SHARDED = coloc({"data": 2, "fsdp": "true"}, {"tensor": 2, "data": 1},
                {"data": 2, "pipeline": 2, "shard_optimizer": "true"})

# name: (layout and engine options, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    # The vision encoder under FSDP2, audio TP 2, the language stages under ZeRO-1.
    "vision-dp2-fsdp-audio-tp2-language-dp2-pp2-zero1": (SHARDED, []),
    "language-tp2-sp-pp2-frozen-vision": (TP2_PP2 + SP, ["modules.vision.freeze=true"]),
    "language-pp4-encoders-on-rank-0": (PP4, SMALL_MB + FOUR_LAYERS),
    "encoder-batching-overlap-mb4": (DP2_PP2 + OVERLAP, SMALL_MB),
    # Context parallelism: the bridges' variable all-to-alls on the first stage's group,
    # each encoder running the step in one forward (what plan --auto proposes).
    "language-cp2-pp2-encoder-batching": (CP2_PP2 + ["train.encoder_batching=true"], []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_stage_encoders_match_plain_loop(name: str) -> None:
    layout, extra = CASES[name]
    run_against_plain_loop(layout, extra, num_iters=ITERS)


def test_a_resume_in_the_middle_trains_the_same(tmp_path) -> None:
    """Stopped after iteration 3 and resumed from its checkpoint to 6: the same records
    (loss, grad norm, lr, consumed samples) bit for bit as the straight run; the ranks
    past the first stage save and load no encoder state."""
    straight, resumed = straight_and_resumed(tmp_path, 4, DP2_PP2, 3, 6)
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[-3:] == straight[-3:]


# ---- pure ---------------------------------------------------------------------------------
def _layout(overrides: list[str]):
    return check_layout(load_config(DIGITS, BASE + overrides))


@pytest.mark.parametrize("overrides", [DP2_PP2, TP2_PP2, PP4 + FOUR_LAYERS])
def test_the_placement_is_the_first_stage(overrides: list[str]) -> None:
    layout = _layout(overrides)
    language = layout.modules["language"]
    stage = language.size // language.parallel.pipeline
    assert encoders_on_first_stage(layout) and is_colocated_pipeline(layout)
    assert placement_name(layout) == "first stage"
    assert layout.format_rank_map().startswith("placement: first stage, world size 4")
    assert first_stage_ranks(layout) == range(stage)
    for rank in range(4):
        held = set(layout.modules_on_rank(rank))
        assert held == ({"vision", "audio", "language"} if rank < stage else {"language"})
    assert not encoders_on_first_stage(_layout(coloc({"data": 4}, {"data": 4},
                                                     {"data": 2, "pipeline": 2})))


@pytest.mark.parametrize("overrides", [DP2_PP2, TP2_PP2])
def test_bridges_span_the_first_stage_only(overrides: list[str]) -> None:
    """The bridge geometry covers the first stage's ranks: every sample lands on one
    language slice, held by as many ranks as its TP degree; later ranks join no bridge."""
    layout = _layout(overrides)
    language = layout.modules["language"]
    mbs = 8
    edges = build_edges(layout, {"vision": "image", "audio": "audio"})
    assert all(e.colocated for e in edges)
    stage = first_stage_ranks(layout)
    for edge in edges:
        geos = [bridge_geometry(layout, edge, r, mbs) for r in stage]
        assert all(g.world_size == len(stage) for g in geos)
        covered = set()
        for geo in geos:
            covered.update(range(*geo.dst_slice))
            assert geo.dst_copies == language.parallel.tensor
        assert covered == set(range(mbs))
    for rank in range(4):
        transport = ColocatedTransport(layout, rank, mbs, edges)
        assert [e.src for e in transport.edges] == (["vision", "audio"] if rank in stage
                                                     else [])


def test_the_plan_holds_the_encoders_on_the_first_stage_only() -> None:
    """``mimotron plan``'s per-rank estimate: a first-stage rank holds the encoders and
    its language stage, a later rank its language stage alone; the bridge group is a
    communicator of the first stage's ranks only."""
    cfg = load_config(DIGITS, BASE + DP2_PP2)
    layout = check_layout(cfg)
    ranks = estimate_memory(cfg, layout, 64, ranks=[0, 3])
    assert {e.module for e in ranks[0]} == {"vision", "audio", "language"}
    assert {e.module for e in ranks[3]} == {"language"}
    mbs = cfg.train.micro_batch_size
    # By hand. Rank 0: the world; vision's DP group {0, 1}; audio's TP group {0, 1};
    # language's DP and PP groups (the embedding group is the PP one); the bridge group
    # {0, 1}; a link to stage 1 and one back. Rank 3: the world, language's two, links.
    assert communicators_of(layout, 0, mbs) == 1 + 1 + 1 + 2 + 1 + 2
    assert communicators_of(layout, 3, mbs) == 1 + 2 + 2


@pytest.mark.parametrize(("context", "rows"), [(1, 16 + 4), (2, 16 + 4), (8, 8)])
def test_the_plan_counts_the_rows_a_context_parallel_first_stage_keeps(context: int,
                                                                       rows: int) -> None:
    """A first-stage rank keeps every micro-batch's bridged rows and their gradients:
    per sample the encoders' 16 + 4 placeholder rows, but into CP stages only those of
    its own 64 / context positions (8 at CP 8, wherever the media sit)."""
    layout_keys = coloc({"data": context}, {"data": context},
                        {"context": context, "data": 1, "pipeline": 2})
    cfg = load_config(DIGITS, BASE + layout_keys)
    lm = cfg.modules["language"]
    assert cfg.data.seq_length == 64 and cfg.modules["vision"].num_output_tokens == 16
    want = 2 * cfg.num_microbatches * cfg.train.micro_batch_size * rows * lm.hidden_size * 4
    assert bridged_rows_bytes(cfg, check_layout(cfg), "language", 0) == want


def test_encoder_batching_counts_one_backward_of_the_step() -> None:
    """Under encoder batching an encoder's one backward covers the step's inputs: its
    workspace is the micro-batch's times the micro-batches (what plan --auto turns on
    for these layouts); the language model's does not change."""
    workspace = {}
    for batched in ("false", "true"):
        cfg = load_config(DIGITS, BASE + DP2_PP2 + [f"train.encoder_batching={batched}"])
        est = estimate_memory(cfg, check_layout(cfg), 64, ranks=[0])[0]
        workspace[batched] = {e.module: e.workspace for e in est}
    n = cfg.num_microbatches
    assert n > 1
    for m in ("vision", "audio"):
        assert workspace["true"][m] == n * workspace["false"][m] > 0
    assert workspace["true"]["language"] == workspace["false"]["language"]


@pytest.mark.parametrize(("overrides", "message"), [
    # The encoders on the first stage, but one of them on two ranks of four.
    (coloc({"data": 2}, {"data": 4}, {"data": 2, "pipeline": 2}),
     "modules.audio.parallel (tensor x context x data x pipeline = 4 ranks) is invalid "
     "with every module at rank_offset=0: each encoder spans the language model's 4 ranks "
     "(colocated) or its first pipeline stage's 2 (the first-stage placement), every "
     "encoder alike"),
    (coloc({"data": 3}, {"data": 2}, {"data": 2, "pipeline": 2}),
     "modules.vision.parallel (tensor x context x data x pipeline = 3 ranks) is invalid"),
    # An encoder starting inside the first stage.
    (par("vision", rank_offset=1, data=1) + par("audio", rank_offset=0, data=2)
     + par("language", rank_offset=0, data=2, pipeline=2),
     "modules.vision.parallel.rank_offset=1 (1 ranks) is invalid: modules.audio sits on "
     "the language model's first pipeline stage (ranks 0-1), so every encoder must: "
     "rank_offset=0 and tensor x data = 2"),
    # One encoder on the first stage, the other in a block after the language model.
    (par("vision", rank_offset=0, data=2) + par("audio", rank_offset=4, data=2)
     + par("language", rank_offset=0, data=2, pipeline=2),
     "modules.audio.parallel.rank_offset=4 (2 ranks) is invalid: modules.vision sits on"),
    # No encoder on the first stage: the overlap is named as before.
    (par("vision", rank_offset=0, data=1) + par("audio", rank_offset=1, data=2)
     + par("language", rank_offset=0, data=2, pipeline=2),
     "partially overlap modules.language (ranks 0-3); use either the same ranks and size "
     "for every module (colocated), every encoder on the language model's first pipeline "
     "stage (rank_offset=0 and 2 ranks), or disjoint blocks"),
    # Context parallelism beside encoders on every rank (later stages hold no tokens).
    (coloc({"data": 4}, {"data": 4}, {"context": 2, "data": 1, "pipeline": 2}),
     "modules.language.parallel.context=2 is invalid with a colocated layout whose language "
     "model is pipelined (modules.language.parallel.pipeline=2); use context=1, every "
     "encoder on the first stage's 2 ranks"),
    (DP2_PP2 + ["data.balance_encoders=true"],
     "data.balance_encoders=true is invalid with a colocated layout whose language model "
     "is pipelined"),
])
def test_refused_combinations_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")
                       .replace(")", r"\)")):
        _layout(overrides)
