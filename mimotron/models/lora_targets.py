"""That every ``[modules.<m>.lora] targets`` entry names a linear layer of its module.

The names are the built module's, so the check builds it on the meta device (no memory,
no weight read), every layer, so an entry may name layers by index. It runs with the layout checks
(:func:`mimotron.parallel.layout.check_layout`), which ``mimotron plan`` and
``mimotron train`` run before any rank starts.
"""

from __future__ import annotations

import re

import torch

from mimotron.config.schema import MimoConfig
from mimotron.models.build import build_module
from mimotron.models.lora import lora_targets

__all__ = ["check_lora_targets"]


def check_lora_targets(cfg: MimoConfig) -> None:
    """Raise one ``ValueError`` line for a ``targets`` entry that matches no linear layer.

    Raises:
        ValueError: naming the module, the entries and the names its layers have.
    """
    for name, mod in cfg.modules.items():
        lora = mod.lora
        if not lora.rank:
            continue
        with torch.device("meta"):
            part = build_module(cfg, name, 64, init=False)
        missing = [t for t in lora.targets if not lora_targets(part, [t])]
        if missing:
            # Each layer's names once, without its index (attn.wq, encoder.mlp.w1, ...).
            linear = sorted({re.sub(r"layers\.\d+\.", "", n) for n, m in part.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise ValueError(f"modules.{name}.lora.targets {missing} match no linear layer of "
                             f"the module: expected names such as {linear}")
