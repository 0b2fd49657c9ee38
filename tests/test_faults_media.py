"""Faults in LLaVA data: media corrupt past the header, paths out of the root, bad bytes.

Each test builds its files in ``tmp_path`` (tests/hf_data.py: PNG/WAV/JSONL writers and a
locally trained tokenizer); nothing is downloaded.

* Media that decode badly past a valid header (a WAV cut to an odd byte count, a stereo
  WAV cut mid-frame, a truncated JPEG) are bad samples at the check, so
  ``skip_bad_samples`` skips them instead of letting the run die when they load; a file
  that breaks after the check is skipped and counted when loaded (or named, one line).
* Media paths must resolve inside ``data.root`` (``..``, absolute paths, symlinks out)
  unless ``allow_outside_root``.
* A data line that is not UTF-8 names its file and line and is skippable; a BOM is not
  an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mimotron.config.schema import DataConfig
from mimotron.data.llava import LlavaDataset
from tests.hf_data import (
    llava_dataset,
    llava_env,
    tone,
    write_jsonl,
    write_png,
    write_wav,
)

IMAGE_TURNS = [{"from": "human", "value": "<image> what digit is in this picture"},
               {"from": "gpt", "value": "the digit is seven"}]  # fmt: skip
AUDIO_TURNS = [{"from": "human", "value": "listen to the tone <audio>"},
               {"from": "gpt", "value": "the answer is nine"}]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Tokenizer, preprocessing and a media root holding the four good samples' files."""
    return llava_env(tmp_path_factory.mktemp("faults_media"))


dataset = llava_dataset


def with_bad_third(env, path: Path, bad: dict | str) -> Path:
    """Samples s0, s1, ``bad`` (line 3), s3 as JSONL."""
    samples = env["samples"]
    return write_jsonl(path, [samples[0], samples[1], bad, samples[3]])


# ---- 1. media corrupt past the header --------------------------------------------------
def _odd_wav(root: Path) -> Path:
    path = write_wav(root / "wav" / "odd.wav", tone(0.5, 16000, 440.0, seed=7))
    path.write_bytes(path.read_bytes()[:-1])  # the last sample cut in half
    return path


def _stereo_cut(root: Path) -> Path:
    pcm = tone(0.5, 16000, 440.0, seed=8)
    path = write_wav(root / "wav" / "stereo.wav", np.stack([pcm, pcm], 1).reshape(-1),
                     channels=2)  # fmt: skip
    path.write_bytes(path.read_bytes()[:-2])  # a left sample without its right one
    return path


def _cut_jpeg(root: Path) -> Path:
    from PIL import Image

    path = root / "img" / "cut.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # header intact, half the scan data
    return path


CORRUPT = {"odd_wav": (_odd_wav, "audio"), "stereo_mid_frame": (_stereo_cut, "audio"),
           "truncated_jpeg": (_cut_jpeg, "image")}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CORRUPT))
def test_media_corrupt_past_the_header_is_a_bad_sample_at_the_check(env, tmp_path, name):
    make, modality = CORRUPT[name]
    root = env["root"]
    file = make(root)
    bad = {"id": "bad", modality: str(file.relative_to(root)),
           "conversations": IMAGE_TURNS if modality == "image" else AUDIO_TURNS}  # fmt: skip
    path = with_bad_third(env, tmp_path / "d.jsonl", bad)
    with pytest.raises(ValueError, match=r"d.jsonl line 3 \(sample id 'bad'\): .*"
                                         + file.name) as info:  # fmt: skip
        dataset(env, path)
    assert "\n" not in str(info.value)
    skipping = dataset(env, path, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 3
    # Every kept sample loads: the run can no longer die on this file.
    assert [skipping.load(i)["sample_id"] for i in range(3)] == ["s0", "s1", "s3"]


def _break_after_check(env, tmp_path, skip: bool) -> tuple[LlavaDataset, Path]:
    root = tmp_path / "root"
    image = write_png(root / "img" / "late.png", 24, 24, seed=4)
    samples = [{"id": "ok", "conversations": env["samples"][3]["conversations"]},
               {"id": "late", "image": "img/late.png", "conversations": IMAGE_TURNS}]
    data = dataset(env, write_jsonl(tmp_path / "d.jsonl", samples), root=root,
                   skip_bad_samples=skip)  # fmt: skip
    image.write_bytes(image.read_bytes()[:40])  # broken after the check
    return data, image


def test_file_broken_after_the_check_is_skipped_and_counted_when_skipping(env, tmp_path):
    data, image = _break_after_check(env, tmp_path, skip=True)
    assert data.num_skipped == 0
    sample = data.load(1)
    # Same shape and presence as the real sample (the batch and every rank's transfers
    # stay the same), but nothing of it is trained.
    assert sample["has_image"] and sample["image"].shape == data.image_shape
    assert not sample["image"].any() and not sample["loss_mask"].any()
    assert data.num_skipped == 1 and data.load_failures[0].location == "line 2"
    assert "late.png" in data.load_failures[0].reason
    assert data.load(0)["loss_mask"].any()  # other samples are untouched


def test_file_broken_after_the_check_is_one_line_naming_it_when_not_skipping(env, tmp_path):
    data, image = _break_after_check(env, tmp_path, skip=False)
    with pytest.raises(ValueError) as info:
        data.load(1)
    message = str(info.value)
    assert "\n" not in message
    assert all(s in message for s in ("d.jsonl", "line 2", "'late'", str(image)))


# ---- 2. paths outside data.root ---------------------------------------------------------
def _outside(env) -> Path:
    return write_png(env["base"] / "outside" / "secret.png", 20, 20, seed=11)


def _dotdot(env, root: Path) -> str:
    return os.path.relpath(_outside(env), root)


def _absolute(env, root: Path) -> str:
    return str(_outside(env))


def _symlink(env, root: Path) -> str:
    link = root / "img" / "link.png"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(_outside(env))
    return "img/link.png"


OUTSIDE = {"dotdot": _dotdot, "absolute": _absolute, "symlink": _symlink}


@pytest.mark.parametrize("name", sorted(OUTSIDE))
def test_media_outside_the_root_is_a_bad_sample_unless_allowed(env, tmp_path, name):
    root = tmp_path / "root"
    (root / "img").mkdir(parents=True)
    media = OUTSIDE[name](env, root)
    samples = [{"id": "ok", "conversations": env["samples"][3]["conversations"]},
               {"id": "out", "image": media, "conversations": IMAGE_TURNS}]
    path = write_jsonl(tmp_path / "d.jsonl", samples)
    with pytest.raises(ValueError, match=r"d.jsonl line 2 \(sample id 'out'\): .*"
                       + r"outside data.root.*data.allow_outside_root") as info:  # fmt: skip
        dataset(env, path, root=root)
    assert media in str(info.value) and "\n" not in str(info.value)
    skipping = dataset(env, path, root=root, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 1
    allowed = dataset(env, path, root=root, allow_outside_root=True)
    assert len(allowed) == 2 and allowed.load(1)["image"].shape == allowed.image_shape


def test_symlink_inside_the_root_and_dotdot_back_in_are_accepted(env, tmp_path):
    root = tmp_path / "root"
    write_png(root / "img" / "a.png", 20, 20, seed=2)
    (root / "alias.png").symlink_to(root / "img" / "a.png")
    samples = [{"id": "link", "image": "alias.png", "conversations": IMAGE_TURNS},
               {"id": "back", "image": "img/../img/a.png", "conversations": IMAGE_TURNS}]
    assert len(dataset(env, write_jsonl(tmp_path / "d.jsonl", samples), root=root)) == 2


def test_allow_outside_root_is_a_config_key_defaulting_to_false():
    assert DataConfig().allow_outside_root is False


# ---- 3. bytes that are not UTF-8 ---------------------------------------------------------
def _lines(env) -> list[bytes]:
    return [json.dumps(s).encode() for s in env["samples"]]


def test_non_utf8_line_names_file_and_line_and_is_skippable(env, tmp_path):
    lines = _lines(env)
    lines[2] = lines[2].replace(b"seven plus three", b"seven \xff\xfe three")
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=r"latin.jsonl line 3 \(sample id None\): "
                                         r".*not valid UTF-8"):  # fmt: skip
        dataset(env, path)
    skipping = dataset(env, path, skip_bad_samples=True)
    assert skipping.num_skipped == 1 and len(skipping) == 3
    assert [skipping.load(i)["sample_id"] for i in range(3)] == ["s0", "s1", "s3"]


def test_non_utf8_item_of_a_json_list_names_the_item_and_is_skippable(env, tmp_path):
    text = json.dumps(env["samples"]).encode()
    path = tmp_path / "latin.json"
    path.write_bytes(text.replace(b"seven plus three", b"seven \xe9 three"))
    with pytest.raises(ValueError, match=r"latin.json item 2 .*not valid UTF-8"):
        dataset(env, path)
    assert dataset(env, path, skip_bad_samples=True).num_skipped == 1


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_utf8_bom_at_the_start_is_accepted(env, tmp_path, kind):
    path = tmp_path / f"bom.{kind}"
    body = b"\n".join(_lines(env)) if kind == "jsonl" else json.dumps(env["samples"]).encode()
    path.write_bytes(b"\xef\xbb\xbf" + body + b"\n")
    data = dataset(env, path)
    assert len(data) == 4 and data.num_skipped == 0
    assert torch.equal(data.load(0)["tokens"], dataset(env, write_jsonl(
        tmp_path / "plain.jsonl", env["samples"])).load(0)["tokens"])  # fmt: skip
