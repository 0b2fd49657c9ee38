"""Attention over a context-parallel sequence: all-gather of keys and values.

Under ``modules.language.parallel.context = c`` every CP rank holds the positions
:func:`~mimotron.parallel.context_parallel.load_balanced_positions` gives it (a head and
a tail chunk). Queries stay local; keys and values (after RoPE, local heads under TP)
are all-gathered over the CP group by :class:`GatherKV`, so each rank's queries can
read every key. The gathered keys arrive in rank order
(:func:`~mimotron.parallel.context_parallel.gathered_positions`); the attention plan
(:func:`~mimotron.models.attention.attention_segments`) picks, for each run of a chunk's
queries, its document's keys up to the run's end, and a variable-length kernel attends
causally aligned at the lower right: no mask over global positions is made, and no
rank computes scores for keys after its queries.

The backward of the gather is a reduce-scatter: every rank's loss depends on every
rank's keys, so rank ``r``'s key gradient is the SUM over the group of the gradients
computed for its rows. gloo has no ``reduce_scatter``, so it is an ``all_reduce`` of the
gathered gradient followed by this rank's slice (same result on NCCL; the K/V gradient
is small next to the parameter reduction).

**Why not** ``torch.distributed.tensor.experimental.context_parallel``: it works by
patching ``F.scaled_dot_product_attention`` with a ring of the *flash / efficient*
kernels' ``_scaled_dot_product_*_attention`` ops, which are CUDA kernels (the CPU SDPA
path is not dispatched through them), and it supports ``is_causal`` over whole rows
only, not packed documents — so neither gloo/CPU (where the whole test suite runs)
nor packed rows would work. An all-gather of K/V costs ``O(S)`` memory per rank and is
exact; a ring would overlap communication but is not needed at our scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class GatherKV(torch.autograd.Function):
    """All-gather along ``dim`` over a group; backward: sum + own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int
                ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        size = dist.get_world_size(group)
        chunks = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        group, dim = ctx.group, ctx.dim
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        local = grad.shape[dim] // size
        return grad.narrow(dim, rank * local, local).contiguous(), None, None


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, dim: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence from this rank's, gathered along ``dim``.

    ``[B, S/c, h, d]`` -> ``[B, S, h, d]`` with the default ``dim`` (rank order). One
    collective for both (stacked on a new leading dim); the gradient of each is summed
    over the group and sliced back to this rank's rows.
    """
    both = GatherKV.apply(torch.stack([k, v]), group, dim + 1 if dim >= 0 else dim)
    return both[0], both[1]
