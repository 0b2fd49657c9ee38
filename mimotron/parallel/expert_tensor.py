"""Expert tensor parallelism: rows gathered over ``expt_tp``, partial outputs scattered back.

With ``parallel.expert_tensor = t`` every expert's SwiGLU is split like a dense TP MLP:
``w1``/``w3`` ``[E, F, H]`` along ``F`` (dim 1) and ``w2`` ``[E, H, F]`` along ``F``
(dim 2), so a rank's expert output is a partial sum over its ``F / t`` columns. After
the expert-parallel exchange each ``expt_tp`` peer holds different token rows (they
may come from different data-parallel slices), so the peers all-gather their rows
(:func:`gather_rows`), each computes its partial output for all of them, and the
partial outputs are summed and scattered back to the peer that owns each row
(:func:`reduce_scatter_rows`). The two are each other's adjoint, so gradients flow back
through the reverse operations; every expert shard's gradient covers every row that
reached its expert.

Row counts differ per peer: they are known from the per-expert counts the peers
all-gather first (:func:`gather_counts`), and rows travel padded to the largest count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a count table (int64) over ``group``: ``[peers, *counts.shape]``."""
    peers = dist.get_world_size(group)
    out = counts.new_empty((peers * counts.shape[0], *counts.shape[1:]))
    dist.all_gather_into_tensor(out, counts.contiguous(), group=group)
    return out.view(peers, *counts.shape)


def _gather(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather row blocks of different lengths (``rows[r]`` from peer ``r``), in order."""
    width = max(rows)
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((width * len(rows), *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[r * width : r * width + n] for r, n in enumerate(rows)])


def _own_rows(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This peer's block of a tensor laid out as the concatenation of every peer's rows."""
    me = dist.get_rank(group)
    start = sum(rows[:me])
    return x[start : start + rows[me]]


class _GatherRows(torch.autograd.Function):
    """All-gather rows over ``expt_tp``; backward sums the peers' gradients of own rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: list[int], group: dist.ProcessGroup  # noqa: ANN001
                ) -> torch.Tensor:
        ctx.rows, ctx.group = rows, group
        return _gather(x, rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return _own_rows(total, ctx.rows, ctx.group).contiguous(), None, None


class _ReduceScatterRows(torch.autograd.Function):
    """Sum partial outputs over ``expt_tp``, keep own rows; backward all-gathers."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: list[int], group: dist.ProcessGroup  # noqa: ANN001
                ) -> torch.Tensor:
        ctx.rows, ctx.group = rows, group
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return _own_rows(total, rows, group).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return _gather(grad.contiguous(), ctx.rows, ctx.group), None, None


def gather_rows(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every ``expt_tp`` peer's rows, peer by peer (``rows[r]`` rows from peer ``r``)."""
    return _GatherRows.apply(x, list(rows), group)


def reduce_scatter_rows(x: torch.Tensor, rows: list[int], group: dist.ProcessGroup
                        ) -> torch.Tensor:
    """The sum over ``expt_tp`` peers of ``x`` (laid out as :func:`gather_rows`'s
    result), this peer's rows only."""
    return _ReduceScatterRows.apply(x, list(rows), group)
