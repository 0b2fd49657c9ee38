"""The files of ``make demo-qwen``: one tiny Qwen2.5-VL folder and digits of several sizes.

``python -m mimotron.demo.qwen_assets OUT_DIR`` writes, deterministically (the same
arguments give the same bytes), what a user fine-tuning Qwen2.5-VL has on disk:

* ``data/data.jsonl`` with ``data/images/*.png``: the digits task in LLaVA format, each
  digit image upscaled to one of :data:`SIDES` pixels, so the images of a batch leave the
  tower with 1 to 16 tokens each (native resolution); a fifth of the samples are
  text-only sums;
* ``model/``: a ``Qwen2_5_VLForConditionalGeneration`` at toy sizes, randomly
  initialised by ``transformers`` from a fixed seed and written with ``save_pretrained``,
  with its ``preprocessor_config.json`` (patch 4, merge 2: one token per 8 x 8 pixels)
  and a byte-level BPE tokenizer trained locally on the task's sentences, holding
  Qwen's vision tokens (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``,
  ``<|video_pad|>``) whose ids ``config.json`` names.

A marker file (:data:`MARKER`) holding the generation arguments is written last: a
folder with a matching marker is complete and is left as it is. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mimotron.data.bpe import CHATML_SPECIALS, train_bpe_tokenizer
from mimotron.data.digits import load_digit_images, sample_rng
from mimotron.data.tokenizer import number_to_words

FORMAT = 1
MARKER = "assets.complete.json"
DEFAULT_DIR = "runs/digits_qwen/assets"
NUM_SAMPLES = 6000
SEED = 1234
VOCAB_SIZE = 512
SIDES = (8, 16, 24, 32)
"""Image sides in pixels: 1, 4, 9 and 16 tokens at patch 4, merge 2."""
PATCH, MERGE, TEMPORAL = 4, 2, 2
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PROMPT = "<image>\nwhich digit is this"
_SALT = 0x7177656E
_P_TEXT = 0.2


def corpus() -> list[str]:
    """The tokenizer's training sentences: every prompt and answer the task can hold."""
    words = [number_to_words(n) for n in range(19)]
    sums = [f"{words[a]} plus {words[b]}" for a in range(10) for b in range(10)]
    return [PROMPT.split("\n")[1], *words, *sums]


def _write_png(path: Path, image: np.ndarray, side: int) -> None:
    from PIL import Image  # Deferred: only writing media needs PIL.

    pixels = np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8)
    Image.fromarray(pixels, mode="L").resize((side, side), Image.Resampling.NEAREST).save(path)


def _demo_side(rng: np.random.Generator) -> int:
    return SIDES[int(rng.integers(len(SIDES)))]


def write_data(out: Path, num_samples: int, seed: int, *, p_text: float = _P_TEXT,
               side: Callable[[np.random.Generator], int] = _demo_side, salt: int = _SALT,
               prefix: str = "digits") -> Path:
    """The LLaVA-format digits file: text-only sums (a share ``p_text``) and digit images
    whose side in pixels ``side`` draws (the demo's: one of :data:`SIDES`); each sample's
    draws come from ``(seed, salt, index)``."""
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, labels = load_digit_images()
    pixels, digits = images[:, 0].numpy(), labels.numpy()
    lines = []
    for index in range(num_samples):
        rng = sample_rng(seed, salt, index)
        record: dict[str, Any] = {"id": f"{prefix}-{index:06d}"}
        if rng.random() < p_text:
            a, b = (int(v) for v in rng.integers(0, 10, 2))
            human, answer = f"{number_to_words(a)} plus {number_to_words(b)}", number_to_words(
                a + b)
        else:
            pick = int(rng.integers(len(digits)))
            record["image"] = f"images/{index:06d}.png"
            _write_png(out / record["image"], pixels[pick], side(rng))
            human, answer = PROMPT, number_to_words(int(digits[pick]))
        record["conversations"] = [{"from": "human", "value": human},
                                   {"from": "gpt", "value": answer}]
        lines.append(json.dumps(record))
    path = out / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def save_model(folder: Path, tokenizer: Any, max_side: int = max(SIDES),
               vision: dict[str, Any] | None = None) -> None:
    """The toy Qwen2.5-VL folder and its processor (images up to ``max_side`` pixels
    square), written with ``save_pretrained`` beside ``tokenizer``; ``vision`` overrides
    keys of the tower's config."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 384,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "tie_word_embeddings": False,
            "bos_token_id": tokenizer.convert_tokens_to_ids(CHATML_SPECIALS[0]),
            "eos_token_id": tokenizer.convert_tokens_to_ids(CHATML_SPECIALS[-1]),
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                "mrope_section": [4, 6, 6]}}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
              "out_hidden_size": 128, "patch_size": PATCH, "spatial_merge_size": MERGE,
              "temporal_patch_size": TEMPORAL, "window_size": 16,
              "fullatt_block_indexes": [1], **(vision or {})}
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    transformers.Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
        min_pixels=(PATCH * MERGE) ** 2, max_pixels=max_side ** 2).save_pretrained(folder)


def write_qwen_assets(out_dir: str | Path, num_samples: int = NUM_SAMPLES, seed: int = SEED,
                      vocab_size: int = VOCAB_SIZE) -> bool:
    """Write the demo's data and model folder under ``out_dir``.

    Returns:
        ``True`` if the files were written, ``False`` if a complete folder with the same
        arguments was already there.

    Raises:
        ValueError: ``num_samples`` below 2.
    """
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    if num_samples < 2:
        raise ValueError(f"num_samples={num_samples!r} is invalid: expected an integer >= 2")
    out = Path(out_dir)
    wanted = {"format": FORMAT, "num_samples": num_samples, "seed": seed,
              "vocab_size": vocab_size}
    try:
        if json.loads((out / MARKER).read_text()) == wanted:
            return False
    except (OSError, ValueError):
        pass
    (out / MARKER).unlink(missing_ok=True)  # incomplete until written again
    write_data(out / "data", num_samples, seed)
    specials = (*CHATML_SPECIALS[:-1], *VISION_TOKENS, CHATML_SPECIALS[-1])
    folder = train_bpe_tokenizer(corpus(), out / "model", vocab_size=vocab_size,
                                 special_tokens=specials)
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    save_model(folder, AutoTokenizer.from_pretrained(folder))
    (out / MARKER).write_text(json.dumps(wanted, sort_keys=True) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m mimotron.demo.qwen_assets [OUT_DIR] [--num-samples N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m mimotron.demo.qwen_assets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=DEFAULT_DIR)
    parser.add_argument("--num-samples", type=int, default=NUM_SAMPLES)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    try:
        wrote = write_qwen_assets(args.out_dir, args.num_samples, args.seed)
    except ValueError as exc:
        print(f"qwen_assets: {exc}", file=sys.stderr)
        return 2
    print(f"{'wrote' if wrote else 'kept the complete'} demo assets in {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
