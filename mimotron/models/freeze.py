"""Freezing by part: which parameters ``modules.<m>.freeze`` stops training.

``freeze = true`` stops every parameter of the module. ``freeze = "encoder"`` (encoders
only) stops the *tower*, the ``encoder`` child of
:class:`~mimotron.models.encoders.ModalitySubmodule` (the ViT, the audio encoder, a
CLIP / SigLIP / Whisper tower), and leaves the ``projector`` training: LLaVA's stage 1
trains the projectors alone, with the language model frozen too. A Qwen2.5-VL / Qwen3-VL
tower holds its projector, the patch mergers (:data:`NATIVE_PROJECTOR`): they train, the
rest of the tower stops (a frozen vision tower with a trained merger, as Qwen-VL
fine-tuning recipes do).

Freezing is ``requires_grad = False`` and nothing else; everything downstream reads
``requires_grad`` (the optimizer's parameter lists, the grad norm, the data-parallel
buckets, ZeRO-1 shards, FSDP2's reduce-scatter) or the config through the rules here
(the memory estimate, FLOPs). A frozen tower whose input is data keeps no autograd graph:
its output enters the projector as a plain tensor, so nothing is saved in its forward.
"""

from __future__ import annotations

from torch import nn

from mimotron.config.schema import ModuleConfig
from mimotron.models.lora import freeze_for_lora, is_lora_parameter

TOWER = "encoder"
"""The child of an encoder module that ``freeze = "encoder"`` freezes."""

NATIVE_PROJECTOR = ("encoder.merger.", "encoder.deepstack_mergers.")
"""A Qwen-VL tower's patch mergers: its projector, which ``freeze = "encoder"`` leaves
training (the merger is inside the tower's module, as in the checkpoint)."""

__all__ = ["NATIVE_PROJECTOR", "TOWER", "freeze_part", "is_frozen_parameter",
           "trainable_parameter_count"]


def is_frozen_parameter(mcfg: ModuleConfig, name: str) -> bool:
    """Whether ``freeze`` stops the parameter ``name`` of the module.

    Args:
        mcfg: the module's config.
        name: the parameter's name inside the module part (``encoder.layers.0.attn.wq.
            weight``, ``projector.fc1.weight``, ``layers.3.mlp.w1.weight``).

    Returns:
        True for every parameter of a module with ``freeze = true``, for the tower's
        under ``freeze = "encoder"``; False otherwise.
    """
    if mcfg.fully_frozen:
        return True
    if mcfg.lora.rank:
        return not is_lora_parameter(name)
    if mcfg.hf_native is not None and name.startswith(NATIVE_PROJECTOR):
        return False
    return mcfg.tower_frozen and name.split(".", 1)[0] == TOWER


def freeze_part(part: nn.Module, mcfg: ModuleConfig) -> bool:
    """Set ``requires_grad = False`` on what ``freeze`` stops in one module part.

    Parameters are never switched back on (a user may have frozen pieces of their own).

    Args:
        part: the module part a rank holds (an encoder's ``ModalitySubmodule`` or the
            language model, any pipeline stage).
        mcfg: the module's config.

    Returns:
        Whether anything of the part is frozen.
    """
    if mcfg.fully_frozen:
        part.requires_grad_(False)
        return True
    if mcfg.lora.rank:  # adapters: they alone train (mimotron.models.lora)
        freeze_for_lora(part)
        return True
    if not mcfg.tower_frozen:
        return False
    tower = getattr(part, TOWER, None)
    assert isinstance(tower, nn.Module), "freeze = 'encoder' on a module without a tower"
    for name, param in part.named_parameters():
        if is_frozen_parameter(mcfg, name):
            param.requires_grad_(False)
    return True


def trainable_parameter_count(part: nn.Module, mcfg: ModuleConfig) -> int:
    """Parameters of ``part`` that ``freeze`` leaves training (a meta-device part will do).

    Args:
        part: a built module part (any device, meta included).
        mcfg: the module's config.

    Returns:
        The count: all of them, the projector's under ``freeze = "encoder"``, or 0.
    """
    return sum(p.numel() for n, p in part.named_parameters()
               if not is_frozen_parameter(mcfg, n))
