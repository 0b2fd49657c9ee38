"""Sequence parallelism for the language model (Megatron's SP, on top of tensor parallelism).

With ``modules.language.parallel.sequence_parallel = true`` the regions outside the
tensor-parallel linears (the residual stream, every pre-norm RMSNorm, the final norm)
hold ``seq / tp`` of the activations on each TP rank, along dim 1 of ``[B, S, H]``:

* the layer plans come from DTensor (:func:`sequence_parallel_plan`): a
  ``PrepareModuleInput`` on ``attn`` and ``mlp`` all-gathers the sequence-sharded input
  once before the column-parallel ``wq/wk/wv`` (``w1/w3``), and the row-parallel ``wo``
  (``w2``) reduce-scatters its partial sums back to ``Shard(1)``
  (``RowwiseParallel(output_layouts=Shard(1))``); the output head all-gathers its input
  and keeps local vocabulary logits, so the vocab-parallel loss is unchanged. These
  plans work on gloo/CPU and NCCL alike (checked by the parity tests on gloo).
* entering and leaving a stage are our own two autograd functions, because they act on
  plain tensors between modules and have no plan: :func:`scatter_sequence` keeps this
  rank's chunk of a replicated ``[B, S, H]`` (the merged embeddings, or the activations
  a previous pipeline stage sent) and all-gathers the gradient; :func:`gather_sequence`
  all-gathers a stage's output before it is sent (pipeline stages exchange whole
  sequences, so the p2p shapes and the bridge do not depend on SP) and keeps this rank's
  chunk of the gradient.

Norm weights inside the sharded regions see only ``seq / tp`` tokens per rank, so their
gradients are partial sums: :func:`reduce_sequence_parallel_grads` all-reduces them over
TP (as Megatron does) before the data-parallel reduce, after which they are whole and
equal on every TP rank and the global grad norm counts them once (TP rank 0,
:mod:`mimotron.optim.grads`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE
from mimotron.parallel.context_parallel import moe_source

# Marks a plain parameter whose gradient is a partial sum over the TP group: the
# sequence-sharded norms under SP, and the per-head norms under any TP.
SP_ATTR = "sequence_parallel"
# Norms whose input is sequence-sharded (q_norm/k_norm run after the gather).
_SHARDED_NORMS = ("attn_norm", "mlp_norm", "final_norm")
# Per-head q/k norms (Qwen3): each TP rank normalises only its local heads, so their
# weights' gradients are partial sums over TP, with or without SP.
HEAD_NORMS = ("q_norm", "k_norm")


def sequence_parallel_plan(layers: nn.ModuleDict, has_output: bool) -> dict[str, object]:
    """DTensor plan entries of a sequence-parallel language stage (override the TP plan).

    Args:
        layers: the stage's layers (``TransformerBlock`` with ``attn`` and ``mlp``).
        has_output: the stage holds the output head.
    """
    # Here, not at the top: the layout checks below import this module, and the launcher
    # of ``mimotron train`` runs them without ever needing DTensor (~1 s of imports).
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    plan: dict[str, object] = {}
    for idx in layers:
        base = f"layers.{idx}"
        # attn(x, rope): only x is a sequence-sharded tensor.
        # attn(x, rope, plan): only x is sharded (rope tables and the attention plan are not).
        plan[f"{base}.attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None))
        plan[f"{base}.mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{base}.attn.wo"] = RowwiseParallel(output_layouts=Shard(1))
        plan[f"{base}.mlp.w2"] = RowwiseParallel(output_layouts=Shard(1))
    if has_output:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1))  # local logits [.., V / tp]
    return plan


def mark_sequence_parallel_params(module: nn.Module,
                                  names: tuple[str, ...] = _SHARDED_NORMS) -> int:
    """Mark the weights of the norms called ``names`` (default: the sequence-sharded ones).

    Marked weights are summed over TP by :func:`reduce_sequence_parallel_grads`.

    Returns:
        How many parameters were marked.
    """
    count = 0
    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            for p in sub.parameters():
                setattr(p, SP_ATTR, True)
                count += 1
    return count


def reduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """SUM the marked (norm) gradients over the TP group, in one flat collective.

    Every TP rank holds the same marked parameters in the same order, so the collective
    lines up; a marked parameter without a gradient contributes zeros. A 16-bit
    parameter of a ZeRO-1 module is summed in its fp32 ``main_grad``
    (:func:`~mimotron.parallel.main_grad.grad_buffer`).
    """
    # Here, not at the top: it imports DTensor, which the launcher's checks never need.
    from mimotron.parallel.main_grad import grad_buffer, set_grad_buffer, zeros_grad_buffer

    params = [p for p in module.parameters() if p.requires_grad and getattr(p, SP_ATTR, False)]
    if not params or group is None or dist.get_world_size(group) == 1:
        return
    grads = []
    for p in params:
        if grad_buffer(p) is None:
            set_grad_buffer(p, zeros_grad_buffer(p))
        grads.append(grad_buffer(p))
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def _chunk(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's ``1 / tp`` of dim 1, in its own storage.

    A copy even where the slice is already contiguous (one sample): the first norm keeps
    it for backward, and a view would keep the whole replicated tensor alive with it.
    """
    size = dist.get_world_size(group)
    return x.chunk(size, dim=1)[dist.get_rank(group)].clone(memory_format=torch.contiguous_format)


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 1, in group rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _ScatterSequence(torch.autograd.Function):
    """Replicated ``[B, S, H]`` -> this rank's ``[B, S / tp, H]``; grad: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return _chunk(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        # The replicated input's gradient is the same whole tensor on every TP rank.
        return _all_gather(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """Sharded ``[B, S / tp, H]`` -> replicated ``[B, S, H]``; grad: keep this rank's chunk.

    The result is used as a replicated tensor (sent to the next stage by every TP rank,
    whose receivers scatter it again), so its gradient is already whole on every rank.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return _all_gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _chunk(grad, ctx.group), None


def scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Keep this TP rank's sequence chunk of a replicated ``[B, S, H]`` (autograd-aware).

    Raises:
        ValueError: the TP degree does not divide ``S`` (every rank raises alike, before
            any collective of the forward).
    """
    size = dist.get_world_size(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by tensor={size}: "
                         "sequence parallelism needs data.seq_length divisible by tensor")
    return _ScatterSequence.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a sequence-sharded ``[B, S / tp, H]`` into a replicated ``[B, S, H]``."""
    return _GatherSequence.apply(x, group)


def check_sequence_parallel(cfg: MimoConfig, name: str) -> None:
    """Raise (before any collective) unless module ``name`` can run sequence parallelism.

    Raises:
        ValueError: one line naming the field: SP on an encoder, without tensor > 1, with
            MoE (``num_experts > 0``, also an MoE ``hf_path`` checkpoint), or a
            ``data.seq_length`` the TP degree does not divide. A dense ``hf_path`` decoder
            is accepted: its q/k norms run after the all-gather inside ``attn`` and its
            row-parallel biases are added once, after the reduce-scatter.
    """
    mod = cfg.modules[name]
    p = f"modules.{name}.parallel.sequence_parallel"
    if not mod.parallel.sequence_parallel:
        return
    if name != LANGUAGE:
        raise ValueError(f"{p}=true is invalid: sequence parallelism is implemented for "
                         f"modules.{LANGUAGE} only; use false for encoders")
    tp = mod.parallel.tensor
    if tp < 2:
        raise ValueError(f"{p}=true is invalid with modules.{name}.parallel.tensor={tp}: "
                         "sequence parallelism needs tensor > 1; set tensor >= 2 or use false")
    moe = moe_source(mod, name)
    if moe:
        raise ValueError(f"{p}=true is invalid with {moe}: sequence parallelism supports "
                         "dense language models only (built-in or hf_path); use false")
    seq = cfg.data.seq_length
    if seq % tp:
        raise ValueError(f"data.seq_length={seq} is invalid with {p}=true: it must be divisible "
                         f"by modules.{name}.parallel.tensor={tp}")
