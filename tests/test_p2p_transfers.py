"""Pipeline transfers: header-free stage links, batched groups, no bit changed.

One launch (5 gloo ranks: vision PP 2 | audio | language PP 2) trains through the real
engine twice: first as shipped (the language stage link sends no shape header, the
loss-token count is reduced in the background and waited for where first needed),
then with both switched off (every transfer carries its header, the count waited for
before the schedule: the previous behaviour). Losses, grad norms, every gradient as the
optimizer steps it and the final weights must be bitwise equal, and the
communicators' counters show which path ran: no header on the language stage link,
headers kept on the variable-shape links (the vision stage link and the bridge carry
one row per sample that has an image). ``tests/test_parity.py`` compares the shipped
path with the plain PyTorch loop (``language-pp2*``, ``vision-pp2-language-pp2``).

A bf16 launch checks the link's dtype assumption (fp32 residual stream under autocast).
Another feeds the language model micro-batches of another sequence length
through ``train_step_mimo``: the sending stage raises a ``ValueError`` naming the
geometry, before anything is sent (the harness's hard timeout guards against a hang).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mimotron.config import load_config
from mimotron.forked_ranks import RankError, run_ranks
from mimotron.parallel.layout import check_layout
from mimotron.pipeline import communicator as communicator_module
from mimotron.pipeline.communicator import MultiModulePipelineCommunicator
from mimotron.pipeline.edges import build_edges
from mimotron.pipeline.links import build_link_groups, p2p_links
from mimotron.pipeline.p2p import LinkGroups, PendingSends, Recv, TransferCounts, exchange
from mimotron.pipeline.shapes import stage_link_shape
from mimotron.runtime import init_runtime
from mimotron.training import loop as loop_module
from mimotron.training import step as step_module
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import GlobalTokenCount, default_forward_step
from tests.common import BASE, DIGITS, engine_run, noncolocated

NUM_ITERS = 10
NUM_MB = 2  # global batch 16 / micro-batch 8
LAYOUT = noncolocated({"pipeline": 2}, {}, {"pipeline": 2}) + ["modules.vision.num_layers=2"]
LM_PP2 = noncolocated({}, {}, {"pipeline": 2})
# Every sample carries both modalities: the bridges' row counts are fixed too.
EVERY_SAMPLE_BOTH = ["data.p_image=0", "data.p_audio=0", "data.p_both=1", "data.p_text=0"]
FAN_IN = noncolocated({"data": 2}, {}, {"pipeline": 2})  # vision DP 2 -> language DP 1


def _recording_run(rank: int, world: int, overrides: list[str], num_iters: int = NUM_ITERS
                   ) -> dict:
    """``engine_run`` plus this rank's role and its communicator's final counters."""
    counts: list[dict[str, int]] = []
    finish = MultiModulePipelineCommunicator.finish

    def recording_finish(self: MultiModulePipelineCommunicator, forward_only: bool = False
                         ) -> None:
        finish(self, forward_only)
        counts.append(dataclasses.asdict(self.counts))

    MultiModulePipelineCommunicator.finish = recording_finish  # this forked rank only
    try:
        out = engine_run(rank, world, overrides, num_iters)
    finally:
        MultiModulePipelineCommunicator.finish = finish
    role = check_layout(load_config(DIGITS, BASE + overrides)).roles(rank)[0]
    return {**out, "module": role.module, "pp": role.pp, "counts": counts[-1]}


class _CountedAtOnce(GlobalTokenCount):
    """The previous token count: every rank waits for the reduction before its schedule."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.value()


def _new_then_old(rank: int, world: int) -> dict:
    new = _recording_run(rank, world, LAYOUT)
    # The previous behaviour: no shape known in advance, and the loss-token count
    # waited for before the schedule.
    communicator_module.stage_link_shape = lambda *args, **kwargs: None
    step_module.GlobalTokenCount = _CountedAtOnce
    old = _recording_run(rank, world, LAYOUT)
    return {"new": new, "old": old}


def _fixed_shapes(rank: int, world: int) -> dict:
    """Every sample with both modalities: fp32 with and without, then bf16."""
    new = _recording_run(rank, world, FAN_IN + EVERY_SAMPLE_BOTH, num_iters=2)
    bf16 = _recording_run(rank, world, FAN_IN + EVERY_SAMPLE_BOTH + ["train.precision=bf16"],
                          num_iters=2)
    communicator_module.stage_link_shape = lambda *args, **kwargs: None
    loop_module.bridge_row_shapes = lambda *args: {}
    old = _recording_run(rank, world, FAN_IN + EVERY_SAMPLE_BOTH, num_iters=2)
    return {"new": new, "bf16": bf16, "old": old}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(5, _new_then_old, timeout_s=240)


@pytest.fixture(scope="module")
def fixed() -> list[dict]:
    return run_ranks(5, _fixed_shapes, timeout_s=120)


def test_fixed_bridges_send_no_header_in_fp32(fixed: list[dict]) -> None:
    for r in fixed:
        role = (r["new"]["module"], r["new"]["pp"])
        assert r["new"]["counts"]["headers_sent"] == 0, role
        assert r["new"]["counts"]["headers_received"] == 0, role
        assert r["new"]["counts"]["header_free_sends"] > 0, role
        if role != ("language", 1):  # the last stage sends gradients only: never a header
            assert r["old"]["counts"]["headers_sent"] > 0, role
        assert r["new"]["steps"] == r["old"]["steps"]
        for name, w in r["new"]["weights"].items():
            assert torch.equal(w, r["old"]["weights"][name]), name


def test_bf16_keeps_bridge_headers_but_not_the_stage_links(fixed: list[dict]) -> None:
    """bf16 autocast: the residual stream (the stage link) stays fp32; the projector's
    output dtype is not assumed, so the bridge keeps its headers."""
    by_role = {(r["bf16"]["module"], r["bf16"]["pp"]): r["bf16"] for r in fixed}
    assert by_role[("language", 1)]["counts"]["headers_sent"] == 0
    assert by_role[("language", 1)]["counts"]["header_free_sends"] == 2 * NUM_MB
    assert by_role[("language", 0)]["counts"]["headers_received"] == 3 * 2 * NUM_MB
    assert all(not skipped for _, _, skipped, _ in by_role[("language", 1)]["steps"])


def test_results_are_bitwise_equal_with_and_without(runs: list[dict]) -> None:
    for r in runs:
        new, old = r["new"], r["old"]
        assert new["steps"] == old["steps"]
        assert new["grad_sq"] == old["grad_sq"]
        assert new["weights"].keys() == old["weights"].keys()
        for name, w in new["weights"].items():
            assert torch.equal(w, old["weights"][name]), name


def test_language_stage_link_sends_no_header(runs: list[dict]) -> None:
    transfers = NUM_ITERS * NUM_MB
    by_role = {(r["new"]["module"], r["new"]["pp"]): r for r in runs}
    first, last = by_role[("language", 0)], by_role[("language", 1)]
    # Stage 1 talks only over the stage link: not one header either way.
    assert last["new"]["counts"]["headers_sent"] == 0
    assert last["new"]["counts"]["headers_received"] == 0
    assert last["new"]["counts"]["header_free_sends"] == transfers  # input gradients
    # Stage 0: the link header-free; the bridge (vision, audio) keeps its headers on the
    # rows it receives. Gradients never carry one: their shape is what the peer sent.
    assert first["new"]["counts"]["header_free_sends"] == 3 * transfers
    assert first["new"]["counts"]["headers_received"] == 2 * transfers
    assert first["new"]["counts"]["headers_sent"] == 0
    # Before: every activation had its header.
    assert first["old"]["counts"]["headers_sent"] == transfers
    assert first["old"]["counts"]["header_free_sends"] == 2 * transfers


def test_variable_shapes_keep_their_header(runs: list[dict]) -> None:
    transfers = NUM_ITERS * NUM_MB
    by_role = {(r["new"]["module"], r["new"]["pp"]): r for r in runs}
    # The vision stage link carries one row per sample with an image: header kept
    # (stage 0: activations; stage 1: the bridge's rows), the gradients (stage 1 to 0)
    # without one.
    for pp, headers, free in ((0, transfers, 0), (1, transfers, transfers)):
        counts = by_role[("vision", pp)]["new"]["counts"]
        assert counts["header_free_sends"] == free
        assert counts["headers_sent"] == headers
        assert counts == by_role[("vision", pp)]["old"]["counts"]


def test_each_direction_of_a_link_has_its_own_group() -> None:
    """On every point-to-point group one rank only sends and the other only receives."""
    cfg = load_config(DIGITS, BASE + LAYOUT)
    layout = check_layout(cfg)
    links = p2p_links(layout, cfg.train.micro_batch_size,
                      build_edges(layout, {"vision": "image", "audio": "audio"}))
    # vision PP 2 on 0-1, audio on 2, language PP 2 on 3-4: stage links and bridges.
    assert links == [(0, 1), (1, 0), (1, 3), (2, 3), (3, 1), (3, 2), (3, 4), (4, 3)]
    built = run_ranks(5, _link_groups, links, timeout_s=60)
    names = {}
    for rank, mine in enumerate(built):
        # A rank holds the groups of its own links, each of exactly the link's two ranks.
        assert sorted(mine) == [link for link in links if rank in link], rank
        for link, (name, ranks) in mine.items():
            assert ranks == sorted(link), (rank, link)
            assert names.setdefault(link, name) == name, (rank, link)  # one group, both ends
    # Every direction its own group: (a, b) and (b, a) never share one.
    assert len(set(names.values())) == len(links), names


def _link_groups(rank: int, world: int, links: list[tuple[int, int]]
                 ) -> dict[tuple[int, int], tuple[str, list[int]]]:
    import torch.distributed as dist

    groups = build_link_groups(links, rank)
    dist.barrier()  # no rank leaves while a peer still connects one of its groups
    return {link: (g.group_name, dist.get_process_group_ranks(g)) for link, g in groups.items()}


def test_stage_link_shape_from_the_config() -> None:
    def layout(**language: int):  # noqa: ANN202
        return check_layout(load_config(DIGITS, BASE + noncolocated({}, {}, language)))

    assert stage_link_shape(layout(), 8, 64, 32) is None  # one stage: no link
    assert stage_link_shape(layout(pipeline=2), 8, None, 32) is None  # unknown length
    link = stage_link_shape(layout(pipeline=2, data=2, context=2), 8, 64, 32)
    assert link is not None and (link.shape, link.dtype) == ((4, 32, 32), torch.float32)
    with pytest.raises(ValueError, match=r"is \[4, 24, 32\].*carries \[4, 32, 32\].*"
                                         r"data.seq_length=64.*\[4, 64\] tokens"):
        link.check(torch.zeros(4, 24, 32), "micro-batch 0's stage output")


def _shorter_sequences(rank: int, world: int) -> None:
    cfg = load_config(DIGITS, BASE + LM_PP2)
    run = setup_mimo(cfg, init_runtime())
    step = next(run.train_data_iterator)
    seq = cfg.data.seq_length
    for mb in step:  # A user's iterator: 8 positions short (placeholders stay in).
        if "language" in mb:
            mb["language"] = {k: v[:, :seq - 8] if v.dim() >= 2 and v.shape[1] == seq else v
                              for k, v in mb["language"].items()}
    train_step_mimo(default_forward_step, iter([step]), run.model, run.optimizer,
                    run.schedulers, run.global_state, run.communicator, infra=run.infra)


def _text_only_sample(rank: int, world: int) -> None:
    cfg = load_config(DIGITS, BASE + FAN_IN + EVERY_SAMPLE_BOTH)
    run = setup_mimo(cfg, init_runtime())
    step = next(run.train_data_iterator)
    if "vision" in step[0]:  # A user's iterator: one sample of the slice has no image.
        batch = step[0]["vision"]
        keep = torch.arange(batch["has_image"].shape[0]) != 0
        batch["has_image"] = batch["has_image"] * keep.to(batch["has_image"].dtype)
    train_step_mimo(default_forward_step, iter([step]), run.model, run.optimizer,
                    run.schedulers, run.global_state, run.communicator, infra=run.infra)


def test_mismatched_batches_raise_on_the_sender() -> None:
    with pytest.raises(RankError, match=r"rank 2 failed: ValueError: micro-batch 0's output "
                                        r"for rank 3 is \[8, 56, 64\].*carries \[8, 64, 64\]"):
        run_ranks(4, _shorter_sequences, timeout_s=90)
    with pytest.raises(RankError, match=r"failed: ValueError: micro-batch 0's output for rank "
                                        r"3 is \[3, .*bridge from 'vision' carries \[4, .*every "
                                        r"sample of the slice must carry 'vision'"):
        run_ranks(5, _text_only_sample, timeout_s=90)


def _mixed_receives(rank: int, world: int) -> list[list[float]]:
    """Rank 0 sends three tensors to rank 1 in one exchange: with a header, without one
    (its shape known to both), with a header again; rank 1 receives them in one too."""
    counts, pending = TransferCounts(), PendingSends()
    links = LinkGroups(rank, build_link_groups([(0, 1), (1, 0)], rank))
    cpu = torch.device("cpu")
    if rank == 0:
        a, b, c = torch.arange(3.0), torch.full((2, 2), 7.0), torch.arange(5.0) + 10
        exchange([(1, a), (1, b), (1, c)], [], pending, counts, cpu,
                 [None, ((2, 2), torch.float32), None], links)
        pending.wait()
        return []
    got = exchange([], [Recv(0), Recv(0, ((2, 2), torch.float32)), Recv(0)], pending,
                   counts, cpu, links=links)
    return [t.flatten().tolist() for t in got]


def test_receives_from_one_peer_follow_its_sending_order() -> None:
    """A known-shape receive between two header receives from the same peer is posted
    only after the first header's payload: messages of a pair match in posting order."""
    got = run_ranks(2, _mixed_receives, timeout_s=60)[1]
    assert got == [[0.0, 1.0, 2.0], [7.0] * 4, [10.0, 11.0, 12.0, 13.0, 14.0]]
