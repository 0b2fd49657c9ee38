"""``peft`` as the independent reference of mimotron's LoRA adapters.

:func:`with_adapters` puts PEFT's LoRA layers on a ``transformers`` model at the layers
mimotron adapted (by the per-family weight maps: the layer whose weight mimotron's
adapted layer's weight equals), with mimotron's rank and alpha, and copies mimotron's
initial adapter values in: the same adapter weights in both. It returns the model and
the map from a ``MimoModel`` parameter name to the reference's parameter.
"""

from __future__ import annotations

from typing import Any

import torch

from mimotron.models.lora import is_lora_parameter

PEFT_PARAMS = {"lora_a": "lora_A", "lora_b": "lora_B"}
PREFIX = "base_model.model."


def adapted_layers(names: list[str]) -> list[str]:
    """mimotron's adapted layers (``...attn.wq``) among parameter names."""
    return sorted({n.rsplit(".", 1)[0] for n in names if is_lora_parameter(n)})


def peft_name_of(base_name_of: Any, adapted: set[str]) -> Any:
    """``(ours, model) -> the PeftModel parameter`` from a family's base name map."""

    def name_of(ours: str, model: Any) -> str:
        if is_lora_parameter(ours):
            layer, kind = ours.rsplit(".", 1)
            hf = base_name_of(f"{layer}.weight", model)
            return f"{PREFIX}{hf[:-len('.weight')]}.{PEFT_PARAMS[kind]}.default.weight"
        hf = base_name_of(ours, model)
        layer = ours.rsplit(".", 1)[0]
        if layer in adapted:  # PEFT moves the adapted layer's own tensors one level down
            head, leaf = hf.rsplit(".", 1)
            return f"{PREFIX}{head}.base_layer.{leaf}"
        return PREFIX + hf

    return name_of


def with_adapters(model: Any, ours: torch.nn.Module, rank: int, alpha: float,
                  base_name_of: Any) -> tuple[Any, Any]:
    """``(PeftModel, name map)``: ``model`` with PEFT LoRA on the layers ``ours`` adapted,
    holding ``ours``' adapter values."""
    import peft

    names = [n for n, _ in ours.named_parameters()]
    adapted = adapted_layers(names)
    targets = [base_name_of(f"{layer}.weight", model)[:-len(".weight")] for layer in adapted]
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                             target_modules=targets, bias="none")
    wrapped = peft.get_peft_model(model, config)
    name_of = peft_name_of(base_name_of, set(adapted))
    theirs = dict(wrapped.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if is_lora_parameter(name):
                theirs[name_of(name, wrapped)].copy_(param.detach())
    return wrapped, name_of
