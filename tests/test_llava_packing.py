"""Sequence packing (``data.packing``) with LLaVA data: every rank packs the same rows.

A LLaVA rank loads only its modules' parts of a sample (an encoder rank no tokens, a
language rank no media), so the rows are decided from the token counts the dataset
records when it checks the file. The data here is the digits/DTMF task exported as
LLaVA JSONL + PNG + WAV with a BPE tokenizer trained on it (as in
``tests/test_llava_training.py``), toy encoders, ``seq_length = 128``: about three
conversations per row, several images and tones in a row.

The in-process tests build each rank's micro-batches of a split layout from a dataset
restricted as that rank's; the parity tests train through the engine and compare with
the independent plain loop of ``tests.reference``, fed by the independent packer of
``tests.test_packing`` (the reference's setup is pointed at this LLaVA data by a hook
defined here).
"""

from __future__ import annotations

import copy

import pytest
import torch

import tests.reference as reference
from mimotron.config import load_config
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data import collate
from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import conversation_texts, write_llava_task
from mimotron.data.packing import pack_rows
from mimotron.data.run_data import restrict_to_rank
from mimotron.forked_ranks import run_ranks
from mimotron.models.build import build_mimo_model
from mimotron.parallel.layout import check_layout
from mimotron.training.data_provider import (
    PackedMicrobatchProvider,
    PackedTrainIterator,
    stream_lengths,
)
from tests.common import BASE, DIGITS, coloc, colocated, noncolocated
from tests.hf_data import collate_kwargs, llava_setup
from tests.parity import (
    assert_steps_match,
    assert_weights_match,
    engine_results,
    records_by_iteration,
    train,
)

NUM_ITERS = 10
GBS, MBS = 8, 4  # rows per global batch / micro-batch


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides (after ``BASE``) selecting the exported task, its tokenizer and packing."""
    base = tmp_path_factory.mktemp("llava_packing")
    path = write_llava_task(base / "data", num_samples=48, seed=3)
    tokenizer = train_bpe_tokenizer(conversation_texts(path), base / "tok", vocab_size=300)
    return ["data.dataset='llava'", f"data.path='{path}'", f"data.tokenizer='{tokenizer}'",
            "data.seq_length=128", "data.packing=true", "modules.vision.in_channels=3",
            f"train.global_batch_size={GBS}", f"train.micro_batch_size={MBS}",
            f"train.iters={NUM_ITERS + 2}"]  # fmt: skip


def _rank_steps(cfg: object, task: object, layout: object, rank: int, num_steps: int,
                start: int = 0) -> tuple[list, list[int], PackedTrainIterator]:
    """``num_steps`` packed steps as ``rank`` builds them, its task restricted as the
    training loop restricts it; also the dataset indices the rank loaded."""
    task = copy.copy(task)  # restrict a private copy of the dataset, not the fixture's
    task.dataset = copy.copy(task.dataset)
    restrict_to_rank(task, cfg, layout, rank)
    loaded: list[int] = []
    load = task.dataset.load
    task.dataset.load = lambda index: loaded.append(index) or load(index)
    stream = task.stream(cfg.train.seed)
    provider = PackedMicrobatchProvider(layout, rank, MBS, task.seq_length, stream.samples,
                                        collate_kwargs(task), lengths_at=stream_lengths(stream))
    steps = PackedTrainIterator(provider, start, GBS)
    return [next(steps) for _ in range(num_steps)], loaded, steps


def test_each_rank_of_a_split_layout_builds_its_part_of_the_same_rows(llava):
    """vision DP 2 | audio | language DP 2: every rank's slices equal the same slices of
    the rows packed with every part loaded; each rank loads only its rows' samples, the
    language ranks no media and the encoder ranks no tokens."""
    overrides = llava + noncolocated({"data": 2}, {}, {"data": 2})
    cfg, _, task = llava_setup(overrides)
    layout = check_layout(cfg)
    # Every part loaded, all modules on one rank: the whole rows of every micro-batch.
    full_cfg = load_config(DIGITS, BASE + llava + colocated(1))
    (full,), _, full_iter = _rank_steps(full_cfg, task, check_layout(full_cfg), 0, 1)
    assert full_iter.position > GBS, "no row packs several conversations"
    keys = {"vision": ("image", "has_image"), "audio": ("audio", "has_audio"),
            "language": ("tokens", "labels", "loss_mask", "doc_ids", "position_ids",
                         "has_image", "has_audio")}  # fmt: skip
    for rank in range(layout.world_size):
        (step,), loaded, steps = _rank_steps(cfg, task, layout, rank, 1)
        assert steps.position == full_iter.position, f"rank {rank} packed other rows"
        role = layout.roles(rank)[0]
        lo, hi = (role.dp * MBS // 2, (role.dp + 1) * MBS // 2) if role.module in (
            "vision", "language") else (0, MBS)
        docs = 0
        for j, mb in enumerate(step):
            got, whole = mb[role.module], full[j][role.module]
            for key in keys[role.module]:
                if key.startswith("has_") or key in ("image", "audio"):
                    continue
                assert torch.equal(got[key], whole[key][lo:hi]), (rank, j, key)
            # Media [rows, K, ...]: K is the most items a row of the batch holds, so a
            # slice's own K may be smaller; the items listed in order must be the same.
            for key in ("image", "audio"):
                if f"has_{key}" in keys[role.module]:
                    mask, want = got[f"has_{key}"], whole[f"has_{key}"][lo:hi]
                    assert torch.equal(mask.sum(1), want.sum(1)), (rank, j, key)
                if key in keys[role.module]:
                    assert torch.equal(got[key][got[f"has_{key}"]],
                                       whole[key][lo:hi][whole[f"has_{key}"][lo:hi]]), (rank, j)
            docs += int((full[j]["language"]["doc_ids"][lo:hi].amax(1) + 1).sum())
        assert len(loaded) == docs, f"rank {rank} loaded {len(loaded)} samples, not {docs}"
        batch = step[0][role.module]
        if role.module == "language":
            assert batch["image"].eq(0).all() and batch["audio"].eq(0).all()
        else:
            assert batch["tokens"].eq(task.pad_id).all() and batch["doc_ids"].eq(-1).all()


def test_each_document_gets_its_own_images(llava):
    """Split vision | audio | language: the rows the encoder ranks build (media, no tokens)
    encoded and merged into the language rank's rows (tokens, no media) put at each
    document's placeholders that document's own projected image and tone."""
    overrides = llava + noncolocated({}, {}, {})
    cfg, tokenizer, task = llava_setup(overrides)
    layout = check_layout(cfg)
    mb = [_rank_steps(cfg, task, layout, rank, 1)[0][0][0] for rank in range(3)]
    vision, audio, lm_batch = mb[0]["vision"], mb[1]["audio"], mb[2]["language"]
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    torch.manual_seed(0)
    model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders).eval()
    tokens = lm_batch["tokens"]
    with torch.no_grad():
        embeds = {"vision": model.encode("vision", vision), "audio": model.encode("audio", audio)}
        present = {n: model.present_mask(n, lm_batch) for n in embeds}
        merged = model.merge_embeddings(tokens, model.language_model.embed_tokens(tokens),
                                        embeds, present)
    # Each document again, loaded whole and encoded alone (a one-sample batch).
    rows, _ = pack_rows(task.stream(cfg.train.seed).samples, 0, MBS, task.seq_length)
    checked = {"vision": [], "audio": []}
    for i, row in enumerate(rows):
        start = 0
        for doc in row:
            alone = collate([doc], task.seq_length, **collate_kwargs(task))
            span = slice(start, start + doc["tokens"].numel())
            start = span.stop
            for name, key in (("vision", "has_image"), ("audio", "has_audio")):
                if not doc[key]:
                    continue
                at = tokens[i, span] == placeholders[name]
                with torch.no_grad():
                    want = model.encode(name, alone)[0]
                torch.testing.assert_close(merged[i, span][at], want, rtol=1e-5, atol=1e-6)
                checked[name].append(want)
    for key in ("has_image", "has_audio"):
        assert int(lm_batch[key].sum(1).max()) >= 2, f"no row holds two items ({key})"
    for name, items in checked.items():
        assert len(items) >= 3, f"too few {name} documents checked"
        assert not torch.allclose(items[0], items[1]), f"{name} items do not differ"


def test_resume_mid_stream_keeps_the_rows(llava):
    """Resumed at a step's consumed samples, every rank (an encoder rank without tokens,
    the language rank without media) builds the rows of the straight run's next steps."""
    overrides = llava + noncolocated({}, {}, {})
    cfg, _, task = llava_setup(overrides)
    layout = check_layout(cfg)
    for rank in range(3):
        straight, _, it = _rank_steps(cfg, task, layout, rank, 3)
        _, _, after_one = _rank_steps(cfg, task, layout, rank, 1)
        consumed = after_one.step_samples
        assert consumed == after_one.position > GBS
        resumed, _, _ = _rank_steps(cfg, task, layout, rank, 2, start=consumed)
        for got, want in zip(resumed, straight[1:], strict=True):
            for g, w in zip(got, want, strict=True):
                assert all(torch.equal(g[n][k], w[n][k]) for n in w for k in w[n]), rank
        assert it.position > after_one.position


def test_checkpoint_resume_continues_the_packed_stream(llava, tmp_path):
    """vision | audio | language, 2 background loaders: a run saved at iteration 2 and
    resumed goes on from its consumed samples with the straight run's rows (equal
    consumed samples, loss and grad norm at iteration 3)."""
    common = [*llava, *noncolocated({}, {}, {}), "train.iters=3", "log.interval=1",
              "log.progress=false", "data.num_workers=2", "eval.interval=1000"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_ranks(3, train, [*BASE, *common, f"log.dir='{straight}'", "checkpoint.interval=2",
                         f"checkpoint.dir='{straight / 'ckpt'}'"], timeout_s=300)
    run_ranks(3, train, [*BASE, *common, f"log.dir='{resumed}'", "checkpoint.interval=0",
                         f"checkpoint.load='{straight / 'ckpt' / 'iter_0000002'}'"],
              timeout_s=300)
    want, got = records_by_iteration(straight), records_by_iteration(resumed)
    assert sorted(got) == [3]
    assert want[2]["consumed_samples"] > 2 * GBS, "the rows hold one conversation each"
    assert got[3]["consumed_samples"] == want[3]["consumed_samples"]
    for key in ("loss", "grad_norm"):
        assert got[3][key] == pytest.approx(want[3][key], rel=1e-6), key


@pytest.fixture(scope="module")
def packed_reference(llava: list[str]) -> reference.ReferenceRun:
    """The plain loop on the independently packed LLaVA rows, 10 iterations."""
    cfg, tokenizer, task = llava_setup(llava)
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    vocab = -(-tokenizer.vocab_size // reference.VOCAB_MULTIPLE) * reference.VOCAB_MULTIPLE

    def setup(overrides: object) -> tuple:  # the reference's prologue, on LLaVA data
        return cfg, task, lambda: build_mimo_model(cfg, vocab, placeholders)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "reference_setup", setup)
        return reference.reference_run(
            tuple(llava), NUM_ITERS,
            batch_at=reference.reference_packer(task, task.stream(cfg.train.seed), GBS))


@pytest.mark.parametrize("name,layout,world", [
    # Colocated: encoders DP 4 into a language model TP 2 (sequence parallel) x CP 2.
    ("colocated-vision-dp4|audio-dp4|language-tp2-sp-cp2",
     coloc({"data": 4}, {"data": 4}, {"data": 1, "tensor": 2, "context": 2})
     + ["modules.language.parallel.sequence_parallel=true"], 4),
    # Split: vision DP 2 and audio on their own ranks (no tokens loaded there) feeding a
    # language model of 2 pipeline stages.
    ("vision-dp2|audio|language-pp2", noncolocated({"data": 2}, {}, {"pipeline": 2}), 5),
])
def test_packed_llava_training_matches_plain_loop(llava, packed_reference, name, layout,
                                                   world):
    """10 packed iterations: losses, grad norms, token counts and weights (1e-4 rel)."""
    results = engine_results(llava + layout, NUM_ITERS, world=world)
    assert_steps_match(results, packed_reference)
    assert_weights_match(results, packed_reference)
