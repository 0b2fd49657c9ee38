"""That every ``[modules.<m>.lora] targets`` entry names a linear layer of its module.

The names are the built module's. The check builds the module on the meta device (no
memory, no weight read) with one layer, whose names stand for every layer's (a stack's
layers are alike: the MoE layers that are not are refused with adapters), so an entry
may name layers by index at the cost of one layer whatever the depth. It runs with the
layout checks (:func:`mimotron.parallel.layout.check_layout`), which ``mimotron plan``,
``plan --auto`` for each candidate and ``mimotron train`` run before any rank starts.
"""

from __future__ import annotations

import re

import torch

from mimotron.config.schema import MimoConfig
from mimotron.models.build import build_module
from mimotron.models.lora import matches_target

__all__ = ["check_lora_targets", "linear_names"]

_LAYER_0 = re.compile(r"(^|\.)layers\.0\.")


def linear_names(cfg: MimoConfig, name: str) -> list[str]:
    """The names of module ``name``'s linear layers, every layer's (module docs)."""
    with torch.device("meta"):
        part = build_module(cfg, name, 64, layer_ids=[0], init=False)
    out = []
    for found, module in part.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if _LAYER_0.search(found) is None:
            out.append(found)
            continue
        out += [_LAYER_0.sub(rf"\g<1>layers.{i}.", found, count=1)
                for i in range(cfg.modules[name].num_layers)]
    return out


def check_lora_targets(cfg: MimoConfig) -> None:
    """Raise one ``ValueError`` line for a ``targets`` entry that matches no linear layer.

    Raises:
        ValueError: naming the module, the entries and the names its layers have.
    """
    for name, mod in cfg.modules.items():
        if not mod.lora.rank:
            continue
        names = linear_names(cfg, name)
        missing = [t for t in mod.lora.targets if not any(matches_target(n, t) for n in names)]
        if missing:
            # Each layer's names once, without its index (attn.wq, encoder.mlp.w1, ...).
            linear = sorted({re.sub(r"layers\.\d+\.", "", n) for n in names})
            raise ValueError(f"modules.{name}.lora.targets {missing} match no linear layer of "
                             f"the module: expected names such as {linear}")
