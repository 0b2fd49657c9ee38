"""Attention over a context-parallel sequence: all-gather of keys and values.

Under ``modules.language.parallel.context = c`` every CP rank holds the positions
:func:`~mimotron.parallel.context_parallel.load_balanced_positions` gives it (a head and
a tail chunk). Queries stay local; keys and values (after RoPE, local heads under TP)
are all-gathered over the CP group by :class:`GatherKV`, so each rank attends its
``S / c`` queries to all ``S`` keys. The gathered keys arrive in rank order
(:func:`~mimotron.parallel.context_parallel.gathered_positions`), and the mask
(:func:`context_attention_mask`) compares *global* positions instead of reordering
them: causal ``k_pos <= q_pos``, and with packed rows also ``doc[q] == doc[k]``, read
from the whole ``[B, S]`` document ids every CP rank keeps.

The backward of the gather is a reduce-scatter: every rank's loss depends on every
rank's keys, so rank ``r``'s key gradient is the SUM over the group of the gradients
computed for its rows. gloo has no ``reduce_scatter``, so it is an ``all_reduce`` of the
gathered gradient followed by this rank's slice (same result on NCCL; the K/V gradient
is small next to the parameter reduction).

**Why not** ``torch.distributed.tensor.experimental.context_parallel``: it works by
patching ``F.scaled_dot_product_attention`` with a ring of the *flash / efficient*
kernels' ``_scaled_dot_product_*_attention`` ops, which are CUDA kernels (the CPU SDPA
path is not dispatched through them), and it supports ``is_causal`` only, without an
explicit ``attn_mask`` (torch 2.13 raises ``NotImplementedError("attn_bias is not
supported yet")``; CPU's ``_scaled_dot_product_flash_attention_for_cpu`` is not
patched at all) — so neither gloo/CPU (where the whole test suite runs) nor
packed documents (a block-diagonal mask) would work. An all-gather of K/V costs
``O(S)`` memory per rank for keys (not scores: SDPA's scores are ``[S / c, S]``) and is
exact; a ring would overlap communication but is not needed at our scale.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mimotron.parallel.context_parallel import gathered_positions, load_balanced_positions


class GatherKV(torch.autograd.Function):
    """All-gather ``[..., s, d]`` along dim -2 over a group; backward: sum + own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        chunks = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        local = grad.shape[-2] // size
        return grad.narrow(-2, rank * local, local).contiguous(), None


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole sequence ``[B, h, S, d]`` from the local ``[B, h, S/c, d]``.

    One collective for both (stacked on a new leading dim); the gradient of each is
    summed over the group and sliced back to this rank's rows.
    """
    both = GatherKV.apply(torch.stack([k, v]), group)
    return both[0], both[1]


def context_attention_mask(seq_len: int, cp_size: int, cp_rank: int, device: torch.device,
                           doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask (True = may attend) of this rank's queries against the gathered keys.

    Args:
        seq_len: the global sequence length ``S``.
        cp_size: the CP degree ``c``.
        cp_rank: this rank's CP coordinate.
        device: where the mask lives.
        doc_ids: packed rows: the WHOLE ``[B, S]`` document ids; ``None`` = causal only.

    Returns:
        ``[1, 1, S / c, S]`` (causal) or ``[B, 1, S / c, S]`` (packed documents).
    """
    q_pos = load_balanced_positions(seq_len, cp_size, cp_rank, device)
    k_pos = gathered_positions(seq_len, cp_size, device)
    mask = k_pos[None, :] <= q_pos[:, None]
    if doc_ids is None:
        return mask[None, None]
    same_doc = doc_ids[:, q_pos][:, :, None] == doc_ids[:, k_pos][:, None, :]
    return (same_doc & mask[None]).unsqueeze(1)
