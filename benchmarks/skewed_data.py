"""A skewed vision-language data set on disk, for the balancing benchmark.

What real multimodal data looks like to a native-resolution tower: a third of the
samples are text only, and an image's side is drawn from a Pareto law (shape 1.2), so
most images leave the tower with a few tokens and a few with a hundred or more (its
tokens squared, what full attention costs, are more skewed still). Written as LLaVA
JSONL with PNG digits and a toy Qwen2.5-VL folder (:mod:`mimotron.demo.qwen_assets`),
deterministic, nothing downloaded.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mimotron.data.bpe import CHATML_SPECIALS, train_bpe_tokenizer
from mimotron.demo.qwen_assets import VISION_TOKENS, corpus, save_model, write_data

__all__ = ["MAX_SIDE", "write_skewed_assets"]

MAX_SIDE = 96
"""The largest image side in pixels (144 tokens, 576 patch rows at patch 4, merge 2)."""
_UNIT = 8  # pixels per merged token side
_P_TEXT = 1 / 3
_PARETO_SHAPE = 1.2
_SALT = 0x736B6577


def _side(rng: np.random.Generator) -> int:
    """An image side: ``8 * ceil(Pareto(1.2))`` pixels, at most :data:`MAX_SIDE`."""
    units = math.ceil(float(rng.pareto(_PARETO_SHAPE)) + 1.0)
    return _UNIT * min(units, MAX_SIDE // _UNIT)


def write_skewed_assets(out_dir: Path, num_samples: int, seed: int = 1234) -> dict[str, Path]:
    """Write the data and a toy Qwen2.5-VL folder taking images up to :data:`MAX_SIDE`.

    Returns:
        ``{"data": the JSONL file, "model": the model folder}``.
    """
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    data = write_data(out_dir / "data", num_samples, seed, p_text=_P_TEXT, side=_side,
                      salt=_SALT, prefix="skewed")
    specials = (*CHATML_SPECIALS[:-1], *VISION_TOKENS, CHATML_SPECIALS[-1])
    folder = train_bpe_tokenizer(corpus(), out_dir / "model", vocab_size=512,
                                 special_tokens=specials)
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    # A tower heavier than the demo's (4 layers of 128), so vision is a real share of a step.
    save_model(folder, AutoTokenizer.from_pretrained(folder), max_side=MAX_SIDE,
               vision={"depth": 4, "hidden_size": 128, "intermediate_size": 256})
    return {"data": data, "model": folder}
