"""Where each module's tensors sit in a vision-language folder (LLaVA), both ways.

A LLaVA folder (:mod:`mimotron.config.hf_vlm`) holds three parts in one set of
safetensors, under one of two layouts:

=================  ==================================  ======================================
part               the llava-hf hub layout             the layout transformers 4.52-4.57 saved
=================  ==================================  ======================================
vision tower       ``vision_tower.vision_model.*``     ``model.vision_tower.vision_model.*``
projector          ``multi_modal_projector.*``         ``model.multi_modal_projector.*``
decoder            ``language_model.model.*``          ``model.language_model.*``
output head        ``language_model.lm_head.*``        ``lm_head.*``
=================  ==================================  ======================================

transformers 5 reads both and writes the hub layout, except that its CLIP / SigLIP
towers have no ``vision_model`` level (``vision_tower.embeddings.*``): a tower is found
with or without it. :func:`part_weight_map` turns a
family's :class:`~mimotron.models.hf.weights.WeightMap` (CLIP / SigLIP for the tower,
Llama for the decoder) into the map of its part of such a folder: the same rules under
the part's prefix, and every other part's tensors ignored rather than "unexpected". So
the one loader (:func:`~mimotron.models.hf.weights.load_hf_weights`), its checks and the
export read a module's part of the folder exactly as they read a folder of its own.
:data:`LLAVA_PROJECTOR_WEIGHTS` maps the projector, which in a LLaVA folder is trained
and loaded (a two-folder run initialises its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from mimotron.config.hf_vlm import is_native_config, is_vlm_config
from mimotron.models.hf.llama import holds_moved_decoder, qwen_vl_weight_map, under_language_model
from mimotron.models.hf.weights import WeightMap

__all__ = ["LLAVA_PROJECTOR_WEIGHTS", "part_weight_map", "projector_weight_map"]

_TOWER, _PROJECTOR, _LANGUAGE = r"(model\.)?vision_tower\.", r"(model\.)?multi_modal_projector\.", \
    r"(model\.)?language_model\."
_HEAD = r"lm_head\."

LLAVA_PROJECTOR_WEIGHTS = WeightMap(
    rules=(("fc1.", "linear_1."), ("fc2.", "linear_2.")),
    prefixes=("multi_modal_projector.", "model.multi_modal_projector."),
    ignored=(_TOWER, _LANGUAGE, _HEAD),
)
"""mimotron's projector (``Linear -> GELU -> Linear``) <-> LLaVA's ``multi_modal_projector``."""


def _language_maps(base: WeightMap) -> tuple[WeightMap, WeightMap]:
    """The decoder's map in the hub layout and in the ``model.language_model.`` one."""
    hub = dataclasses.replace(base, prefixes=("language_model.",), ignored=(
        *(r"language_model\." + p for p in base.ignored), _TOWER, _PROJECTOR))
    return hub, under_language_model(base, (*base.ignored, _TOWER, _PROJECTOR))


def part_weight_map(base: WeightMap, config: dict[str, Any], kind: str,
                    names: Iterable[str]) -> WeightMap:
    """The map of a module's part of a folder: ``base`` for a folder of its own.

    Args:
        base: the family's map (the tower's or the decoder's).
        config: the folder's parsed ``config.json`` (the whole of it, not the part).
        kind: the module's kind (``vit`` or ``language``).
        names: the folder's tensor names, read for a vision-language folder's decoder only
            (to tell its two layouts apart).

    Returns:
        A map whose names are the folder's.
    """
    if not is_vlm_config(config):
        return base
    if is_native_config(config):  # Qwen-VL: the tower's map reads the folder's names
        return base if kind == "vit" else qwen_vl_weight_map(names)
    if kind == "vit":
        # The family's own ignored parts (SigLIP's pooling head) sit under the tower.
        return dataclasses.replace(
            base, prefixes=("vision_tower.vision_model.", "vision_tower.",
                            "model.vision_tower.vision_model.", "model.vision_tower."),
            ignored=(*(_TOWER + p for p in base.ignored), _PROJECTOR, _LANGUAGE, _HEAD))
    assert kind == "language", kind
    hub, flat = _language_maps(base)
    return flat if holds_moved_decoder(names) else hub


def projector_weight_map(config: dict[str, Any]) -> WeightMap | None:
    """The projector's map in a folder, or ``None`` where the folder holds none (a tower
    folder of its own: the projector is mimotron's, initialised by the run)."""
    return (LLAVA_PROJECTOR_WEIGHTS if is_vlm_config(config) and not is_native_config(config)
            else None)
