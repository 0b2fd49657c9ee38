"""LoRA: low-rank adapters on a module's linear layers, the rest of the module frozen.

``[modules.<m>.lora]`` with ``rank = r > 0`` gives each linear layer named by ``targets``
two parameters of its own, ``lora_a`` ``[r, in]`` and ``lora_b`` ``[out, r]``, and a
forward hook that adds ``(alpha / r) lora_b lora_a dropout(x)`` to the layer's output
(Hu et al., 2021; PEFT's ``LoraLayer``). The layer itself is untouched: its weight keeps
its name and its tensor-parallel plan, so checkpoints of the base, the Hugging Face
weight maps and the TP plans are the same with or without adapters, and an adapter's
names are its layer's plus ``.lora_a`` / ``.lora_b``.

Initialisation follows PEFT: ``lora_a`` uniform in ``+-1 / sqrt(in)`` (Kaiming-uniform
with ``a = sqrt(5)``, drawn from ``(train.seed, name)`` so every layout starts alike),
``lora_b`` zero, so training starts from the base model.

Under tensor parallelism (:mod:`mimotron.parallel.lora_tp`) the adapter of a
column-parallel layer shards ``lora_b`` with it, that of a row-parallel layer shards
``lora_a``, with the collectives that keep the result the one-process one.

Only the adapters train (:func:`freeze_for_lora`): the base weights get no gradient, no
optimizer state and no data-parallel sync, and a frozen weight keeps no activation for
its own gradient (autograd saves a linear's input only for a weight that trains). Under
``bf16`` / ``fp16`` the engine holds the frozen base in the compute dtype
(:func:`hold_base_in`): once, 2 bytes per parameter, the numbers autocast's per-use
cast would give.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.config.lora import LoraConfig
from mimotron.models.init import parameter_seed
from mimotron.parallel.tensor_parallel import COLUMN_WISE, ROW_WISE

__all__ = ["LORA_PARAMS", "LoraState", "adapter_parameter_count", "attach_lora",
           "freeze_for_lora", "hold_base_in", "is_lora_parameter", "lora_targets", "low_rank",
           "matches_target"]

LORA_PARAMS = ("lora_a", "lora_b")
"""The names an adapter's parameters take on its linear layer."""


@dataclass
class LoraState:
    """What an adapted layer's hook needs besides its parameters.

    ``combine`` is the tensor-parallel form of the update (``None``: one process or a
    layer that TP does not split): ``(layer, its input as the layer received it) ->
    the update in the layout of the layer's output``
    (:mod:`mimotron.parallel.lora_tp`).
    """

    scale: float
    dropout: float
    combine: Callable[[nn.Linear, torch.Tensor], torch.Tensor] | None = None


def matches_target(name: str, target: str) -> bool:
    """``target`` names ``name``: its end after a dot, or the whole name, each as a glob."""
    return fnmatch.fnmatchcase(name, target) or fnmatch.fnmatchcase(name, "*." + target)


def lora_targets(part: nn.Module, targets: list[str]) -> dict[str, nn.Linear]:
    """The linear layers of ``part`` whose names match ``targets`` (see ``LoraConfig``)."""
    return {n: m for n, m in part.named_modules()
            if isinstance(m, nn.Linear) and any(matches_target(n, t) for t in targets)}


def adapter_parameter_count(part: nn.Module, lora: LoraConfig, tensor: int = 1) -> int:
    """Parameters the adapters of ``part`` would have on one rank of a ``tensor``-way TP
    group (a meta-device part will do): a column-parallel layer's ``B`` and a
    row-parallel layer's ``A`` are split, their partners whole on every rank
    (:mod:`mimotron.parallel.lora_tp`)."""
    if not lora.rank:
        return 0
    total = 0
    for name, m in lora_targets(part, lora.targets).items():
        leaf = name.rsplit(".", 1)[-1]
        split_in = tensor if leaf in ROW_WISE else 1
        split_out = tensor if leaf in COLUMN_WISE else 1
        total += lora.rank * (m.in_features // split_in + m.out_features // split_out)
    return total


def is_lora_parameter(name: str) -> bool:
    """Whether a parameter name (any prefix) is an adapter's."""
    return name.rsplit(".", 1)[-1] in LORA_PARAMS


def _lora_a_init(shape: tuple[int, int], seed: int, full_name: str) -> torch.Tensor:
    """PEFT's ``kaiming_uniform_(a=sqrt(5))``: uniform in ``+-1 / sqrt(fan_in)``."""
    gen = torch.Generator().manual_seed(parameter_seed(seed, full_name))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2 - 1) * bound


def low_rank(layer: nn.Linear, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``lora_a dropout(x)``: the adapter's rank-``r`` activations."""
    state: LoraState = layer.lora_state
    if state.dropout and layer.training:
        x = F.dropout(x, state.dropout)
    return F.linear(x, a)


def _hook(layer: nn.Linear, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
    state: LoraState = layer.lora_state
    if state.combine is not None:
        update = state.combine(layer, args[0])
        # The update is built in the layout of the layer's output as the TP plan leaves it
        # (its output hook runs before this one): say so where that does not hold.
        assert update.shape == out.shape, (
            f"LoRA update {tuple(update.shape)} for an output {type(out).__name__} "
            f"{tuple(out.shape)} {getattr(out, 'placements', '')}; forward hooks "
            f"{[getattr(h, '__qualname__', repr(h)) for h in layer._forward_hooks.values()]}")
        return out + update
    return out + F.linear(low_rank(layer, args[0], layer.lora_a), layer.lora_b) * state.scale


def attach_lora(part: nn.Module, lora: LoraConfig, seed: int, prefix: str) -> list[str]:
    """Give the matching linear layers of a built module part their adapters.

    Call it on the whole-shape layers, before tensor parallelism shards the adapters
    (:func:`~mimotron.parallel.lora_tp.shard_lora`) and before FSDP or freezing.

    Args:
        part: the module part (encoder submodule or language model, any stage).
        lora: the module's ``[lora]`` table (``rank > 0``).
        seed: ``train.seed`` (``lora_a``'s initial values come from it and the name).
        prefix: the part's parameter prefix in the ``MimoModel``
            (``language_model.``), so every layout draws the same values.

    Returns:
        The names of the adapted layers.
    """
    layers = lora_targets(part, lora.targets)
    for name, layer in layers.items():
        weight = layer.weight
        out_features, in_features = layer.out_features, layer.in_features
        device = weight.device
        a = _lora_a_init((lora.rank, in_features), seed, f"{prefix}{name}.lora_a")
        layer.lora_a = nn.Parameter(a.to(device))
        layer.lora_b = nn.Parameter(torch.zeros(out_features, lora.rank, device=device))
        layer.lora_state = LoraState(lora.alpha / lora.rank, lora.dropout)
        layer.register_forward_hook(_hook)
    return sorted(layers)


def hold_base_in(part: nn.Module, dtype: torch.dtype, embedding: bool = True) -> int:
    """Hold the frozen weights (and biases) of ``part``'s linear layers, and of its
    embedding unless ``embedding`` is false, in ``dtype``; returns how many.

    Under ``bf16`` / ``fp16`` autocast casts a frozen fp32 weight to the compute dtype at
    every use, so holding it in that dtype gives the same numbers at half the bytes: the
    base once, 2 bytes per parameter. The embedding's lookup is the same values either
    way unless the residual stream is fp32 (``train.fp32_residual_connection``), where
    the caller keeps it. A weight shared by several modules (tied embeddings) stays
    shared. Norms keep their dtype (they compute in fp32).
    """
    kinds = (nn.Linear, nn.Embedding) if embedding else (nn.Linear,)
    # A weight the embedding shares (tied head) stays as the embedding keeps it.
    kept = set() if embedding else {id(p) for m in part.modules()
                                     if isinstance(m, nn.Embedding) for p in m.parameters()}
    held: dict[int, nn.Parameter] = {}
    for module in part.modules():
        if not isinstance(module, kinds):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if (param.requires_grad or not param.is_floating_point() or param.dtype == dtype
                    or id(param) in kept):
                continue
            if id(param) not in held:
                held[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            setattr(module, name, held[id(param)])
    return len(held)


def freeze_for_lora(part: nn.Module) -> int:
    """Stop every parameter of ``part`` but the adapters; returns how many train."""
    count = 0
    for name, param in part.named_parameters():
        trains = is_lora_parameter(name)
        param.requires_grad_(trains)
        count += int(trains)
    return count
