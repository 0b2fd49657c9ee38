"""Sequence packing (``data.packing``): documents stay apart, and training matches a plain loop.

The forward tests run the real model in one process on packed rows of the digits stream
and on the same documents one per row; the parity tests train packed runs through the
engine and compare with the independent loop of ``tests.reference`` fed by a packer
of its own (consecutive samples while they fit).
"""

from __future__ import annotations

import json
import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mimotron.config import load_config
from mimotron.data import CharTokenizer, build_datasets, collate
from mimotron.data.packing import collate_packed, pack_rows, real_tokens
from mimotron.data.prefetch import PrefetchingReader
from mimotron.forked_ranks import run_ranks
from mimotron.models.attention import document_args
from mimotron.models.build import build_mimo_model
from mimotron.parallel.layout import check_layout
from mimotron.runtime import init_runtime
from mimotron.training.data_provider import (
    MicrobatchProvider,
    PackedMicrobatchProvider,
    PackedTrainIterator,
)
from mimotron.training.loop import run_training
from tests.common import BASE, DIGITS, colocated, noncolocated
from tests.parity import assert_steps_match, assert_weights_match, engine_results, packed_reference
from tests.reference import PACKING, VOCAB_MULTIPLE

NUM_ITERS = 10


@cache
def _setup() -> tuple:
    """Config, task and an untrained tiny model (one process, packing on)."""
    cfg = load_config(DIGITS, BASE + PACKING)
    tokenizer = CharTokenizer()
    task, _ = build_datasets(cfg, tokenizer)
    vocab = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    torch.manual_seed(0)
    model = build_mimo_model(cfg, vocab, placeholders).eval()
    return cfg, task, model


def _kwargs(task: object) -> dict:
    return {"pad_id": task.pad_id, "image_shape": task.image_shape,
            "audio_shape": task.audio_shape}


def _logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Full-model logits ``[B, S, V]`` (encode, merge, language model)."""
    names = list(model.modality_submodules)
    embeds = {n: model.encode(n, batch) for n in names}
    present = {n: model.present_mask(n, batch) for n in names}
    lm = model.language_model
    hidden = model.merge_embeddings(batch["tokens"], lm.embed_tokens(batch["tokens"]),
                                    embeds, present)
    return lm(hidden, **document_args(batch))


def _packed_rows(count: int = 12) -> tuple[list, dict]:
    _, task, _ = _setup()
    rows, _ = pack_rows(task.stream(0).samples, 0, count, task.seq_length)
    return rows, collate_packed(rows, task.seq_length, **_kwargs(task))


def test_packed_documents_match_unpacked_forward():
    """Each document's logits and loss in a packed row are those of the document alone."""
    _, task, model = _setup()
    rows, batch = _packed_rows()
    assert max(len(r) for r in rows) >= 3, "no row packs several documents"
    assert int(batch["has_image"].sum(1).max()) >= 2, "no row holds several images"
    assert int(batch["has_audio"].sum(1).max()) >= 2, "no row holds several tones"
    with torch.no_grad():
        packed = _logits(model, batch)
        for i, row in enumerate(rows):
            alone = _logits(model, collate(row, task.seq_length, **_kwargs(task)))
            start = 0
            for d, doc in enumerate(row):
                n = doc["tokens"].numel()
                got, want = packed[i, start:start + n], alone[d, :n]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                got_loss, want_loss = (float((F.cross_entropy(z, doc["labels"], reduction="none")
                                              * doc["loss_mask"]).sum()) for z in (got, want))
                assert abs(got_loss - want_loss) <= 1e-4 * want_loss
                start += n
    # The loss token count is unchanged by packing.
    assert float(batch["loss_mask"].sum()) == sum(float(s["loss_mask"].sum())
                                                  for r in rows for s in r)


def test_positions_restart_and_documents_cannot_see_each_other():
    """RoPE positions restart per document; editing one document leaves the others alone."""
    _, task, model = _setup()
    rows, batch = _packed_rows()
    i = next(k for k, r in enumerate(rows) if len(r) >= 3)
    lengths = [s["tokens"].numel() for s in rows[i]]
    starts = [sum(lengths[:d]) for d in range(len(lengths))]
    assert [int(batch["position_ids"][i, s]) for s in starts] == [0] * len(starts)
    assert batch["position_ids"][i, starts[1] + 3] == 3
    assert batch["doc_ids"][i, sum(lengths):].eq(-1).all()
    edited = {k: v.clone() for k, v in batch.items()}
    # Change document 1: its answer tokens and any media the row's documents carry.
    lo, hi = starts[1], starts[1] + lengths[1]
    edited["tokens"][i, hi - 3:hi - 1] = edited["tokens"][i, hi - 3:hi - 1].flip(0) + 1
    with torch.no_grad():
        before, after = _logits(model, batch)[i], _logits(model, edited)[i]
    others = torch.ones(before.shape[0], dtype=torch.bool)
    others[lo:hi] = False
    assert torch.equal(before[others], after[others])
    assert not torch.allclose(before[lo:hi], after[lo:hi]), "the edit changed nothing"


def test_resume_and_real_token_count():
    """A packed stream resumed at consumed_samples builds the straight run's rows."""
    cfg, task, _ = _setup()
    layout = check_layout(load_config(DIGITS, BASE + PACKING + colocated(1)))  # all on rank 0
    args = (layout, 0, cfg.train.micro_batch_size, task.seq_length, task.stream(0).samples,
            _kwargs(task))
    straight = PackedTrainIterator(PackedMicrobatchProvider(*args), 0, 16)
    steps = [next(straight) for _ in range(3)]
    counts = []
    resumed = PackedTrainIterator(PackedMicrobatchProvider(*args), 0, 16)
    next(resumed)
    counts.append(resumed.step_samples)
    resumed = PackedTrainIterator(PackedMicrobatchProvider(*args), resumed.position, 16)
    for want in steps[1:]:
        got = next(resumed)
        counts.append(resumed.step_samples)
        for g, w in zip(got, want, strict=True):
            for name in w:
                for key in w[name]:
                    assert torch.equal(g[name][key], w[name][key]), (name, key)
    assert all(c > 16 for c in counts), f"packed steps consumed only {counts} samples"
    # Background loading (data.num_workers) reads the same rows.
    with PrefetchingReader(task.stream(0), num_workers=2) as reader:
        loaded = PackedTrainIterator(PackedMicrobatchProvider(
            layout, 0, cfg.train.micro_batch_size, task.seq_length, reader.samples,
            _kwargs(task)), 0, 16)
        for want in steps:
            got = next(loaded)
            assert all(torch.equal(g[n][k], w[n][k]) for g, w in zip(got, want, strict=True)
                       for n in w for k in w[n])
    # Real tokens: the sum of the documents' lengths, packed or padded.
    rows, batch = _packed_rows()
    lengths = sum(s["tokens"].numel() for r in rows for s in r)
    assert int(real_tokens(batch)) == lengths
    flat = [s for r in rows for s in r]
    assert int(real_tokens(collate(flat, task.seq_length, **_kwargs(task)))) == lengths
    # Unpacked, the provider is today's: no document keys.
    plain = MicrobatchProvider(*args).microbatch(0)
    assert "doc_ids" not in plain["language"]


@pytest.mark.parametrize("extra,message", [
    (["modules.language.num_experts=4"],
     r"data\.packing=True is invalid with modules\.language\.num_experts=4"),
])
def test_packing_with_an_unsupported_feature_is_a_one_line_error(extra, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(DIGITS, BASE + ["data.packing=true", *extra])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name,layout,world", [
    ("colocated-dp2", colocated(2), 2),
    # Heterogeneous: encoder DP 2 feeding a TP 2 x PP 2 language model (7 ranks).
    ("vision-dp2|audio|language-tp2pp2",
     noncolocated({"data": 2}, {}, {"tensor": 2, "pipeline": 2}), 7),
])
def test_packed_training_matches_plain_loop(name, layout, world):
    """10 packed iterations: losses, grad norms, token counts and weights (1e-4 rel)."""
    results = engine_results(PACKING + layout, NUM_ITERS, world=world)
    ref = packed_reference(PACKING, NUM_ITERS)
    assert_steps_match(results, ref)
    assert_weights_match(results, ref)


def _train_and_read_metrics(rank: int, world: int, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(DIGITS, [*BASE, *colocated(1), *overrides, f"log.dir='{tmp}'",
                                   "train.iters=2", "log.interval=1", "log.progress=false",
                                   "checkpoint.interval=0"])
        run_training(cfg, init_runtime())
        lines = next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()
    return [json.loads(x) for x in lines if "real_tokens_per_second" in json.loads(x)]


def test_loop_counts_consumed_samples_and_real_tokens():
    """A packed run's records: consumed_samples is the stream position; padding reported."""
    records = run_ranks(1, _train_and_read_metrics, ["data.packing=true"], timeout_s=300)[0]
    cfg, task, _ = _setup()
    rows, nxt = pack_rows(task.stream(cfg.train.seed).samples, 0, 16, task.seq_length)
    real = sum(s["tokens"].numel() for r in rows for s in r)
    first = records[0]
    assert first["consumed_samples"] == nxt > 16
    assert first["padding_fraction"] == pytest.approx(1 - real / (16 * task.seq_length))
    assert first["real_tokens_per_second"] == pytest.approx(
        first["tokens_per_second"] * (1 - first["padding_fraction"]))
