"""Even work per rank: samples over language DP replicas by tokens, media items over
encoder DP replicas by cost (``data.balance_tokens``, ``data.balance_encoders``).

Both are decisions on the host, made identically on every rank from the batch alone, so
no rank asks another; neither changes the math (a step's gradient is a sum over its
samples and items, divided by the global batch's loss tokens).

**Token-balanced language batches** (:func:`balanced_order`). A global batch's samples
(or packed rows) are permuted before the micro-batch and DP slicing cut them: first each
sample goes to a language DP replica, largest first to the replica with the fewest tokens
that still has room (longest-processing-time first, with every replica holding
``G / D`` samples), then each replica's samples go to its micro-batch slots the same way.
A resume rebuilds the same global batch and so the same order.

**Media balanced across encoder DP replicas.** A step's media items (images, videos,
spectrograms: one per placeholder block; in a micro-batch, placeholder order over its
samples is the *item order*) are dealt to the encoder's DP replicas by cost
(:func:`lpt_bins`), largest first to the replica with the least work so far in the step,
whatever sample they belong to; each stays in its micro-batch. Each replica encodes its
items (:func:`encoder_items`); the bridge then carries each item's rows to the language
replica holding its sample, which receives them grouped by encoding replica (replicas in
order, item order inside each); :func:`in_item_order` puts them back in item order
before they are merged at the placeholders. The language slice carries, per item slot,
the replica that encodes it and its row in that replica's output (``<modality>_owner``,
``<modality>_owner_row``; ``-1`` where no item is).

An item's cost is its token count for a fixed-size tower (every item the same) and
``n + sum over frames of s**2 / (6 * hidden)`` for a native-resolution one (``n`` patch
rows, frames of ``s`` patches each; a transformer layer spends about ``24 h**2`` FLOPs per
token in its projections and ``4 h s`` in attention over ``s`` keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from mimotron.host_sync import host_copy

Batch = dict[str, torch.Tensor]

__all__ = ["balanced_items", "balanced_order", "deal_step", "encoder_items", "in_item_order",
           "is_balanced", "item_costs", "item_keys", "lpt_bins", "owner_keys"]


def lpt_bins(costs: Sequence[float], num_bins: int, capacity: int | Sequence[int] | None = None,
             loads: list[float] | None = None, groups: Sequence[int] | None = None
             ) -> list[int]:
    """Each item's bin: largest cost first, to the least-loaded bin with room.

    Ties go to the lower bin, equal costs are taken in index order, so the result is a
    pure function of the arguments.

    Args:
        costs: one cost per item.
        num_bins: bins to fill.
        capacity: the most items a bin takes (``None``: no bound); with ``groups``, the
            most items of one group a bin takes (one bound, or one per group).
        loads: each bin's load so far, updated in place (``None``: all zero).
        groups: each item's group (its micro-batch), for ``capacity``.

    Returns:
        The bin of each item.
    """
    loads = [0.0] * num_bins if loads is None else loads
    groups = [0] * len(costs) if groups is None else groups
    fill: dict[tuple[int, int], int] = {}
    out = [0] * len(costs)
    bound = [capacity] * (max(groups, default=0) + 1) if not isinstance(
        capacity, Sequence) else list(capacity)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        limit = bound[groups[i]]
        room = [b for b in range(num_bins)
                if limit is None or fill.get((groups[i], b), 0) < limit]
        bin_ = min(room, key=lambda b: (loads[b], b))
        out[i] = bin_
        loads[bin_] += costs[i]
        fill[(groups[i], bin_)] = fill.get((groups[i], bin_), 0) + 1
    return out


def deal_step(costs: Sequence[Sequence[float]], num_bins: int, capacities: Sequence[int],
              per_step: bool) -> list[list[int]]:
    """The bin of every item of a step, micro-batch by micro-batch.

    Args:
        costs: per micro-batch, its items' costs in item order.
        num_bins: the encoder's DP replicas.
        capacities: per micro-batch, the most of its items one replica takes.
        per_step: deal the step's items together (:func:`lpt_bins` over all, each staying
            in its micro-batch): what a step waits for when a replica encodes its whole
            step at once (colocated ``train.encoder_batching``). Otherwise each
            micro-batch is dealt on its own, starting from the step's loads so far spread
            over its micro-batches, so that near-ties go to the replica with the least
            work in the step: what a step waits for when every micro-batch waits for its
            slowest replica (the bridges of split layouts, colocated without batching).
    """
    if per_step:
        flat = lpt_bins([c for mb in costs for c in mb], num_bins, capacity=capacities,
                        groups=[j for j, mb in enumerate(costs) for _ in mb])
        first = [0, *accumulate(len(mb) for mb in costs)]
        return [flat[first[j]:first[j + 1]] for j in range(len(costs))]
    step = [0.0] * num_bins
    out = []
    for mb, capacity in zip(costs, capacities, strict=True):
        owners = lpt_bins(mb, num_bins, capacity=capacity,
                          loads=[load / len(costs) for load in step])
        for cost, bin_ in zip(mb, owners, strict=True):
            step[bin_] += cost
        out.append(owners)
    return out


def balanced_order(lengths: Sequence[int], num_replicas: int, num_microbatches: int
                   ) -> list[int]:
    """The global batch's samples in an order that gives each DP replica even tokens.

    Args:
        lengths: each sample's (or packed row's) real tokens, in stream order.
        num_replicas: the language model's DP degree.
        num_microbatches: micro-batches per global batch.

    Returns:
        ``order``: position ``p`` of the balanced global batch holds sample ``order[p]``;
        micro-batch ``j``'s slice of replica ``d`` is positions ``j*m + d*q + [0, q)``
        (``m`` samples per micro-batch, ``q = m / num_replicas``).
    """
    size = len(lengths)
    per_mb = size // num_microbatches
    per_slice = per_mb // num_replicas
    assert per_slice * num_replicas * num_microbatches == size, "uneven global batch"
    replica = lpt_bins(lengths, num_replicas, capacity=size // num_replicas)
    order = [0] * size
    for d in range(num_replicas):
        mine = [i for i in range(size) if replica[i] == d]
        cells = lpt_bins([lengths[i] for i in mine], num_microbatches, capacity=per_slice)
        for j in range(num_microbatches):
            members = [i for i, c in zip(mine, cells, strict=True) if c == j]
            for r, i in enumerate(members):
                order[j * per_mb + d * per_slice + r] = i
    return order


def item_keys(batch: Batch, modality: str) -> list[str]:
    """The keys of ``batch`` that hold one entry per item slot of ``modality``."""
    keys = [modality, f"has_{modality}", f"{modality}_grid", f"{modality}_tokens"]
    return [k for k in keys if k in batch]


def item_costs(batch: Batch, modality: str, hidden_size: int) -> list[float]:
    """The cost of each present item of ``modality`` in ``batch``, in item order.

    Args:
        batch: a collated micro-batch (host tensors).
        modality: ``"image"``, ``"audio"``.
        hidden_size: the encoder's hidden size (weighs attention against projections
            for native-resolution items).
    """
    mask = batch[f"has_{modality}"].bool()
    grid = batch.get(f"{modality}_grid")
    if grid is None:  # a fixed-size tower: every item the same tokens
        return [1.0] * int(mask.sum())
    t, h, w = grid[mask].double().unbind(-1)
    frame = h * w
    return (t * frame + t * frame * frame / (6.0 * hidden_size)).tolist()


def encoder_items(batch: Batch, modality: str, owners: Sequence[int], replica: int
                  ) -> Batch:
    """The item batch a replica encodes: its items of ``batch``, one per row.

    Args:
        batch: the whole micro-batch (host tensors).
        modality: the encoder's modality.
        owners: the replica of every present item, in item order (:func:`lpt_bins`).
        replica: this encoder replica.

    Returns:
        ``{key: [n, ...]}`` for the item keys, ``has_<modality>`` all true, and
        ``<modality>_sample``: each item's sample in the micro-batch.
    """
    mask = batch[f"has_{modality}"].bool()
    mine = torch.tensor(owners, dtype=torch.long) == replica
    sample = torch.nonzero(mask)[:, 0]
    out = {k: batch[k][mask][mine] for k in item_keys(batch, modality)}
    out[f"has_{modality}"] = torch.ones(int(mine.sum()), dtype=torch.bool)
    out[f"{modality}_sample"] = sample[mine]
    return out


def owner_keys(mask: torch.Tensor, owners: Sequence[int], modality: str) -> Batch:
    """Per item slot of a micro-batch: the replica encoding it and its row there.

    Args:
        mask: the micro-batch's presence ``[B]`` or ``[B, K]``.
        owners: the replica of every present item, in item order.
        modality: the encoder's modality.

    Returns:
        ``<modality>_owner`` and ``<modality>_owner_row``, shaped like ``mask`` (``-1``
        where no item is), to be sliced with the batch.
    """
    owner = torch.full(mask.shape, -1, dtype=torch.long)
    row = torch.full(mask.shape, -1, dtype=torch.long)
    own = torch.tensor(owners, dtype=torch.long)
    rows = torch.zeros_like(own)
    for replica in own.unique().tolist():
        picked = own == replica
        rows[picked] = torch.arange(int(picked.sum()))
    owner[mask.bool()] = own
    row[mask.bool()] = rows
    return {f"{modality}_owner": owner, f"{modality}_owner_row": row}


def balanced_items(batch: Batch, modality: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(replica, row)`` of each of a language slice's items, in item order (host).

    Args:
        batch: the language model's micro-batch slice (with :func:`owner_keys`' keys).
        modality: the encoder's modality.
    """
    owner = host_copy(batch, f"{modality}_owner")
    row = host_copy(batch, f"{modality}_owner_row")
    present = owner >= 0
    return owner[present], row[present]


def is_balanced(batch: Batch, modality: str) -> bool:
    """Whether a language slice's ``modality`` items were dealt by cost."""
    return f"{modality}_owner" in batch


def in_item_order(rows: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """A language slice's items, received grouped by encoding replica, in item order.

    Args:
        rows: ``[n, ...]`` rows: replicas in order, each replica's in item order.
        owner: the replica of each of the slice's items, in item order (``[n]``, host).

    Returns:
        ``rows`` in item order (an index, so gradients flow back to where they came from).
    """
    grouped = torch.sort(owner, stable=True).indices  # grouped position -> item
    where = torch.empty_like(grouped)
    where[grouped] = torch.arange(grouped.numel())
    return rows.index_select(0, where.to(rows.device))
