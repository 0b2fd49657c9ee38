"""The files of ``make demo-llava``: LLaVA data, Hugging Face model folders, a tokenizer.

``python -m mimotron.demo.llava_assets OUT_DIR`` writes, deterministically (the same
arguments give the same bytes), everything a user with real checkpoints has on disk:

* ``data/data.jsonl`` with ``data/images/*.png`` and ``data/audio/*.wav``: the
  digits/DTMF task in LLaVA format (:func:`~mimotron.data.digits_llava.write_llava_task`);
  ``configs/digits_llava.toml`` splits it into train and validation
  (``data.train_fraction``);
* ``tokenizer/``: a byte-level BPE tokenizer with a ChatML template, trained locally
  (:func:`~mimotron.data.bpe.train_bpe_tokenizer`) on a fixed corpus of the task's
  sentences, so it does not depend on how many samples are written;
* ``models/vision``: a small CLIP vision tower (``CLIPVisionModel`` + its
  ``preprocessor_config.json``), ``models/audio``: a small Whisper model (+ its feature
  extractor config; only the encoder is used), ``models/language``: a small Qwen2
  decoder (``Qwen2ForCausalLM``) whose vocabulary is the tokenizer's with the
  ``<image>`` / ``<audio>`` placeholders. All are randomly initialised by
  ``transformers`` from a fixed seed and written with ``save_pretrained``.

A marker file (:data:`MARKER`) holding the generation arguments is written last: a
folder with a matching marker is complete and is left as it is; otherwise everything is
(re)written. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mimotron.data.bpe import train_bpe_tokenizer
from mimotron.data.digits_llava import PROMPTS, write_llava_task
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.tokenizer import number_to_words

FORMAT = 2
"""Version of what is written; a folder written by another version is rewritten."""
MARKER = "assets.complete.json"
"""Written last; holds the generation arguments (a complete, matching folder is kept)."""
DEFAULT_DIR = "runs/digits_llava/assets"
NUM_SAMPLES = 8000
"""Samples of the demo's data file (train + validation)."""
SEED = 1234
VOCAB_SIZE = 512
"""Upper bound of the BPE vocabulary (256 byte symbols + 3 ChatML specials + merges); the
corpus runs out of merges at 370, when every word of the task is one token."""

# The towers' input: 8x8 digit images (RGB after preprocessing), 16 kHz WAV tones of
# 0.12 s padded by Whisper's feature extraction to a 1 s chunk: 128 frames of 80 mel bins
# (hop 125 samples = 7.8 ms), so the tone fills the first ~16 frames.
IMAGE_SIZE = 8
WHISPER_FEATURES: dict[str, Any] = {"feature_size": 80, "sampling_rate": 16000,
                                    "hop_length": 125, "chunk_length": 1, "n_fft": 512}
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def corpus() -> list[str]:
    """The tokenizer's training sentences: every prompt and answer the task can hold."""

    words = [number_to_words(n) for n in range(19)]
    sums = [f"{words[a]} plus {words[b]} is {words[a + b]}" for a in range(10) for b in range(10)]
    return [*PROMPTS.values(), *words, *sums]


def _save_vision(folder: Path) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    CLIPVisionModel(CLIPVisionConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_channels=3, image_size=IMAGE_SIZE, patch_size=2)).save_pretrained(folder)
    # What CLIPImageProcessor.save_pretrained writes (without its torchvision warning):
    # bicubic resize to 8x8 (the PNGs already are), no crop, CLIP's mean and std.
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor = {"image_processor_type": "CLIPImageProcessor", "do_resize": True,
                 "size": size, "resample": 3, "do_center_crop": False, "crop_size": size,
                 "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
                 "do_convert_rgb": True}  # fmt: skip
    text = json.dumps(processor, indent=2, sort_keys=True) + "\n"
    (folder / "preprocessor_config.json").write_text(text)


def _save_audio(folder: Path) -> None:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel

    frames = WHISPER_FEATURES["chunk_length"] * WHISPER_FEATURES["sampling_rate"] // (
        WHISPER_FEATURES["hop_length"])
    # Whisper's decoder is saved (a real Whisper folder has one) but never built.
    # init_std 0.2, not transformers' 0.02: with 0.02 the random convolutions leave the
    # tone at ~1e-5 of the output's energy (the sinusoidal positions dominate), and the
    # demo does not learn to hear the key within its 10 minutes.
    WhisperModel(WhisperConfig(
        d_model=64, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=256,
        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
        num_mel_bins=WHISPER_FEATURES["feature_size"], max_source_positions=frames // 2,
        max_target_positions=16, vocab_size=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, init_std=0.2)).save_pretrained(folder)
    WhisperFeatureExtractor(**WHISPER_FEATURES).save_pretrained(folder)


def _save_language(folder: Path, vocab_size: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False)).save_pretrained(folder)


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None


def write_llava_assets(out_dir: str | Path, num_samples: int = NUM_SAMPLES, seed: int = SEED,
                       vocab_size: int = VOCAB_SIZE) -> bool:  # fmt: skip
    """Write the demo's data, tokenizer and model folders under ``out_dir``.

    Args:
        out_dir: the assets folder (created).
        num_samples: samples of ``data/data.jsonl`` (>= 2: both splits non-empty).
        seed: the data's seed and the models' ``torch.manual_seed``.
        vocab_size: the BPE vocabulary size (>= 259).

    Returns:
        ``True`` if the files were written, ``False`` if a complete folder with the same
        arguments was already there.

    Raises:
        ValueError: ``num_samples`` below 2, or what the writers raise (a bad vocabulary).
    """
    import torch
    from transformers.utils import logging as hf_logging

    if num_samples < 2:
        raise ValueError(f"num_samples={num_samples!r} is invalid: expected an integer >= 2")
    out = Path(out_dir)
    wanted = {"format": FORMAT, "num_samples": num_samples, "seed": seed,
              "vocab_size": vocab_size}
    if _read_marker(out) == wanted:
        return False
    (out / MARKER).unlink(missing_ok=True)  # incomplete until written again
    write_llava_task(out / "data", num_samples, seed)
    tokenizer = train_bpe_tokenizer(corpus(), out / "tokenizer", vocab_size=vocab_size)
    # The decoder's vocabulary covers the placeholders mimotron adds to the tokenizer.
    lm_vocab = HFTokenizer(tokenizer).vocab_size
    hf_logging.disable_progress_bar()  # save_pretrained's one-shard bars are noise here
    torch.manual_seed(seed)
    _save_vision(out / "models" / "vision")
    _save_audio(out / "models" / "audio")
    _save_language(out / "models" / "language", lm_vocab)
    (out / MARKER).write_text(json.dumps(wanted, sort_keys=True) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m mimotron.demo.llava_assets [OUT_DIR] [--num-samples N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m mimotron.demo.llava_assets",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_DIR)
    parser.add_argument("--num-samples", type=int, default=NUM_SAMPLES)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        wrote = write_llava_assets(args.out_dir, args.num_samples, args.seed, args.vocab_size)
    except ValueError as exc:
        print(f"llava_assets: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if wrote else 'kept the complete'} demo assets in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
