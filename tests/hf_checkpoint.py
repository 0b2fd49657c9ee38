"""A checkpoint written without training, for the export tests: a model as training holds
it (a decoder grown by the placeholders and padded), saved by the project's writer
(DCP, manifest, ``latest``) on one forked gloo rank.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from mimotron.checkpoint.save import _write_checkpoint
from mimotron.checkpoint.state import META, model_state
from mimotron.data.hf_tokenizer import resize_embedding_rows
from mimotron.forked_ranks import run_ranks
from mimotron.models.hf.llama import LlamaFamilySpec, build_hf_language_model
from mimotron.models.language import LanguageModel
from mimotron.models.mimo import MimoModel

ITERATION = 3
PADDED = 64  # training pads the vocabulary past the tokenizer's (a multiple for TP)


def _save(rank: int, world: int, root: Path, model: MimoModel, meta: dict[str, Any]) -> None:
    state: dict[str, Any] = model_state(model)
    state[META] = json.dumps({"iteration": ITERATION, **meta})
    _write_checkpoint(state, root, ITERATION, {"world_size": world}, None, False, None,
                      time.perf_counter())


def write_checkpoint(root: Path, model: MimoModel, meta: dict[str, Any]) -> Path:
    """``model`` saved as iteration :data:`ITERATION` of a checkpoint at ``root``."""
    run_ranks(1, _save, root, model, meta)
    return root


def grown_language(folder: Path, vocab: int) -> LanguageModel:
    """The decoder of ``folder`` as training holds it: rows up to ``vocab`` (the
    placeholders, grown by training's rule), then padding rows up to a multiple of 64."""
    loaded = build_hf_language_model(folder)
    spec = LlamaFamilySpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    padded = -(-vocab // PADDED) * PADDED
    model = LanguageModel(**spec.replace(vocab_size=padded).model_kwargs())
    state = dict(loaded.state_dict())
    for name in ("embed.weight", "output.weight"):
        if name in state:
            grown = resize_embedding_rows(state[name], vocab, seed=3)
            state[name] = torch.cat([grown, torch.zeros(padded - vocab, grown.shape[1])])
    model.load_state_dict(state)
    return model.eval()


def save_qwen2_for_tokenizer(folder: Path, seed: int, hidden_size: int, max_positions: int,
                             tied: bool) -> Path:
    """A small Qwen2 decoder saved into ``folder`` (which already holds a tokenizer) with
    ``vocab_size`` = the tokenizer's length, as a model folder ships its own tokenizer."""
    import transformers

    base = len(transformers.AutoTokenizer.from_pretrained(folder))
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=base, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=tied)
    ).save_pretrained(folder)
    return folder
