"""Data layer: tokenizer, digits/DTMF task, sample stream, mock task, collation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mimotron.config import MimoConfig, config_from_dict, validate_config
from mimotron.data import (
    NUMBER_WORDS,
    CharTokenizer,
    DigitsTask,
    MockTask,
    SampleStream,
    build_datasets,
    collate,
    dtmf_frequencies,
    dtmf_tone,
    load_digit_images,
    number_to_words,
    slice_batch,
    spectrogram,
    split_ids,
    split_microbatches,
)
from mimotron.data.dtmf import N_FFT, SAMPLE_RATE, dtmf_tones, peak_frequency_bins

TOK = CharTokenizer()
IMAGE, AUDIO = TOK.placeholder_id("image"), TOK.placeholder_id("audio")


@pytest.fixture(scope="module")
def train_task() -> DigitsTask:
    return DigitsTask(TOK, seq_length=64, seed=1234, split="train")


@pytest.fixture(scope="module")
def validation_task() -> DigitsTask:
    return DigitsTask(TOK, seq_length=64, seed=1234, split="validation")


def _config(**modules: dict) -> MimoConfig:
    raw = {"modules": {**modules, "language": {"kind": "language"}}, "data": {"seq_length": 64}}
    return validate_config(config_from_dict(raw))


def _assert_same_sample(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


# ---- tokenizer ---------------------------------------------------------------------------
def test_tokenizer_round_trip_and_layout():
    text = "seven plus three is ten="
    assert TOK.decode(TOK.encode(text)) == text
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id, IMAGE, AUDIO) == (0, 1, 2, 3, 4)
    assert TOK.vocab_size == 33
    # decode skips specials and placeholders and stops at <eos>.
    ids = [TOK.bos_id, IMAGE, AUDIO, *TOK.encode("two"), TOK.eos_id, *TOK.encode("x")]
    assert TOK.decode(ids) == "two"
    assert TOK.decode(torch.tensor(ids).tolist()) == "two"


def test_tokenizer_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="'image', 'audio'"):
        TOK.placeholder_id("video")
    with pytest.raises(ValueError, match="'7'"):
        TOK.encode("7 plus")


def test_number_words():
    assert [number_to_words(n) for n in (0, 10, 18)] == ["zero", "ten", "eighteen"]
    with pytest.raises(ValueError, match=r"\[0, 18\]"):
        number_to_words(19)


# ---- digits task -------------------------------------------------------------------------
def test_split_sizes_disjoint_and_seed_independent(train_task, validation_task):
    assert (len(train_task), len(validation_task)) == (1438, 359)
    train, val = split_ids(1797, 0.8, "train"), split_ids(1797, 0.8, "validation")
    assert len(set(train.tolist()) & set(val.tolist())) == 0
    assert sorted(train.tolist() + val.tolist()) == list(range(1797))
    other_seed = DigitsTask(TOK, seq_length=64, seed=7, split="validation")
    assert torch.equal(other_seed._images, validation_task._images)


def test_placeholders_match_modalities_and_all_kinds_appear(train_task):
    kinds = set()
    for sample in train_task.get_many([(i, 0) for i in range(300)]):
        tokens = sample["tokens"]
        kinds.add(sample["kind"])
        assert int((tokens == IMAGE).sum()) == (16 if sample["image"] is not None else 0)
        assert int((tokens == AUDIO).sum()) == (4 if sample["audio"] is not None else 0)
        assert sample["kind"] in ("text",) or sample["image"] is not None or (
            sample["audio"] is not None
        )
        if sample["image"] is not None:
            assert sample["image"].shape == (1, 8, 8) and sample["image"].dtype == torch.float32
        if sample["audio"] is not None:
            assert sample["audio"].shape == (129, 16) and sample["audio"].dtype == torch.float32
    assert kinds == {"image", "audio", "both", "text"}


def test_custom_placeholder_counts():
    task = DigitsTask(TOK, 64, 0, num_image_tokens=4, num_audio_tokens=2)
    sample = next(s for s in task.get_many([(i, 0) for i in range(50)]) if s["kind"] == "both")
    assert int((sample["tokens"] == IMAGE).sum()) == 4
    assert int((sample["tokens"] == AUDIO).sum()) == 2


def test_loss_mask_covers_exactly_answer_and_eos(train_task):
    for sample in train_task.get_many([(i, 3) for i in range(100)]):
        tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
        assert torch.equal(labels[:-1], tokens[1:]) and labels[-1] == TOK.pad_id
        target = TOK.encode(sample["answer"]) + [TOK.eos_id]
        assert labels[mask == 1].tolist() == target
        positions = torch.nonzero(mask).flatten().tolist()
        # Contiguous, ending at the position that predicts <eos> (one before the last).
        assert positions == list(range(len(tokens) - 1 - len(target), len(tokens) - 1))
        assert set(mask.unique().tolist()) <= {0.0, 1.0}
        assert TOK.decode(tokens.tolist()).endswith(sample["answer"])


def test_answers_are_right(train_task):
    _, labels = load_digit_images()
    ids = split_ids(1797, 0.8, "train")
    value = {word: n for n, word in enumerate(NUMBER_WORDS)}
    for sample in train_task.get_many([(i, 0) for i in range(200)]):
        text = TOK.decode(sample["tokens"].tolist())
        if sample["kind"] == "image":
            assert sample["answer"] == number_to_words(int(labels[ids[sample["index"]]]))
        elif sample["kind"] == "both":
            a, _, b, _, total = sample["answer"].split(" ")
            assert value[a] + value[b] == value[total]
        elif sample["kind"] == "text":
            question, answer = text.split("=")
            a, _, b = question.split(" ")
            assert number_to_words(value[a] + value[b]) == answer == sample["answer"]


def test_determinism_and_epoch_augmentation(train_task):
    fresh = DigitsTask(TOK, seq_length=64, seed=1234, split="train")
    for index in (0, 5, 1437):
        _assert_same_sample(train_task.get(index, epoch=2), fresh.get(index, epoch=2))
    # Another epoch re-draws kind, shift and tone: most samples change.
    changed = 0
    for index in range(20):
        a, b = train_task.get(index, 0), train_task.get(index, 1)
        same_image = (a["image"] is None) == (b["image"] is None) and (
            a["image"] is None or torch.equal(a["image"], b["image"])
        )
        same_audio = (a["audio"] is None) == (b["audio"] is None) and (
            a["audio"] is None or torch.equal(a["audio"], b["audio"])
        )
        changed += not (same_image and same_audio and a["answer"] == b["answer"])
    assert changed >= 15
    # A different seed gives different samples.
    other = DigitsTask(TOK, seq_length=64, seed=1, split="train")
    assert any(other.get(i)["answer"] != train_task.get(i)["answer"] for i in range(10))


def test_batched_generation_equals_single_samples(train_task):
    items = [(i, i % 3) for i in range(0, 200, 7)]
    batched = train_task.get_many(items)
    for (index, epoch), sample in zip(items, batched, strict=True):
        _assert_same_sample(sample, train_task.get(index, epoch))


def test_validation_is_fixed_and_unshifted(validation_task):
    images, _ = load_digit_images()
    ids = split_ids(1797, 0.8, "validation")
    for index in range(40):
        sample = validation_task.get(index, epoch=9)
        _assert_same_sample(sample, validation_task.get(index, epoch=0))
        if sample["image"] is not None:
            assert torch.equal(sample["image"], images[ids[index]])


def _shifted(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Reference shift via roll + zeroing the wrapped rows/columns."""
    out = torch.roll(image, shifts=(dy, dx), dims=(-2, -1))
    if dy:
        out[..., (0 if dy > 0 else -1), :] = 0
    if dx:
        out[..., :, (0 if dx > 0 else -1)] = 0
    return out


def test_train_images_are_shifted_by_at_most_one_pixel(train_task):
    images, _ = load_digit_images()
    ids = split_ids(1797, 0.8, "train")
    shifted = 0
    for sample in train_task.get_many([(i, 0) for i in range(100)]):
        if sample["image"] is None:
            continue
        original = images[ids[sample["index"]]]
        matches = [
            torch.equal(sample["image"], _shifted(original, dy, dx))
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
        ]
        assert any(matches)
        shifted += not torch.equal(sample["image"], original)
    assert shifted > 0


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="seq_length=40"):
        DigitsTask(TOK, seq_length=40, seed=0)
    with pytest.raises(ValueError, match="split='test'"):
        DigitsTask(TOK, seq_length=64, seed=0, split="test")
    with pytest.raises(ValueError, match="p_image"):
        DigitsTask(TOK, seq_length=64, seed=0, p_image=-1.0)
    with pytest.raises(ValueError, match="index=1438"):
        DigitsTask(TOK, seq_length=64, seed=0).get(1438)


# ---- sample stream -----------------------------------------------------------------------
def test_sample_stream_epochs_are_permutations(train_task):
    stream = SampleStream(train_task, seed=1234)
    num = len(train_task)
    epoch0 = [index for index, epoch in stream.items(0, num) if epoch == 0]
    epoch1 = [index for index, _ in stream.items(num, num)]
    assert sorted(epoch0) == list(range(num)) and sorted(epoch1) == list(range(num))
    assert epoch0 != epoch1 and epoch0 != list(range(num))
    assert {epoch for _, epoch in stream.items(num - 1, 2)} == {0, 1}
    unshuffled = SampleStream(train_task, seed=1234, shuffle=False)
    assert [index for index, _ in unshuffled.items(num - 2, 4)] == [num - 2, num - 1, 0, 1]


def test_sample_stream_reads_compose_and_resume(train_task):
    stream = SampleStream(train_task, seed=5, num_cached_epochs=1)
    start, count = len(train_task) - 20, 48  # straddles an epoch boundary
    whole = stream.samples(start, count)
    parts = stream.samples(start, 13) + stream.samples(start + 13, 35)
    resumed = SampleStream(train_task, seed=5).samples(start + 30, 18)
    for a, b in zip(whole, parts, strict=True):
        _assert_same_sample(a, b)
    for a, b in zip(whole[30:], resumed, strict=True):
        _assert_same_sample(a, b)


# ---- DTMF --------------------------------------------------------------------------------
def test_dtmf_keypad():
    assert dtmf_frequencies(0) == (941.0, 1336.0)
    assert dtmf_frequencies(1) == (697.0, 1209.0)
    assert dtmf_frequencies(9) == (852.0, 1477.0)
    with pytest.raises(ValueError, match="digit=10"):
        dtmf_frequencies(10)


@pytest.mark.parametrize("digit", range(10))
def test_spectrogram_peaks_at_the_digit_frequencies(digit):
    low_hz, high_hz = dtmf_frequencies(digit)
    bin_hz = SAMPLE_RATE / N_FFT
    for seed in range(5):
        wave = dtmf_tone(digit, np.random.default_rng(seed))
        assert wave.shape == (960,)
        spec = spectrogram(wave)
        assert spec.shape == (129, 16) and spec.dtype == torch.float32
        low, high = peak_frequency_bins(spec)
        assert abs(low - low_hz / bin_hz) <= 1 and abs(high - high_hz / bin_hz) <= 1


def test_spectrogram_matches_torch_stft_and_is_batch_invariant():
    waves = dtmf_tones([1, 5, 0], [np.random.default_rng(s) for s in range(3)])
    reference = torch.stft(
        torch.from_numpy(waves), N_FFT, 64, window=torch.hann_window(N_FFT, dtype=torch.float64),
        center=True, return_complex=True,
    ).abs().log1p()  # fmt: skip
    spec = spectrogram(waves)
    from mimotron.data.dtmf import SPEC_MEAN, SPEC_STD

    torch.testing.assert_close(spec, ((reference - SPEC_MEAN) / SPEC_STD).float())
    for row in range(3):
        assert torch.equal(spectrogram(waves[row]), spec[row])
    # Fixed normalisation puts typical features near zero mean and unit scale.
    many = spectrogram(dtmf_tones([d % 10 for d in range(200)],
                                  [np.random.default_rng(s) for s in range(200)]))  # fmt: skip
    assert abs(float(many.mean())) < 0.3 and 0.7 < float(many.std()) < 1.3


def test_dtmf_accepts_torch_generator():
    a = dtmf_tone(3, torch.Generator().manual_seed(4))
    b = dtmf_tone(3, torch.Generator().manual_seed(4))
    assert np.array_equal(a, b)


# ---- collate -----------------------------------------------------------------------------
def test_collate_shapes_and_padding(train_task):
    samples = train_task.get_many([(i, 0) for i in range(8)])
    batch = collate(samples, seq_length=64)
    assert batch["tokens"].shape == (8, 64) and batch["tokens"].dtype == torch.long
    assert batch["labels"].shape == (8, 64) and batch["loss_mask"].dtype == torch.float32
    assert batch["image"].shape == (8, 1, 8, 8) and batch["audio"].shape == (8, 129, 16)
    assert batch["has_image"].dtype == torch.bool and batch["index"].tolist() == list(range(8))
    for row, sample in enumerate(samples):
        length = len(sample["tokens"])
        assert torch.equal(batch["tokens"][row, :length], sample["tokens"])
        assert (batch["tokens"][row, length:] == TOK.pad_id).all()
        assert (batch["labels"][row, length:] == TOK.pad_id).all()
        assert (batch["loss_mask"][row, length:] == 0).all()
        assert bool(batch["has_image"][row]) == (sample["image"] is not None)
        assert bool(batch["has_audio"][row]) == (sample["audio"] is not None)
        if sample["image"] is None:
            assert (batch["image"][row] == 0).all()
        if sample["audio"] is not None:
            assert torch.equal(batch["audio"][row], sample["audio"])
    with pytest.raises(ValueError, match="seq_length=20"):
        collate(samples, seq_length=20)


def test_slice_batch_and_microbatches(train_task):
    batch = collate(train_task.get_many([(i, 0) for i in range(12)]), seq_length=64)
    part = slice_batch(batch, 4, 10)
    assert part.keys() == batch.keys()
    for key, tensor in part.items():
        assert tensor.shape[0] == 6 and torch.equal(tensor, batch[key][4:10])
    micro = split_microbatches(batch, 4)
    assert [m["index"].tolist() for m in micro] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="micro_batch_size=5"):
        split_microbatches(batch, 5)
    with pytest.raises(ValueError, match="slice"):
        slice_batch(batch, 3, 13)


# ---- mock --------------------------------------------------------------------------------
def test_mock_task_is_deterministic_and_well_formed():
    task = MockTask(TOK, seq_length=40, seed=3, num_samples=32)
    again = MockTask(TOK, seq_length=40, seed=3, num_samples=32)
    kinds = set()
    for index in range(32):
        sample = task.get(index, epoch=1)
        _assert_same_sample(sample, again.get(index, epoch=1))
        kinds.add(sample["kind"])
        tokens = sample["tokens"]
        assert len(tokens) <= 40
        assert int((tokens == IMAGE).sum()) == (16 if sample["image"] is not None else 0)
        assert int((tokens == AUDIO).sum()) == (4 if sample["audio"] is not None else 0)
        assert sample["labels"][sample["loss_mask"] == 1][-1] == TOK.eos_id
    assert kinds == {"image", "audio", "both", "text"}
    assert any(
        not torch.equal(task.get(i, 0)["tokens"], task.get(i, 1)["tokens"]) for i in range(8)
    )
    batch = collate(task.get_many([(i, 0) for i in range(8)]), seq_length=40)
    assert batch["tokens"].shape == (8, 40)
    by_vocab = MockTask(64, seq_length=40, seed=3, num_samples=4, image_shape=(3, 4, 4))
    sample = next(s for s in by_vocab.get_many([(i, 0) for i in range(4)]) if s["kind"] != "text")
    assert int(sample["tokens"].max()) < 64


# ---- build_datasets ----------------------------------------------------------------------
def test_default_config_samples_fit_seq_length_64():
    cfg = _config(vision={"kind": "vit"}, audio={"kind": "audio"})
    train, validation = build_datasets(cfg, TOK)
    assert (len(train), len(validation)) == (1438, 359)
    assert train.max_sample_length <= 64 and validation.max_sample_length <= 64
    for task in (train, validation):
        samples = task.get_many([(i, 0) for i in range(len(task))])
        assert max(len(s["tokens"]) for s in samples) <= 64


def test_missing_encoder_modalities_are_never_produced():
    cfg = _config(vision={"kind": "vit", "patch_size": 4})
    train, _ = build_datasets(cfg, TOK)
    samples = train.get_many([(i, 0) for i in range(200)])
    assert all(s["audio"] is None and (s["tokens"] == AUDIO).sum() == 0 for s in samples)
    assert {s["kind"] for s in samples} == {"image", "text"}
    assert all((s["tokens"] == IMAGE).sum() in (0, 4) for s in samples)
    text_only, _ = build_datasets(_config(), TOK)
    assert {s["kind"] for s in text_only.get_many([(i, 0) for i in range(50)])} == {"text"}


def test_build_mock_datasets_and_digit_shape_check():
    cfg = _config(vision={"kind": "vit", "image_size": 16, "patch_size": 4, "in_channels": 3})
    with pytest.raises(ValueError, match="modules.vision"):
        build_datasets(cfg, TOK)
    cfg.data.dataset = "mock"
    train, validation = build_datasets(cfg, TOK)
    assert (len(train), len(validation)) == (205, 51)
    sample = next(s for s in train.get_many([(i, 0) for i in range(20)]) if s["image"] is not None)
    assert sample["image"].shape == (3, 16, 16) and sample["audio"] is None


def test_task_stream_helper(train_task):
    mock = MockTask(TOK, seq_length=40, seed=3, num_samples=10)
    for task in (train_task, mock):
        a = task.stream(9).samples(5, 12)
        b = SampleStream(task, 9).samples(5, 12)
        for x, y in zip(a, b, strict=True):
            _assert_same_sample(x, y)


def test_digit_images_are_scikit_learns_digits_read_without_importing_it():
    """The bundled file is read directly (importing sklearn cost every rank ~3 s)."""
    from sklearn.datasets import load_digits

    images, labels = load_digit_images()
    want = load_digits()
    assert torch.equal(images, torch.from_numpy(want.images.astype(np.float32) / 16.0)[:, None])
    assert torch.equal(labels, torch.from_numpy(want.target.astype(np.int64)))
