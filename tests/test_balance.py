"""Balanced work: samples dealt to language DP replicas by tokens (``data.balance_tokens``)
and media items to encoder DP replicas by cost (``data.balance_encoders``).

The deal itself (:mod:`mimotron.data.balance`), what every rank's provider hands its
modules (each item encoded exactly once, each sample trained exactly once, the language
side able to put its items back in order), parity with the plain loop on split and
colocated layouts, a resume in the middle of an epoch, and the refused combinations.
"""

from __future__ import annotations

import random

import pytest
import torch

from mimotron.config import load_config
from mimotron.data import build_datasets
from mimotron.data.balance import (
    balanced_items,
    balanced_order,
    deal_step,
    encoder_items,
    in_item_order,
    item_costs,
    lpt_bins,
    owner_keys,
)
from mimotron.data.run_data import build_tokenizer
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import check_layout
from mimotron.pipeline.balanced_bridge import item_positions
from mimotron.training.balanced_batches import Balance
from mimotron.training.data_provider import MicrobatchProvider, PackedMicrobatchProvider
from tests.common import BASE, DIGITS, coloc, colocated, noncolocated
from tests.parity import (
    NUM_ITERS,
    SMALL_MB,
    assert_steps_match,
    assert_weights_match,
    engine_results,
    packed_reference,
    run_against_plain_loop,
)
from tests.reference import PACKING
from tests.resume_chain import straight_and_resumed

BALANCED = ["data.balance_encoders=true", "data.balance_tokens=true"]


# ---- the deal ---------------------------------------------------------------------------
def test_lpt_bins_is_largest_first_to_the_least_loaded_with_room() -> None:
    # 5→0, 4→1, 3→1, 3→0, 2→1, 1→0: loads 9 and 9
    assert lpt_bins([5, 1, 4, 2, 3, 3], 2) == [0, 0, 1, 1, 1, 0]
    assert lpt_bins([3, 3, 3, 3], 2) == [0, 1, 0, 1]  # equal costs: index order, low bin
    assert lpt_bins([9, 1, 1, 1], 2, capacity=2) == [0, 1, 1, 0]  # room caps bin 1 at two
    # per group (micro-batch) at most one item a bin: group 0's two go apart
    assert lpt_bins([9, 8, 1, 1], 2, capacity=1, groups=[0, 0, 1, 1]) == [0, 1, 1, 0]
    loads = [10.0, 0.0]
    assert lpt_bins([2, 2], 2, loads=loads) == [1, 1] and loads == [10.0, 4.0]


def _heavy_tailed(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(20 + 400 * rng.paretovariate(1.5) % 2000) for _ in range(n)]


@pytest.mark.parametrize(("replicas", "microbatches"), [(2, 4), (4, 2), (4, 8)])
def test_balanced_order_is_a_permutation_with_even_replicas(replicas: int, microbatches: int
                                                            ) -> None:
    lengths = _heavy_tailed(64, seed=replicas * 10 + microbatches)
    order = balanced_order(lengths, replicas, microbatches)
    assert sorted(order) == list(range(64))
    per_mb, per_slice = 64 // microbatches, 64 // microbatches // replicas

    def replica_tokens(order: list[int]) -> list[int]:
        return [sum(lengths[order[j * per_mb + d * per_slice + r]]
                    for j in range(microbatches) for r in range(per_slice))
                for d in range(replicas)]

    after, before = replica_tokens(order), replica_tokens(list(range(64)))
    assert max(after) / (sum(after) / replicas) <= 1.05, after
    assert max(after) < max(before), (after, before)  # the stream order was uneven
    assert balanced_order(lengths, replicas, microbatches) == order  # a pure function


def test_deal_step_evens_each_microbatch_or_the_whole_step() -> None:
    """Per micro-batch (what a bridge that waits for every micro-batch's slowest replica
    needs): each micro-batch's largest load is as small as its items allow; per step
    (encoder batching): the step's loads are even, micro-batches may not be."""
    costs = [[9.0, 1.0, 1.0, 1.0], [9.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    per_mb = deal_step(costs, 2, [4, 4, 4], per_step=False)
    loads = [[sum(c for c, b in zip(mb, own, strict=True) if b == r) for r in (0, 1)]
             for mb, own in zip(costs, per_mb, strict=True)]
    assert [max(x) for x in loads] == [9.0, 9.0, 2.0]  # the 9 alone, the rest opposite it
    per_step = deal_step(costs, 2, [4, 4, 4], per_step=True)
    totals = [sum(c for mb, own in zip(costs, per_step, strict=True)
                  for c, b in zip(mb, own, strict=True) if b == r) for r in (0, 1)]
    assert totals == [14.0, 14.0]
    # capacities bound a replica's items of one micro-batch
    assert all(own.count(0) <= 2 and own.count(1) <= 2
               for own in deal_step(costs, 2, [2, 2, 2], per_step=True))


def test_a_custom_forward_step_gets_rows_in_sample_order() -> None:
    """What the forward step (a user's too) receives: the rows back in item order."""
    from types import SimpleNamespace

    from mimotron.training.language_step import in_sample_order

    mask = torch.tensor([True, True, True])
    batch = owner_keys(mask, [1, 0, 1], "image")
    grouped = torch.tensor([[1.0], [0.0], [2.0]])  # replica 0's item 1, then replica 1's 0, 2
    model = SimpleNamespace(modality_of={"vision": "image", "audio": "audio"})
    out = in_sample_order(model, batch, {"vision": grouped, "audio": None})
    assert out["vision"].flatten().tolist() == [0.0, 1.0, 2.0] and out["audio"] is None


def test_item_costs_weigh_frames_squared_for_native_items() -> None:
    batch = {"has_image": torch.tensor([True, False, True]),
             "image_grid": torch.tensor([[1, 4, 4], [0, 0, 0], [2, 2, 4]])}
    # n + t * (h w)^2 / (6 hidden): 16 + 256 / 48 and 16 + 2 * 64 / 48.
    assert item_costs(batch, "image", 8) == pytest.approx([16 + 256 / 48, 16 + 128 / 48])
    assert item_costs({"has_image": torch.tensor([True, True, False])}, "image", 8) == [1, 1]


def test_owner_rows_and_item_order_round_trip() -> None:
    """Items grouped by replica (as a bridge delivers them) come back in item order, and
    the positions among every replica's rows are the very rows each replica encoded."""
    mask = torch.tensor([[True, True], [False, False], [True, False], [True, True]])
    owners = [1, 0, 1, 0, 0]  # items 0..4 in row-major order
    keys = owner_keys(mask, owners, "image")
    assert keys["image_owner"].tolist() == [[1, 0], [-1, -1], [1, -1], [0, 0]]
    assert keys["image_owner_row"].tolist() == [[0, 0], [-1, -1], [1, -1], [1, 2]]
    owner, row = balanced_items(keys, "image")
    items = torch.arange(5.0)
    encoded = [items[[i for i in range(5) if owners[i] == r]] for r in (0, 1)]
    where = item_positions(owner, row, [len(e) for e in encoded])
    grouped = torch.cat(encoded)[where]
    assert grouped.tolist() == [1, 3, 4, 0, 2]  # replica 0's, then replica 1's
    assert in_item_order(grouped, owner).tolist() == items.tolist()


# ---- what each rank's provider hands its modules -----------------------------------------
def _providers(overrides: list[str], packed: bool = False) -> tuple[list, list, object]:
    cfg = load_config(DIGITS, BASE + overrides)
    layout = check_layout(cfg)
    tokenizer = build_tokenizer(cfg)
    task, _ = build_datasets(cfg, tokenizer)
    stream = task.stream(cfg.train.seed)
    kwargs = {"pad_id": task.pad_id, "image_shape": task.image_shape,
              "audio_shape": task.audio_shape}
    kind = PackedMicrobatchProvider if packed else MicrobatchProvider
    providers = [kind(layout, r, cfg.train.micro_batch_size, cfg.data.seq_length,
                      stream.samples, kwargs, balance=Balance.from_config(cfg))
                 for r in range(layout.world_size)]
    return providers, stream, cfg


def _by_replica(providers: list, step: list, module: str) -> dict[int, dict]:
    """Micro-batch slices of ``module`` by DP replica (TP copies checked equal)."""
    out: dict[int, dict] = {}
    for p, mb in zip(providers, step, strict=True):
        if module in mb:
            replica = p.balanced.replica[module]
            if replica in out:
                for key, value in mb[module].items():
                    assert torch.equal(value, out[replica][key]), (module, key)
            out[replica] = mb[module]
    return out


@pytest.mark.parametrize("layout", [
    noncolocated({"data": 2}, {"data": 2}, {"data": 2}),
    coloc({"data": 4}, {"data": 2, "tensor": 2}, {"data": 2, "tensor": 2}),
], ids=["split", "colocated"])
def test_every_item_is_encoded_once_and_every_sample_trained_once(layout: list[str]) -> None:
    providers, stream, cfg = _providers(layout + BALANCED + SMALL_MB)
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    steps = [p.step(gbs, gbs // mbs) for p in providers]  # the second global batch
    seen = []
    for j in range(gbs // mbs):
        language = _by_replica(providers, [s[j] for s in steps], LANGUAGE)
        seen += [i for r in sorted(language) for i in language[r]["index"].tolist()]
        for name, modality in (("vision", "image"), ("audio", "audio")):
            encoded = _by_replica(providers, [s[j] for s in steps], name)
            sizes = [len(encoded[r][modality]) for r in sorted(encoded)]
            slots = mbs // len(encoded)  # one item slot per sample here
            assert max(sizes) <= slots, (name, j, sizes)  # never more than a slice's slots
            used = torch.cat([item_positions(*balanced_items(language[r], modality), sizes)
                              for r in sorted(language)])
            # every encoded row goes to exactly one language slot, every slot gets one
            assert sorted(used.tolist()) == list(range(sum(sizes))), (name, j)
    assert sorted(seen) == sorted(int(s["index"]) for s in stream.samples(gbs, gbs))
    assert seen != [int(s["index"]) for s in stream.samples(gbs, gbs)]  # dealt, not as read


def test_items_reach_their_own_samples() -> None:
    """The language side's items, gathered from the replicas and put back in item order,
    are the very images of its samples (what the stream order's collate holds)."""
    providers, _, cfg = _providers(noncolocated({"data": 2}, {}, {"data": 2}) + BALANCED
                                   + SMALL_MB)
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    steps = [p.step(0, gbs // mbs) for p in providers]
    for j in range(gbs // mbs):
        by_replica = {p.balanced.replica["vision"]: s[j]["vision"]
                      for p, s in zip(providers, steps, strict=True) if "vision" in s[j]}
        rows = [by_replica[r]["image"] for r in sorted(by_replica)]
        assert sum(len(r) for r in rows) > 0
        for p, s in zip(providers, steps, strict=True):
            if LANGUAGE not in s[j]:
                continue
            lang = s[j][LANGUAGE]
            owner, row = balanced_items(lang, "image")
            got = in_item_order(torch.cat(rows)[item_positions(owner, row,
                                                              [len(r) for r in rows])], owner)
            # the language slice's own images, read from its whole-batch collate
            whole = p.sample_at(0, gbs)
            index_of = {int(s_["index"]): s_ for s_ in whole}
            want = [index_of[int(i)]["image"] for i, h in
                    zip(lang["index"].tolist(), lang["has_image"].tolist(), strict=True) if h]
            assert len(want) == got.shape[0]
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b.reshape(a.shape))


def test_encoder_items_carry_their_samples() -> None:
    batch = {"image": torch.arange(4.0).reshape(4, 1), "has_image": torch.tensor(
        [True, False, True, True]), "tokens": torch.zeros(4, 3)}
    owners = lpt_bins(item_costs(batch, "image", 8), 2)
    mine = encoder_items(batch, "image", owners, 1)
    assert owners == [0, 1, 0]
    assert mine["image"].tolist() == [[2.0]] and mine["image_sample"].tolist() == [2]
    assert "tokens" not in mine and mine["has_image"].tolist() == [True]


def test_packed_rows_are_dealt_by_their_tokens() -> None:
    providers, _, cfg = _providers(noncolocated({}, {}, {"data": 2}) + PACKING
                                   + ["data.balance_tokens=true"], packed=True)
    plain, _, _ = _providers(noncolocated({}, {}, {"data": 2}) + PACKING, packed=True)
    num = cfg.train.global_batch_size // cfg.train.micro_batch_size
    lang = [p for p in providers if LANGUAGE in p.slices]
    lang_plain = [p for p in plain if LANGUAGE in p.slices]

    def tokens(ps: list) -> list[int]:
        out = []
        for p in ps:
            mbs, nxt, real = p.packed_step(0, num)
            out.append(sum(int((mb[LANGUAGE]["tokens"] != 0).sum()) for mb in mbs))
        return out

    after, before = tokens(lang), tokens(lang_plain)
    assert sum(after) == sum(before)
    assert max(after) - min(after) <= max(before) - min(before)


# ---- the same model, whoever computes ------------------------------------------------------
# name: (engine-only layout, overrides shared with the plain loop)
PARITY_CASES = {
    "split vision DP 2 | audio | language DP 2": (
        noncolocated({"data": 2}, {}, {"data": 2}), SMALL_MB),
    "split vision DP 2 | audio DP 2 | language PP 2": (
        noncolocated({"data": 2}, {"data": 2}, {"pipeline": 2}), SMALL_MB),
    "split vision PP 2 x DP 2 | audio | language DP 2": (
        noncolocated({"pipeline": 2, "data": 2}, {}, {"data": 2}),
        [*SMALL_MB, "modules.vision.num_layers=2"]),
    "colocated vision DP 4, language TP 2 x DP 2": (
        coloc({"data": 4}, {"tensor": 2, "data": 2}, {"tensor": 2, "data": 2}), SMALL_MB),
    "colocated vision DP 2, audio TP 2, language DP 2, encoder batching": (
        coloc({"data": 2}, {"tensor": 2}, {"data": 2}) + ["train.encoder_batching=true"],
        SMALL_MB),
}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_balanced_layout_matches_plain_loop(name: str) -> None:
    layout, extra = PARITY_CASES[name]
    run_against_plain_loop(layout + BALANCED, extra)


@pytest.mark.parametrize("layout", [
    noncolocated({"data": 2}, {}, {"data": 2}), colocated(2)], ids=["split", "colocated"])
def test_balanced_packed_rows_match_plain_loop(layout: list[str]) -> None:
    """Packed rows dealt by their tokens, their items by cost: 10 iterations against the
    plain loop on rows packed by its own packer (losses, grad norms, weights)."""
    results = engine_results(PACKING + layout + BALANCED, NUM_ITERS)
    ref = packed_reference(PACKING, NUM_ITERS)
    assert_steps_match(results, ref)
    assert_weights_match(results, ref)


def test_a_resume_mid_epoch_deals_the_same_and_trains_the_same(tmp_path) -> None:
    """Stopped after iteration 6 of 12 and resumed from its checkpoint: the same records
    (loss, grad norm, lr, consumed samples) bit for bit as the straight run."""
    layout = noncolocated({"data": 2}, {}, {"data": 2}) + BALANCED + SMALL_MB
    straight, resumed = straight_and_resumed(tmp_path, 5, layout, 6, 12)
    assert [r["iteration"] for r in straight] == list(range(1, 13))
    assert resumed[-6:] == straight[-6:]


# ---- refused ------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "message"), [
    (["data.balance_tokens=true", "modules.language.num_experts=4"],
     "data.balance_tokens=true is invalid with modules.language.num_experts=4"),
    (["data.balance_encoders=true", *noncolocated({}, {}, {"context": 2})],
     "data.balance_encoders=true is invalid with modules.language.parallel.context=2"),
])
def test_unsupported_combinations_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(DIGITS, BASE + overrides)
