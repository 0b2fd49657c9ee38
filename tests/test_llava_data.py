"""LLaVA-format data: samples, preprocessing equal to transformers, bad samples, workers.

Images, WAVs, the JSONL file and the BPE tokenizer are generated into a temporary folder
(tests/hf_data.py); reference preprocessing comes from ``transformers``' own CLIP /
SigLIP image processors and Whisper feature extractor, built from config dicts.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil, WhisperFeatureExtractor

from mimotron.data.collate import collate
from mimotron.data.llava import LlavaDataset, LlavaTask, llava_tasks
from mimotron.data.media import ImageProcessor, read_wav
from mimotron.data.prefetch import PrefetchingReader
from tests.hf_data import (
    CLIP_CONFIG,
    WHISPER_KWARGS,
    llava_dataset,
    llava_env,
    tone,
    write_jsonl,
    write_png,
    write_wav,
)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("llava"))


def test_samples_hold_tokens_labels_and_preprocessed_media(env, tmp_path):
    data = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", env["samples"]))
    tok = env["tokenizer"]
    assert len(data) == 4 and data.num_skipped == 0
    assert data.image_shape == (3, 16, 16) and data.audio_shape == (16, 100)
    kinds = [data.load(i)["kind"] for i in range(4)]
    assert kinds == ["image", "audio", "both", "text"]
    for i, raw in enumerate(env["samples"]):
        sample = data.load(i)
        tokens = sample["tokens"].tolist()
        assert tokens.count(tok.placeholder_id("image")) == (4 if "image" in raw else 0)
        assert tokens.count(tok.placeholder_id("audio")) == (3 if "audio" in raw else 0)
        # The trained positions predict exactly the replies and their <|im_end|>.
        predicted = sample["labels"][sample["loss_mask"].bool()].tolist()
        replies = [t["value"] + "<|im_end|>" for t in raw["conversations"] if t["from"] == "gpt"]
        assert tok.decode(predicted) == "".join(replies)
        assert sample["sample_id"] == raw["id"] and sample["answer"] == raw["conversations"][-1][
            "value"]
    batch = collate([data.load(i) for i in range(4)], 96, data.pad_id, data.image_shape,
                    data.audio_shape)  # fmt: skip
    assert batch["has_image"].tolist() == [True, False, True, False]
    assert batch["has_audio"].tolist() == [False, True, True, False]


@pytest.mark.parametrize("parts", [("image",), ("audio",), ("text",), ("text", "image")])
def test_restricted_loading_keeps_presence_and_loads_only_its_parts(env, tmp_path, parts):
    path = write_jsonl(tmp_path / "d.jsonl", env["samples"])
    full, part = llava_dataset(env, path), llava_dataset(env, path)
    part.restrict_loading(parts)
    args = (96, full.pad_id, full.image_shape, full.audio_shape)
    whole = collate([full.load(i) for i in range(4)], *args)
    cut = collate([part.load(i) for i in range(4)], *args)
    for key in ("has_image", "has_audio", "index"):
        assert torch.equal(cut[key], whole[key]), key
    for key in ("tokens", "labels", "loss_mask"):  # text or nothing (padding only)
        assert torch.equal(cut[key], whole[key] if "text" in parts else torch.zeros_like(
            whole[key])), key
    for key in ("image", "audio"):
        assert torch.equal(cut[key], whole[key] if key in parts else torch.zeros_like(
            whole[key])), key
    assert [part.load(i)["kind"] for i in range(4)] == ["image", "audio", "both", "text"]
    with pytest.raises(ValueError, match=r"parts \['video'\] are invalid"):
        part.restrict_loading(["text", "video"])


def test_pixels_equal_transformers_clip_processor(env, tmp_path):
    from PIL import Image

    data = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", env["samples"]))
    reference = CLIPImageProcessorPil(**CLIP_CONFIG)
    for index, name in ((0, "a.png"), (2, "b.png")):  # RGB; RGBA composited onto white
        expected = reference(Image.open(env["root"] / "img" / name), return_tensors="np")
        assert torch.equal(data.load(index)["image"],
                           torch.from_numpy(expected["pixel_values"][0]))  # fmt: skip


@pytest.mark.parametrize(("shape", "mode"), [((40, 25), "RGB"), ((9, 13), "L"),
                                             ((30, 30), "RGBA")])  # fmt: skip
def test_pixels_equal_transformers_siglip_processor(tmp_path, shape, mode):
    from PIL import Image

    path = write_png(tmp_path / "x.png", *shape, seed=5, mode=mode)
    reference = SiglipImageProcessorPil(size={"height": 28, "width": 28})
    ours = ImageProcessor.from_dict(reference.to_dict())
    expected = reference(Image.open(path), return_tensors="np")["pixel_values"][0]
    assert ours.output_shape == (3, 28, 28)
    assert torch.equal(ours(Image.open(path)), torch.from_numpy(expected))


def test_log_mel_equals_whisper_feature_extractor(env, tmp_path):
    data = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", env["samples"]))
    reference = WhisperFeatureExtractor(**WHISPER_KWARGS)
    for index, name in ((1, "a.wav"), (2, "b.wav")):  # shorter and longer than 1 s
        with open(env["root"] / "wav" / name, "rb") as f:
            pcm = np.frombuffer(f.read()[44:], dtype="<i2")  # after the 44-byte header
        expected = reference(pcm.astype(np.float32) / 32768, sampling_rate=16000,
                             return_tensors="np")["input_features"][0]  # fmt: skip
        assert torch.equal(data.load(index)["audio"], torch.from_numpy(expected))


def test_stereo_wav_is_averaged_to_mono(tmp_path):
    left, right = tone(0.2, 16000, 300.0, seed=1), tone(0.2, 16000, 500.0, seed=2)
    path = write_wav(tmp_path / "s.wav", np.stack([left, right], axis=1).reshape(-1), channels=2)
    samples, rate = read_wav(path)
    assert rate == 16000
    expected = (left.astype(np.float64) + right.astype(np.float64)) / 2 / 32768
    assert np.array_equal(samples, expected.astype(np.float32))


def bad_cases(root):
    """(name, sample or raw line, error pattern) of each kind of bad sample."""
    write_png(root / "img" / "ok.png", 20, 20, seed=9)
    (root / "img" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    write_wav(root / "wav" / "8k.wav", tone(0.3, 8000, 440.0, seed=1), rate=8000)
    human, gpt = {"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "seven"}
    return [
        ("missing_file", {"id": "b", "image": "img/nope.png", "conversations": [human, gpt]},
         "image file .*nope.png' not found"),
        ("unreadable_image", {"id": "b", "image": "img/broken.png",
                              "conversations": [human, gpt]}, "is unreadable"),
        ("placeholder_count", {"id": "b", "conversations": [human, gpt]},
         r"1 <image> placeholder\(s\) .* but 0 image file"),
        ("two_placeholders", {"id": "b", "image": "img/ok.png", "conversations": [
            {"from": "human", "value": "<image><image>"}, gpt]}, "2 <image> placeholder"),
        ("unknown_role", {"id": "b", "image": "img/ok.png", "conversations": [
            human, {"from": "bot", "value": "x"}]}, "from='bot' is invalid"),
        ("no_assistant", {"id": "b", "image": "img/ok.png", "conversations": [human]},
         "no assistant"),
        ("sample_rate", {"id": "b", "audio": "wav/8k.wav", "conversations": [
            {"from": "human", "value": "<audio>"}, gpt]}, "sampled at 8000 Hz: expected 16000"),
        ("too_long", {"id": "b", "conversations": [
            {"from": "human", "value": "seven " * 80}, gpt]}, "more than data.seq_length=96"),
        ("no_conversations", {"id": "b", "image": "img/ok.png"}, "'conversations' is missing"),
        ("broken_json", '{"id": "b", "conversations": [', "not valid JSON"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(10))
def test_bad_sample_is_an_error_naming_id_and_line_or_is_skipped_and_counted(env, tmp_path,
                                                                             case):  # fmt: skip
    name, bad, pattern = bad_cases(env["root"])[case]
    path = write_jsonl(tmp_path / f"{name}.jsonl", [*env["samples"][:2], bad,
                                                    env["samples"][3]])  # fmt: skip
    sample_id = "None" if name == "broken_json" else "'b'"
    with pytest.raises(ValueError, match=rf"{name}.jsonl line 3 \(sample id {sample_id}\): "
                                         rf".*{pattern}"):  # fmt: skip
        llava_dataset(env, path)
    skipping = llava_dataset(env, path, skip_bad_samples=True, num_workers=2)
    assert skipping.num_skipped == 1 and len(skipping) == 3
    assert skipping.bad_samples[0].location == "line 3"
    assert [skipping.load(i)["sample_id"] for i in range(3)] == ["s0", "s1", "s3"]


def test_json_list_file_names_the_item_and_modality_without_encoder(env, tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(env["samples"]))
    assert len(llava_dataset(env, path)) == 4
    no_audio = {"seq_length": 96, "num_tokens": {"image": 4}, "audio_features": None}
    with pytest.raises(ValueError, match=r"d.json item 1 \(sample id 's1'\): .*no audio encoder"):
        llava_dataset(env, path, **no_audio)
    assert llava_dataset(env, path, skip_bad_samples=True, **no_audio).num_skipped == 2


def test_every_sample_bad_is_an_error_even_when_skipping(env, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["not json", "[1"])
    with pytest.raises(ValueError, match="no usable sample"):
        llava_dataset(env, path, skip_bad_samples=True)


def test_sample_order_does_not_depend_on_the_number_of_workers(env, tmp_path):
    # 20 samples (image, audio, both and text), each with its own id.
    samples = [{**s, "id": f"{s['id']}-{k}"} for k in range(5) for s in env["samples"]]
    data = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", samples))
    train, _ = llava_tasks(data, train_fraction=0.75)

    def read(num_workers):
        out = []
        with PrefetchingReader(train.stream(seed=3), num_workers=num_workers, depth=3) as r:
            # Micro-batch slices as a rank reads them (stride 4), then a jump (a resume)
            # and an overlapping request the reader did not predict.
            for start, count in [(0, 2), (4, 2), (8, 2), (12, 2), (40, 3), (41, 5)]:
                out.extend(r.samples(start, count))
        return out

    reference = read(0)
    assert len({s["sample_id"] for s in reference}) > 10  # 15 train samples, 3 epochs
    for num_workers in (1, 3):
        other = read(num_workers)
        assert [s["index"] for s in other] == [s["index"] for s in reference]
        for a, b in zip(reference, other, strict=True):
            for key in ("tokens", "labels", "loss_mask", "image", "audio"):
                assert (a[key] is None and b[key] is None) or torch.equal(a[key], b[key])


def test_splits_are_fixed_and_disjoint(env, tmp_path):
    data = llava_dataset(env, write_jsonl(tmp_path / "d.jsonl", env["samples"] * 3))
    train, validation = llava_tasks(data, train_fraction=0.75)
    assert (len(train), len(validation)) == (9, 3)
    assert not set(train.indices.tolist()) & set(validation.indices.tolist())
    again, _ = llava_tasks(data, train_fraction=0.75)
    assert train.indices.tolist() == again.indices.tolist()
    assert torch.equal(train.get(2)["tokens"], data.load(int(train.indices[2]))["tokens"])


def test_file_broken_after_the_check_is_an_error_naming_the_sample(env, tmp_path):
    root = tmp_path / "root"
    write_png(root / "img" / "a.png", 20, 20, seed=1)
    raw = {"id": "late", "image": "img/a.png", "conversations": env["samples"][0][
        "conversations"]}  # fmt: skip
    data = LlavaDataset(write_jsonl(tmp_path / "d.jsonl", [raw]), root, env["tokenizer"], 96,
                        {"image": 4}, image_processor=env["images"])  # fmt: skip
    (root / "img" / "a.png").unlink()
    error = r"line 1 \(sample id 'late'\): failed to load"
    with PrefetchingReader(data_stream(data), num_workers=2) as reader, \
            pytest.raises(ValueError, match=error):
        reader.samples(0, 1)


def data_stream(data):
    """A stream over every sample of ``data`` in file order."""
    return LlavaTask(data, range(len(data))).stream(seed=0, shuffle=False)
