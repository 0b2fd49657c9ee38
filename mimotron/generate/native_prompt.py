"""A prompt for a Qwen2.5-VL / Qwen3-VL model: images at native resolution, 3-D positions.

With a native-resolution vision module (:mod:`mimotron.config.native_vision`) the prompt
is built as a training sample is (:mod:`mimotron.data.native_llava`): each image becomes
the model's ``<|vision_start|><|image_pad|><|vision_end|>``, its ``<|image_pad|>`` as
many copies as the image has tokens (its size through the family's processor), and the
prompt's 3-D rotary positions are computed from the tokens and the grids. The tower's
slot blocks are cut to the real rows and merged as in training
(:func:`~mimotron.models.native_vision.native_embeddings`); the prompt's forward gets the
positions (and Qwen3-VL's DeepStack features), and every generated token after it takes
the text position :func:`~mimotron.data.mrope_positions.decode_positions` gives, from
the prompt's ``rope_deltas`` (as ``transformers``' ``generate`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mimotron.data.chat import encode_conversation, to_messages
from mimotron.data.mrope_positions import mrope_positions
from mimotron.data.native_llava import LLAVA_IMAGE, NativeLlava
from mimotron.generate.prompt import STAND_IN, Prompt, prompt_of
from mimotron.generate.source import LoadedModel
from mimotron.models.native_vision import native_embeddings

__all__ = ["NativePrompt", "encode_native_prompt"]


@dataclass(frozen=True)
class NativePrompt:
    """What the prompt's forward needs, and what the tokens after it need.

    Attributes:
        prompt: its tokens and stop ids.
        hidden: ``[1, length, hidden]`` input embeddings, images merged.
        forward_args: the language model's ``position_ids`` (``[3, 1, length]``) and any
            DeepStack arguments.
        rope_deltas: ``[1, 1]``: a generated token's position minus its cache position.
    """

    prompt: Prompt
    hidden: torch.Tensor
    forward_args: dict[str, Any]
    rope_deltas: torch.Tensor


def _user_text(text: str, num_images: int) -> str:
    """``text`` with an ``<image>`` per image first, unless it holds them already."""
    found = text.count(LLAVA_IMAGE)
    if found == 0:
        return LLAVA_IMAGE * num_images + ("\n" if num_images else "") + text
    if found != num_images:
        raise ValueError(f"--prompt holds {found} {LLAVA_IMAGE} but {num_images} --image "
                         "file(s) were given: expected one placeholder per file")
    return text


def encode_native_prompt(loaded: LoadedModel, name: str, text: str,
                         images: Sequence[str | Path]) -> NativePrompt:
    """Encode a prompt for the native-resolution vision module ``name`` (module docstring).

    Args:
        loaded: the model (one process).
        name: the vision module's name.
        text: the user's prompt.
        images: image files, any size (resized by the processor within ``max_pixels``).

    Raises:
        ValueError: more images than training held, unreadable files, placeholders that
            do not match the files (one line each).
    """
    cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
    limit = cfg.data.max_images_per_sample
    if len(images) > limit:
        raise ValueError(f"{len(images)} --image files were given: at most {limit} per prompt "
                         "(data.max_images_per_sample)")
    mod = cfg.modules[name]
    native = NativeLlava.from_folder(mod.hf_path, mod.hf_native, tokenizer)
    conversation = [{"from": "human", "value": _user_text(text, len(images))},
                    {"from": "gpt", "value": STAND_IN}]
    messages = native.wrap(to_messages(conversation, cfg.data.system_prompt or None))
    grids = native.header_grids(list(images))
    # One placeholder id per image, then each expanded to its tokens (as the data check).
    encoded = native.expand(encode_conversation(tokenizer, messages, {"image": 1}),
                            native.tokens_of(grids))
    prompt = prompt_of(tokenizer, encoded)
    device = loaded.device
    tokens = torch.tensor([prompt.tokens])
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    positions, deltas = mrope_positions(tokens, native.rule, grid if len(grids) else None)
    lm = model.language_model
    hidden = lm.embed_tokens(tokens.to(device))
    visual: dict[str, Any] = {}
    if images:
        several = limit > 1
        batch = {"image": native.load_images(list(images), grids).to(device),
                 "image_grid": grid, "image_tokens": torch.tensor(native.tokens_of(grids)),
                 "has_image": torch.ones(len(grids), dtype=torch.bool), "tokens": tokens}
        batch = {k: v.unsqueeze(0) if several and k != "tokens" else v for k, v in batch.items()}
        embeds, counts, visual = native_embeddings(model, batch, {name: model.encode(name, batch)},
                                                   hidden.shape[-1])
        hidden = model.merge_embeddings(tokens.to(device), hidden, embeds,
                                        {name: batch["has_image"]}, host_tokens=tokens,
                                        counts=counts)
    return NativePrompt(prompt, hidden, {"position_ids": positions.to(device), **visual},
                        deltas.to(device))
