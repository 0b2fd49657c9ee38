"""The colocated bridge of an edge whose items are dealt by cost (``data.balance_encoders``).

Each encoder DP replica encodes the items the data provider dealt it
(:mod:`mimotron.data.balance`), from any sample of the micro-batch, and each language
slice needs the rows of its own samples' items. :class:`BalancedBridge` is the colocated
hand-over, an autograd function over the (colocated) world:

* forward — all-gather every rank's item count and its rows (padded to the largest
  count); read the TP-rank-0 copy of each encoder replica, in DP order; take this
  rank's items at ``offset[replica] + row`` (the replica and row the language slice
  carries per item), grouped by replica as a split layout's bridge receives them, so
  :func:`~mimotron.data.balance.in_item_order` puts either back in item order;
* backward — each rank puts its rows' gradient, divided by the ranks holding the same
  language slice (its TP copies), into a zero tensor of every item; a world all-reduce
  SUM gives every rank every item's gradient, and each keeps its own replica's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["BalancedBridge", "item_positions"]


def item_positions(owner: torch.Tensor, row: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Where a language slice's items sit among every replica's rows, grouped by replica.

    Args:
        owner: the replica of each of the slice's items, in item order (host).
        row: each item's row in its replica's output (host).
        sizes: each replica's row count, in DP order.

    Returns:
        The positions in the replicas' concatenated rows, ascending: replicas in order,
        item order inside each.
    """
    offsets = torch.tensor([0, *sizes[:-1]], dtype=torch.long).cumsum(0)
    return torch.sort(offsets[owner] + row).values


class BalancedBridge(torch.autograd.Function):
    """Hand each language slice its items' rows from the replicas that encoded them."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, owner: torch.Tensor, row: torch.Tensor,
                readers: tuple[int, ...], replica: int, copies: int
                ) -> torch.Tensor:  # noqa: ANN001
        """``rows``: this rank's encoder output; ``owner``, ``row``: this rank's language
        items (host); ``readers``: each replica's rank read (TP 0); ``replica``: this
        rank's encoder replica; ``copies``: ranks holding this rank's language slice."""
        world = dist.get_world_size()
        count = torch.tensor([rows.shape[0]], dtype=torch.long, device=rows.device)
        counts_t = [torch.empty_like(count) for _ in range(world)]
        dist.all_gather(counts_t, count)
        counts = [int(c) for c in torch.cat(counts_t).cpu()]
        padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype,
                             device=rows.device)
        padded[:rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded)
        sizes = [counts[r] for r in readers]
        full = torch.cat([gathered[r][:counts[r]] for r in readers])
        where = item_positions(owner, row, sizes).to(rows.device)
        ctx.meta = (full.shape, where, sum(sizes[:replica]), rows.shape[0], copies)
        return full.index_select(0, where)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        shape, where, first, count, copies = ctx.meta
        full = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        full.index_copy_(0, where, grad / copies)
        dist.all_reduce(full)
        return full[first:first + count].clone(), None, None, None, None, None
