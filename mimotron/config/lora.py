"""The ``[modules.<m>.lora]`` table: low-rank adapters on a module's linear layers.

With ``rank > 0`` the linear layers whose names match ``targets`` get an adapter
(``W x + (alpha / rank) B A dropout(x)``, LoRA) and everything else of the module stops
training (:mod:`mimotron.models.lora`). The checks here run before any rank starts; that
every target names a linear layer needs the module's build, and is checked with the
layout (:func:`mimotron.models.lora_targets.check_lora_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "base_in_folder", "check_lora"]

DEFAULT_TARGETS = ("attn.*", "mlp.*")
"""Every linear layer of a transformer layer: the attention projections and the MLP
(``attn.wq/wk/wv/wo``, ``mlp.w1/w2/w3`` of a decoder; a tower's own names)."""


@dataclass
class LoraConfig:
    """One module's adapters (``[modules.<m>.lora]``)."""

    rank: int = 0
    """Rank ``r`` of each adapter (>= 0); 0 = no adapters (the module trains as ``freeze``
    says). With ``r > 0`` only the adapters of the module train."""
    alpha: float = 16.0
    """Scale numerator (> 0): the update is ``(alpha / rank) B A x``, as in PEFT."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 <= p < 1); needs ``parallel.tensor = 1``."""
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Linear layers that get adapters, by name inside the module: an entry matches a
    layer whose name ends with it after a dot, as a glob too (``attn.wq`` matches
    ``layers.3.attn.wq``, ``mlp.*`` every MLP projection), or the whole name as a glob
    (``layers.1*.mlp.*``). Names are mimotron's (``attn.wq/wk/wv/wo``, ``mlp.w1/w2/w3``;
    a projector's ``projector.fc1/fc2``); every entry must match a linear layer."""


def base_in_folder(cfg: Any, name: str) -> bool:
    """Whether module ``name`` has adapters on a base that only its Hugging Face folder
    holds (``hf_path``, no ``checkpoint.pretrained``): the base never changes, so the
    checkpoints hold the adapters only and the base is held once in 16 bits."""
    mod = cfg.modules[name]
    return bool(mod.lora.rank and mod.hf_path and not cfg.checkpoint.pretrained)


def check_lora(cfg: Any, name: str) -> None:
    """Raise one ``ValueError`` line for a ``[modules.<name>.lora]`` table that cannot run.

    Args:
        cfg: the run config (sizes of Hugging Face modules filled in).
        name: the module.
    """
    mod = cfg.modules[name]
    lora = mod.lora
    where = f"modules.{name}.lora"
    if lora.rank < 0:
        raise ValueError(f"{where}.rank={lora.rank} is invalid: expected >= 0 (0 = no adapters)")
    if lora.rank == 0:
        return
    if not lora.alpha > 0:
        raise ValueError(f"{where}.alpha={lora.alpha} is invalid: expected > 0")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"{where}.dropout={lora.dropout} is invalid: expected 0 <= p < 1")
    if not lora.targets:
        raise ValueError(f"{where}.targets is empty: name at least one linear layer "
                         f"(e.g. {list(DEFAULT_TARGETS)})")
    if mod.freeze is not False:
        raise ValueError(f"{where}.rank={lora.rank} with modules.{name}.freeze="
                         f"{mod.freeze!r}: adapters already freeze the rest of the module; "
                         "set freeze = false")
    par = mod.parallel
    if lora.dropout and par.tensor > 1:
        raise ValueError(f"{where}.dropout={lora.dropout} is not supported with modules."
                         f"{name}.parallel.tensor={par.tensor}: tensor-parallel ranks would "
                         "drop different inputs; use dropout = 0")
    unsupported = [(mod.num_experts > 0, "num_experts > 0"),
                   (par.fsdp and par.tensor > 1, "parallel.fsdp = true and parallel.tensor > 1"),
                   (par.expert > 1, "parallel.expert > 1"),
                   (par.virtual_pipeline > 1, "parallel.virtual_pipeline > 1")]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{where}.rank={lora.rank} is not supported with modules.{name}."
                             f"{what} yet; train the module in full or drop that option")


