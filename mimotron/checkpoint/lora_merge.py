"""LoRA adapters merged into their layers' weights, for the exports that write weights.

A run with ``[modules.<m>.lora]`` checkpoints each adapted layer's ``lora_a`` /
``lora_b`` next to its weight (:mod:`mimotron.models.lora`). ``--format hf`` and
``--format hf-llava`` write ``W + (alpha / r) B A`` for every adapted layer and drop
the adapters, so the folder they write is the adapted model as a plain ``transformers``
one. (``--format peft`` writes the adapters themselves: :mod:`mimotron.checkpoint.
lora_export`.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mimotron.names import module_prefix

__all__ = ["lora_tables", "merge_adapters"]


def lora_tables(run_config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``module -> its [lora] table`` for each module of the run with adapters."""
    return {m: t["lora"] for m, t in run_config["modules"].items()
            if (t.get("lora") or {}).get("rank", 0) > 0}


def merge_adapters(tensors: Mapping[str, torch.Tensor], run_config: Mapping[str, Any]
                   ) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every adapter merged into its layer's weight (in
    fp32, stored in the weight's dtype) and the adapters dropped; unchanged without."""
    out = dict(tensors)
    for module, table in lora_tables(run_config).items():
        scale = float(table["alpha"]) / int(table["rank"])
        prefix = module_prefix(module)
        for name in [n for n in out if n.startswith(prefix) and n.endswith(".lora_a")]:
            layer = name[:-len(".lora_a")]
            a, b = out.pop(name), out.pop(f"{layer}.lora_b")
            weight = out[f"{layer}.weight"]
            merged = weight.float() + scale * (b.float() @ a.float())
            out[f"{layer}.weight"] = merged.to(weight.dtype)
    return out
