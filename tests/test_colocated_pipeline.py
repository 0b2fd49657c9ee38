"""Colocated layouts with a pipelined language model train like the plain loop.

Every module on the same ranks, the language model with ``pipeline > 1``: each rank runs
every encoder on the step's micro-batches, the colocated bridge hands the rows to the
first language stage, the language stages run 1F1B over point-to-point links, and the
bridges' and encoders' backward follow (:mod:`mimotron.pipeline.colocated_pipeline`).

Each parity case trains 12 fp32 iterations (lr 3e-3, clipping at 0.5) through the real
engine on forked gloo ranks and compares with :func:`tests.reference.reference_run` (one
process, whole global batch, no engine code): losses, global and per-module grad norms at
1e-4 relative, final weights at 1e-4 relative L2, replicas bitwise equal; the multi-rank
runs are replayed under NCCL's rules (``tests/conftest.py``). Cases: vision DP 4 | audio
DP 4 | language DP 2 x PP 2; language TP 2 (sequence parallel) x PP 2 fed by vision DP 4
and audio TP 2 x DP 2; language PP 4 (two middle stages that take no rows) with slices of
1 sample; encoder batching with the overlapped gradient reduction (the language stage's
buckets launched from gradient hooks, the encoders' at the step's end); a frozen vision
encoder; token-balanced batches; the language model under FSDP2 or ZeRO-1, the vision
encoder under FSDP2; packed rows.
Also: a resume in the middle of the run gives the same records bit for bit; evaluation
agrees with an unpipelined colocated layout; a frozen encoder saves nothing for
backward; the bridge's geometry, the stages' plans and the plan's memory terms (pure);
the combinations refused.
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.layout import check_layout, is_colocated_pipeline, language_pipeline
from mimotron.pipeline.actions_check import check_action_lists, layout_topology
from mimotron.pipeline.colocated import bridge_geometry
from mimotron.pipeline.edges import build_edges
from mimotron.pipeline.schedules import rank_actions
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS, coloc, engine_run
from tests.parity import (
    NUM_ITERS,
    SMALL_MB,
    TINY_BUCKETS,
    assert_steps_match,
    assert_weights_match,
    engine_results,
    metrics_lines,
    packed_reference,
    run_against_plain_loop,
)
from tests.reference import PACKING
from tests.resume_chain import launch, straight_and_resumed
from tests.saved_bytes import saved_inside

ITERS = 12
SP = ["modules.language.parallel.sequence_parallel=true"]
DP2_PP2 = coloc({"data": 4}, {"data": 4}, {"data": 2, "pipeline": 2})
TP2_PP2 = coloc({"data": 4}, {"tensor": 2, "data": 2}, {"tensor": 2, "data": 1, "pipeline": 2})
PP4 = coloc({"data": 4}, {"data": 2, "tensor": 2}, {"data": 1, "pipeline": 4})
FOUR_LAYERS = ["modules.language.num_layers=4"]
OVERLAP = ["train.encoder_batching=true", "train.overlap_grad_reduce=true", *TINY_BUCKETS]

# name: (layout and engine options, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "vision-dp4-audio-dp4-language-dp2-pp2": (DP2_PP2, []),
    "language-tp2-sp-pp2": (TP2_PP2 + SP, []),
    "language-pp4-mb4": (PP4, SMALL_MB + FOUR_LAYERS),
    "encoder-batching-overlap-mb4": (DP2_PP2 + OVERLAP, SMALL_MB),
    "frozen-vision": (DP2_PP2, ["modules.vision.freeze=true"]),
    "balance-tokens": (DP2_PP2 + ["data.balance_tokens=true"], []),
    # An encoder under FSDP2 over its DP 4: its backward (with the reduce-scatters)
    # after the language stages, on every rank.
    "vision-fsdp": (DP2_PP2 + ["modules.vision.parallel.fsdp=true"], []),
    # The language stages sharded over DP: FSDP2, and ZeRO-1 with its parameter gather.
    "language-fsdp-pp2": (coloc({"data": 4}, {"data": 4},
                                {"data": 2, "pipeline": 2, "fsdp": "true"}), []),
    "language-zero1-pp2": (coloc({"data": 4}, {"data": 4},
                                 {"data": 2, "pipeline": 2, "shard_optimizer": "true"}), []),
}  # an MoE language model: tests/test_moe_parity.py, ep2-colocated-pp2


def launches_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, counting each step's buckets launched from gradient hooks."""
    launches: list[tuple[int, int]] = []
    finish = GradSync.finish

    def counting_finish(self: GradSync) -> None:
        part = self.parts.get("language")  # none under FSDP2 (its own reduce-scatters)
        language = len(part.backward_buckets) if part is not None else 0
        launches.append((self.num_launched_early, language, len(self.buckets)))
        finish(self)

    GradSync.finish = counting_finish  # this forked rank only
    return {**engine_run(rank, world, overrides, num_iters), "launches": launches}


@pytest.mark.parametrize("name", list(CASES))
def test_colocated_pipeline_matches_plain_loop(name: str) -> None:
    layout, extra = CASES[name]
    results = run_against_plain_loop(layout, extra, run=launches_run, num_iters=ITERS)
    if "overlap" in name:
        for rank, res in enumerate(results):
            # The language stage's buckets launched from gradient hooks in its last
            # backward; the encoders' at the end of the step, on every rank alike.
            assert all(early == language > 1 and n > language
                       for early, language, n in res["launches"]), (rank, res["launches"])


def test_packed_rows_match_plain_loop() -> None:
    """Packed rows (items per row differ between ranks' spans): 10 iterations against the
    plain loop on rows packed by its own packer (losses, grad norms, weights)."""
    results = engine_results(PACKING + DP2_PP2, NUM_ITERS)
    ref = packed_reference(PACKING, NUM_ITERS)
    assert_steps_match(results, ref)
    assert_weights_match(results, ref)


def test_a_resume_in_the_middle_trains_the_same(tmp_path) -> None:
    """Stopped after iteration 3 and resumed from its checkpoint to 6: the same records
    (loss, grad norm, lr, consumed samples) bit for bit as the straight run."""
    straight, resumed = straight_and_resumed(tmp_path, 4, DP2_PP2, 3, 6)
    assert [r["iteration"] for r in straight] == list(range(1, 7))
    assert [r["iteration"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert resumed[-3:] == straight[-3:]


def _eval_losses(root, name: str, layout: list[str]) -> list[float]:
    launch(root, name, 4, layout + ["eval.interval=4"], None, 8)
    return [r["eval_loss"] for r in metrics_lines(root / name) if "eval_loss" in r]


def test_evaluation_agrees_with_an_unpipelined_layout(tmp_path) -> None:
    """The forward-only plan (encoders and bridges, then the language stages' forwards)
    gives the evaluation loss of the same training on a colocated layout without PP."""
    pipelined = _eval_losses(tmp_path, "pp2", DP2_PP2)
    plain = _eval_losses(tmp_path, "pp1", coloc({"data": 4}, {"data": 4}, {"data": 4}))
    assert len(pipelined) == len(plain) == 2
    for got, want in zip(pipelined, plain, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want), (pipelined, plain)


def _vision_saved(rank: int, world: int, overrides: list[str]) -> int:
    """Bytes autograd saves inside the vision module (tower and projector) on this rank
    over a training step, after a first step."""
    del rank, world
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())

    def step() -> None:
        train_step_mimo(default_forward_step, run.train_data_iterator, run.model,
                        run.optimizer, run.schedulers, run.global_state, run.communicator,
                        infra=run.infra)

    step()
    return saved_inside(run.model.modality_submodules["vision"], step)


BATCHED = ["train.encoder_batching=true"]


@pytest.mark.parametrize("layout", [DP2_PP2, DP2_PP2 + BATCHED,
                                    coloc({"data": 4}, {"data": 4}, {"data": 4}) + BATCHED],
                         ids=["pp2", "pp2-batched", "unpipelined-batched"])
def test_a_frozen_encoder_runs_ahead_keeping_nothing(layout: list[str]) -> None:
    """A frozen encoder's forwards run before the language model's (before its stages,
    or under encoder batching before the first micro-batch), with no autograd state: on
    every rank 0 bytes saved inside it (a trainable one saves its activations there,
    held until its backward: the measure sees them)."""
    frozen = run_ranks(4, _vision_saved, layout + ["modules.vision.freeze=true"],
                       timeout_s=120)
    trained = run_ranks(4, _vision_saved, layout, timeout_s=120)
    assert frozen == [0, 0, 0, 0]
    assert all(n > 0 for n in trained), trained


# ---- pure ---------------------------------------------------------------------------------
def _layout(overrides: list[str]):
    return check_layout(load_config(DIGITS, BASE + overrides))


@pytest.mark.parametrize("overrides", [DP2_PP2, TP2_PP2, PP4 + FOUR_LAYERS])
def test_bridge_geometry_feeds_the_first_stage_only(overrides: list[str]) -> None:
    """Every rank joins every bridge (``needed`` alike on all); first-stage ranks take
    their language slice, with the count of ranks holding it; later stages nothing."""
    layout = _layout(overrides)
    assert is_colocated_pipeline(layout)
    mbs = 16
    language = layout.modules["language"]
    for edge in build_edges(layout, {"vision": "image", "audio": "audio"}):
        geos = [bridge_geometry(layout, edge, r, mbs) for r in range(layout.world_size)]
        assert all(g.needed for g in geos)
        covered = set()
        for r, geo in enumerate(geos):
            lo, hi = geo.dst_slice
            if language.coordinate(r)["pp"] > 0:
                assert lo == hi, (r, geo)
                continue
            covered.update(range(lo, hi))
            same = [q for q in range(layout.world_size) if geos[q].dst_slice == geo.dst_slice]
            assert geo.dst_copies == len(same) == language.parallel.tensor
        assert covered == set(range(mbs))


@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "evaluate"])
def test_each_rank_runs_its_language_stage_plan(forward_only: bool) -> None:
    """A rank's plan is its language stage's plan of the language model alone; the
    stages' plans together pair every send and cannot deadlock (the action-list checks)."""
    layout = _layout(PP4 + FOUR_LAYERS)
    alone = language_pipeline(layout)
    assert not alone.colocated and list(alone.modules) == ["language"]
    plans = {}
    for rank in range(4):
        stage = layout.modules["language"].coordinate(rank)["pp"]
        plan = rank_actions(layout, rank, 6, True, forward_only)
        assert plan == rank_actions(alone, rank, 6, True, forward_only)
        plans[("language", stage)] = plan
    assert sorted(plans) == [("language", s) for s in range(4)]
    topology = {k: v for k, v in layout_topology(layout).items() if k[0] == "language"}
    check_action_lists(topology, plans, 6, forward_only)


@pytest.mark.parametrize(("overrides", "message"), [
    (coloc({"data": 2, "pipeline": 2}, {"data": 4}, {"data": 4}),
     "modules.vision.parallel.pipeline=2 is invalid: in a colocated layout only the "
     "language model may be pipelined"),
    (coloc({"data": 4}, {"data": 4}, {"context": 2, "data": 1, "pipeline": 2}),
     "modules.language.parallel.context=2 is invalid with a colocated layout whose "
     "language model is pipelined"),
    (DP2_PP2 + ["data.balance_encoders=true"],
     "data.balance_encoders=true is invalid with a colocated layout whose language model "
     "is pipelined"),
    (coloc({"data": 4}, {"data": 4}, {"data": 2, "pipeline": 2, "virtual_pipeline": 2})
     + ["modules.language.num_layers=4"],
     "modules.language.parallel.virtual_pipeline=2 is invalid"),
])
def test_refused_combinations_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_layout(load_config(DIGITS, BASE + overrides))


def test_plan_counts_every_micro_batch_of_the_encoders() -> None:
    """``mimotron plan``'s in-flight forwards: the encoders hold the whole step (their
    backward runs after the language stages), each language stage its 1F1B warm-up."""
    from mimotron.estimate.in_flight import held_forwards_peak

    cfg = load_config(DIGITS, BASE + DP2_PP2 + SMALL_MB)
    layout = check_layout(cfg)
    n = cfg.num_microbatches
    assert n > 2
    assert held_forwards_peak(cfg, layout, "vision", 0) == n
    assert held_forwards_peak(cfg, layout, "audio", 0) == n
    assert [held_forwards_peak(cfg, layout, "language", s) for s in (0, 1)] == [2, 1]


def test_plan_counts_the_first_stages_bridged_rows() -> None:
    """The first stage keeps every micro-batch's bridged rows and their gradients until
    the encoders' backward: by hand, 2 x micro-batches x its samples x the encoders'
    tokens x hidden x 4 bytes (fp32); a frozen encoder's rows take no gradient; later
    stages and unpipelined layouts keep none."""
    from mimotron.estimate.widths import bridged_rows_bytes

    cfg = load_config(DIGITS, BASE + DP2_PP2)
    layout = check_layout(cfg)
    lm, vision, audio = (cfg.modules[n] for n in ("language", "vision", "audio"))
    per_micro_batch = (cfg.train.micro_batch_size // 2 * lm.hidden_size * 4
                       * (vision.num_output_tokens + audio.num_output_tokens))
    assert bridged_rows_bytes(cfg, layout, "language", 0) == (
        2 * cfg.num_microbatches * per_micro_batch)
    assert bridged_rows_bytes(cfg, layout, "language", 1) == 0
    frozen = load_config(DIGITS, BASE + DP2_PP2 + ["modules.vision.freeze=true"])
    assert bridged_rows_bytes(frozen, check_layout(frozen), "language", 0) == (
        cfg.num_microbatches * cfg.train.micro_batch_size // 2 * lm.hidden_size * 4
        * (vision.num_output_tokens + 2 * audio.num_output_tokens))
    plain = load_config(DIGITS, BASE + coloc({"data": 4}, {"data": 4}, {"data": 4}))
    assert bridged_rows_bytes(plain, check_layout(plain), "language", 0) == 0
