"""A prompt for a Qwen2.5-VL / Qwen3-VL model: images and videos at native resolution,
3-D positions.

With a native-resolution vision module (:mod:`mimotron.config.native_vision`) the prompt
is built as a training sample is (:mod:`mimotron.data.native_llava`): each image becomes
the model's ``<|vision_start|><|image_pad|><|vision_end|>``, its ``<|image_pad|>`` as
many copies as the image has tokens (its size through the family's processor), and the
prompt's 3-D rotary positions are computed from the tokens and the grids. Videos (a file
or a folder of frames) are sampled, patched and written as in training
(:mod:`mimotron.data.native_video`): their positions come from the true ids, then their
placeholders are read as image placeholders, where the items merge. The tower's
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
from mimotron.data.native_llava import LLAVA_IMAGE, LLAVA_VIDEO, NativeLlava
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


def _user_text(text: str, counts: dict[str, int]) -> str:
    """``text`` with a placeholder per file first (videos, then images), unless it holds
    them already."""
    marks = {"video": LLAVA_VIDEO, "image": LLAVA_IMAGE}
    found = {kind: text.count(marks[kind]) for kind in counts}
    if not any(found.values()):
        head = "".join(marks[kind] * counts[kind] for kind in ("video", "image"))
        return head + ("\n" if head else "") + text
    for kind, num in counts.items():
        if found[kind] != num:
            raise ValueError(f"--prompt holds {found[kind]} {marks[kind]} but {num} --{kind} "
                             "file(s) were given: expected one placeholder per file")
    return text


def encode_native_prompt(loaded: LoadedModel, name: str, text: str,
                         images: Sequence[str | Path], videos: Sequence[str | Path] = ()
                         ) -> NativePrompt:
    """Encode a prompt for the native-resolution vision module ``name`` (module docstring).

    Args:
        loaded: the model (one process).
        name: the vision module's name.
        text: the user's prompt.
        images: image files, any size (resized by the processor within ``max_pixels``).
        videos: video files or folders of frames (sampled and resized as in training).

    Raises:
        ValueError: more images and videos than training held, unreadable files,
            placeholders that do not match the files (one line each).
    """
    cfg, tokenizer, model = loaded.cfg, loaded.tokenizer, loaded.model
    limit = cfg.data.max_images_per_sample
    if len(images) + len(videos) > limit:
        raise ValueError(f"{len(images) + len(videos)} --image/--video files were given: at "
                         f"most {limit} per prompt (data.max_images_per_sample)")
    mod = cfg.modules[name]
    native = NativeLlava.from_folder(mod.hf_path, mod.hf_native, tokenizer)
    user = _user_text(text, {"image": len(images), "video": len(videos)})
    conversation = [{"from": "human", "value": user}, {"from": "gpt", "value": STAND_IN}]
    messages = to_messages(conversation, cfg.data.system_prompt or None)
    kinds = native.item_kinds(messages)
    grids, plans = native.header_grids(list(images)), native.video_plans(list(videos))
    messages = native.wrap_videos(native.wrap(messages), plans)
    # One placeholder id per image, then each expanded to its tokens (as the data check).
    encoded = native.expand(encode_conversation(tokenizer, messages, {"image": 1}),
                            native.tokens_of(grids), plans)
    prompt = prompt_of(tokenizer, encoded)
    true = torch.tensor(prompt.tokens)
    # The items' [K, ...] keys in text order; no text given, so no positions made twice:
    # they come below with the rope_deltas generation needs.
    keys = native.sample_keys(true[:0], grids, max(limit, 2), plans, kinds)
    positions, deltas = native.positions(true, grids, plans)
    positions = positions.unsqueeze(1)  # [3, 1, length]
    tokens = native.image_placeholders(true)[None]  # every item at an image placeholder
    device = loaded.device
    hidden = model.language_model.embed_tokens(tokens.to(device))
    visual: dict[str, Any] = {}
    if images or videos:
        num = len(images) + len(videos)
        batch = {"image": native.load_items(list(images), grids, list(videos), plans, kinds
                                            ).to(device)[None],
                 "image_grid": keys["image_grid"][None, :num],
                 "image_tokens": keys["image_tokens"][None, :num],
                 "has_image": torch.ones(1, num, dtype=torch.bool), "tokens": tokens}
        embeds, counts, visual = native_embeddings(model, batch, {name: model.encode(name, batch)},
                                                   hidden.shape[-1])
        hidden = model.merge_embeddings(tokens.to(device), hidden, embeds,
                                        {name: batch["has_image"]}, host_tokens=tokens,
                                        counts=counts)
    return NativePrompt(prompt, hidden, {"position_ids": positions.to(device), **visual},
                        deltas.to(device))
