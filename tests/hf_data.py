"""Builders for the Hugging Face data tests: a local BPE tokenizer, PNGs, WAVs, JSONL.

Everything is generated on the spot (nothing is downloaded): the tokenizer is trained
with ``tokenizers`` on a few sentences, images are random pixels saved by PIL, audio is
a tone written with the standard library's ``wave``.
"""

from __future__ import annotations

import contextlib
import json
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from mimotron.config import load_config
from mimotron.data.bpe import CHATML_TEMPLATE, train_bpe_tokenizer
from mimotron.data.llava import LlavaDataset
from mimotron.data.llava_check import SampleChecker
from mimotron.data.run_data import build_llava_tasks, build_tokenizer
from tests.common import BASE, DIGITS

SENTENCES = [
    "what digit is in this picture", "the digit is seven", "listen to the tone",
    "seven plus three is ten", "describe the image in one word", "a cat sits on a mat",
    "which key was pressed", "the answer is nine", "you are a helpful assistant",
] * 4  # fmt: skip

# A small CLIP-style preprocessing: shortest edge 20, center crop 16.
CLIP_CONFIG: dict[str, Any] = {
    "image_processor_type": "CLIPImageProcessor", "do_resize": True,
    "size": {"shortest_edge": 20}, "do_center_crop": True,
    "crop_size": {"height": 16, "width": 16}, "resample": 3, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
}  # fmt: skip

# A small Whisper front end: 16 mel bins, 1 s clips at 16 kHz -> [16, 100].
WHISPER_KWARGS: dict[str, Any] = {"feature_size": 16, "sampling_rate": 16000,
                                  "hop_length": 160, "chunk_length": 1, "n_fft": 400}

NUM_TOKENS = {"image": 4, "audio": 3}


def make_tokenizer(folder: Path, chat_template: str = CHATML_TEMPLATE) -> Path:
    """Train the test tokenizer into ``folder``."""
    return train_bpe_tokenizer(SENTENCES, folder, vocab_size=320, chat_template=chat_template)


def write_png(path: Path, height: int, width: int, seed: int, mode: str = "RGB") -> Path:
    """Random pixels as a PNG of ``mode`` (``RGB``, ``RGBA`` or ``L``)."""
    from PIL import Image

    channels = {"RGB": (3,), "RGBA": (4,), "L": ()}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, *channels),
                                                   dtype=np.uint8)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, mode=mode).save(path)
    return path


def tone(seconds: float, rate: int, freq: float, seed: int) -> np.ndarray:
    """A tone with a little noise, int16."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.05
    return (np.clip(0.5 * np.sin(2 * np.pi * freq * t) + noise, -1, 1) * 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000, channels: int = 1) -> Path:
    """16-bit PCM WAV of interleaved ``samples``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.astype("<i2").tobytes())
    return path


def write_jsonl(path: Path, samples: list[Any]) -> Path:
    """One JSON value per line (a ``str`` is written verbatim: a broken line)."""
    lines = [s if isinstance(s, str) else json.dumps(s) for s in samples]
    path.write_text("\n".join(lines) + "\n")
    return path


def good_samples(root: Path) -> list[dict[str, Any]]:
    """Four samples (image, audio, both, text) with their files written under ``root``."""
    write_png(root / "img" / "a.png", 24, 32, seed=1)
    write_png(root / "img" / "b.png", 30, 18, seed=2, mode="RGBA")
    write_wav(root / "wav" / "a.wav", tone(0.5, 16000, 440.0, seed=3))
    write_wav(root / "wav" / "b.wav", tone(1.5, 16000, 880.0, seed=4))  # cut to 1 s
    return [
        {"id": "s0", "image": "img/a.png", "conversations": [
            {"from": "human", "value": "<image>\nwhat digit is in this picture"},
            {"from": "gpt", "value": "the digit is seven"}]},
        {"id": "s1", "audio": "wav/a.wav", "conversations": [
            {"from": "human", "value": "listen to the tone <audio>"},
            {"from": "gpt", "value": "the answer is nine"},
            {"from": "human", "value": "which key was pressed"},
            {"from": "gpt", "value": "nine"}]},
        {"id": "s2", "image": ["img/b.png"], "audio": "wav/b.wav", "conversations": [
            {"from": "human", "value": "<image> <audio> seven plus three"},
            {"from": "gpt", "value": "seven plus three is ten"}]},
        {"id": "s3", "conversations": [
            {"from": "system", "value": "you are a helpful assistant"},
            {"from": "human", "value": "describe a cat"},
            {"from": "gpt", "value": "a cat sits on a mat"}]},
    ]  # fmt: skip


def folder_tensors(folder: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face folder (single or sharded safetensors), by name."""
    from safetensors import safe_open

    from mimotron.config.hf_folder import tensor_files

    out = {}
    for name, file in tensor_files(folder).items():
        with safe_open(file, framework="pt") as handle:
            out[name] = handle.get_tensor(name)
    return out


def llava_env(base: Path) -> dict[str, Any]:
    """Tokenizer, image processor, audio features and a media root with the four good
    samples' files, built under ``base`` (the LLaVA data tests' shared fixture)."""
    from transformers import WhisperFeatureExtractor

    from mimotron.data.hf_tokenizer import HFTokenizer
    from mimotron.data.media import AudioFeatures, ImageProcessor

    clip_dir = base / "clip"
    clip_dir.mkdir()
    (clip_dir / "preprocessor_config.json").write_text(json.dumps(CLIP_CONFIG))
    whisper_dir = base / "whisper"
    WhisperFeatureExtractor(**WHISPER_KWARGS).save_pretrained(str(whisper_dir))
    root = base / "data"
    return {"tokenizer": HFTokenizer(make_tokenizer(base / "tok")),
            "images": ImageProcessor.from_pretrained(clip_dir),
            "audio": AudioFeatures(whisper_dir), "root": root,
            "samples": good_samples(root), "base": base}  # fmt: skip


def llava_dataset(env: dict[str, Any], path: Path, index_dir: Path | None = None,
                  root: Path | None = None, **kwargs: Any) -> LlavaDataset:
    """A :class:`LlavaDataset` of ``path`` with :func:`llava_env`'s tokenizer, processors and
    media root (or ``root``); ``index_dir`` keeps its index (default: beside the file)."""
    args = {"seq_length": 96, "num_tokens": NUM_TOKENS, "image_processor": env["images"],
            "audio_features": env["audio"], "index_dir": index_dir} | kwargs  # fmt: skip
    return LlavaDataset(path, root or env["root"], env["tokenizer"], **args)


@contextlib.contextmanager
def counting_checks() -> Iterator[list[str]]:
    """The locations of the samples checked while the block runs."""
    checked: list[str] = []
    original = SampleChecker.check_many

    def spy(self: SampleChecker, items: Any, num_workers: int = 0) -> Any:
        checked.extend(item.location for item in items)
        return original(self, items, num_workers)

    with mock.patch.object(SampleChecker, "check_many", spy):
        yield checked


def llava_setup(overrides: list[str]) -> tuple[Any, Any, Any]:
    """Config, tokenizer and the train task (every part loaded) of ``BASE + overrides``
    on ``configs/digits.toml``."""
    cfg = load_config(DIGITS, BASE + overrides)
    tokenizer = build_tokenizer(cfg)
    task, _ = build_llava_tasks(cfg, tokenizer)
    return cfg, tokenizer, task


def collate_kwargs(task: Any) -> dict[str, Any]:
    """``collate``'s padding and media shapes of a task."""
    return {"pad_id": task.pad_id, "image_shape": task.image_shape,
            "audio_shape": task.audio_shape}
