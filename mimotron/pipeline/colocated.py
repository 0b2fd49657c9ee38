"""The colocated bridge: modules on the same ranks with different TP/DP layouts.

When an encoder and the language model share ranks but slice the micro-batch
differently (e.g. vision DP 4 and language TP 2 x DP 2 on 4 ranks), each rank holds the
encoder output of its *encoder* slice but the language model needs the rows of its
*language* slice. ``ColocatedBridge`` is an autograd function over the (colocated)
world:

* forward — all-gather every rank's encoder rows (padded to a common row count; only
  TP rank 0 of each encoder replica is read, the others hold copies), reassemble the
  micro-batch in sample order, and narrow to this rank's language slice (fan-in is a
  gather, fan-out a narrow — the same code);
* backward — each rank puts its language-slice gradient, divided by the number of ranks
  that hold that same slice (the language TP copies, whose gradients are identical),
  into a zero tensor of the whole micro-batch; a world all-reduce SUM gives every rank
  the exact gradient of every row, and each rank keeps the rows of its encoder slice.

When every rank's two slices coincide, ``needed`` is False and tensors pass through.

``ColocatedTransport`` is the transport of a colocated layout, chosen instead of
:class:`~mimotron.pipeline.communicator.MultiModulePipelineCommunicator` once at setup:
it holds each edge's geometry (fixed for the run) and bridges encoder rows in-process.
Its collectives run inside autograd, so they count as module compute in the metrics.
An edge into a context-parallel language model (``context > 1``) uses
:mod:`mimotron.pipeline.colocated_cp` instead, which sends each rank only the rows of
its CP positions; an edge whose items are dealt by cost (``data.balance_encoders``) uses
:mod:`mimotron.pipeline.balanced_bridge`; every other edge keeps the all-gather bridge
above.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import accumulate

import torch
import torch.distributed as dist

from mimotron.data.balance import balanced_items
from mimotron.host_sync import host_copy
from mimotron.models.native_vision import real_rows, tokens_key
from mimotron.parallel.group_factory import create_groups
from mimotron.parallel.layout import Layout, bridge_group_ranks
from mimotron.pipeline.balanced_bridge import BalancedBridge
from mimotron.pipeline.colocated_cp import CPBridgeGeometry, cp_bridge, cp_bridge_geometry
from mimotron.pipeline.edges import Edge, slice_range


@dataclass(frozen=True)
class BridgeGeometry:
    """How one colocated edge slices a micro-batch, as seen from one rank."""

    world_size: int
    src_dp_of_rank: tuple[int, ...]  # encoder DP coordinate of every rank
    src_reader_ranks: tuple[int, ...]  # per encoder DP replica, the rank read (TP 0)
    src_slice: tuple[int, int]
    dst_slice: tuple[int, int]  # empty past the language model's first stage
    dst_copies: int  # ranks holding this rank's language slice
    needed: bool  # on every rank alike: the bridge is a world collective


def bridge_geometry(layout: Layout, edge: Edge, rank: int, mbs: int) -> BridgeGeometry:
    """Slices of both modules on ``rank`` and who holds what (pure).

    The bridge spans the encoder's ranks, ``[0, world)`` or, in the first-stage
    placement, the language model's first stage ``[0, world / pipeline)`` (the group's
    ranks are then the global ranks). Only the language model's first-stage ranks take
    rows; a rank of a later stage (a pipelined language model,
    :mod:`mimotron.pipeline.colocated_pipeline`) holding the encoder joins the
    collectives with an empty slice.
    """
    src, dst = layout.modules[edge.src], layout.modules[edge.dst]
    assert src.rank_offset == 0 and rank in src.ranks, "the bridge spans the encoder's ranks"
    world = src.size

    def dst_slice(r: int) -> tuple[int, int]:
        c = dst.coordinate(r)
        lo, hi = slice_range(mbs, dst.parallel.data, c["dp"])
        return (lo, hi) if c["pp"] == 0 else (lo, lo)

    src_dp = tuple(src.coordinate(r)["dp"] for r in range(world))
    readers = tuple(src.rank_at(dp=d) for d in range(src.parallel.data))
    src_slices = [slice_range(mbs, src.parallel.data, d) for d in src_dp]
    dst_slices = [dst_slice(r) for r in range(world)]
    copies = sum(1 for r in range(world) if dst_slices[r] == dst_slices[rank])
    needed = src_slices != dst_slices
    return BridgeGeometry(world, src_dp, readers, src_slices[rank],
                          dst_slices[rank] if needed else src_slices[rank], copies, needed)


def first_stage_group(layout: Layout, timeout: timedelta | None = None
                      ) -> dist.ProcessGroup | None:
    """The bridges' group of a first-stage placement (the language model's first stage,
    where every encoder sits); ``None`` otherwise (the bridges span the world).

    Collective over the world where a group is made: every rank calls it, in the same
    order of group creations.
    """
    ranks = bridge_group_ranks(layout)
    return create_groups([list(ranks)], timeout, desc="first_stage_bridge") if ranks else None


class ColocatedBridge(torch.autograd.Function):
    """Re-slice encoder rows from the encoder's DP layout to the language model's."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, mask: torch.Tensor, geo: BridgeGeometry,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:  # noqa: ANN001
        """``rows``: this rank's encoder output; ``mask``: presence over its src slice;
        ``group``: the encoder's ranks (``None``: the world)."""
        if mask.dim() > 1:  # packed rows (data.packing): [rows, K] -> items per row
            mask = mask.flatten(1).sum(1)
        masks = [torch.empty_like(mask) for _ in range(geo.world_size)]
        dist.all_gather(masks, mask.contiguous(), group=group)
        # Every rank's presence, read once (one device-to-host copy per bridge).
        present = torch.stack(masks).long().cpu().tolist()
        counts = [sum(m) for m in present]
        padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype,
                             device=rows.device)
        padded[:rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in range(geo.world_size)]
        dist.all_gather(gathered, padded, group=group)
        # The micro-batch in sample order: encoder replicas in DP order (TP 0 copy each).
        full_rows = torch.cat([gathered[r][:counts[r]] for r in geo.src_reader_ranks])
        before = list(accumulate(x for r in geo.src_reader_ranks for x in present[r]))
        lo, hi = geo.dst_slice
        first = before[lo - 1] if lo > 0 else 0
        last = before[hi - 1] if hi > lo else first
        src_lo = before[geo.src_slice[0] - 1] if geo.src_slice[0] > 0 else 0
        ctx.meta = (full_rows.shape, first, last, src_lo, rows.shape[0], geo.dst_copies)
        ctx.group = group
        return full_rows[first:last].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        shape, first, last, src_lo, n_src, copies = ctx.meta
        full = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        full[first:last] = grad / copies
        dist.all_reduce(full, group=ctx.group)
        return full[src_lo:src_lo + n_src].clone(), None, None, None


class ColocatedTransport:
    """Hands encoder rows to the language model on ranks that hold every module.

    Args:
        layout: a colocated placement (the first-stage one included).
        rank: this global rank.
        micro_batch_size: the global micro-batch size.
        edges: the module boundaries (``build_edges``); all colocated. A rank keeps those
            whose encoder it holds (in the first-stage placement, none past the first
            stage).
        group: the encoders' ranks when they are not the world (the first-stage
            placement: :func:`first_stage_group`); ``None``: the world.

    Raises:
        ValueError: ``layout`` is not colocated (use the pipeline communicator).
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, edges: list[Edge],
                 group: dist.ProcessGroup | None = None) -> None:
        if not layout.colocated:
            raise ValueError("ColocatedTransport needs a colocated layout; a split layout "
                             "uses MultiModulePipelineCommunicator")
        assert all(e.colocated for e in edges), "a colocated layout has split edges"
        self.group = group
        edges = [e for e in edges if rank in layout.modules[e.src].ranks]
        self.edges = edges
        self.geometry = {e.src: bridge_geometry(layout, e, rank, micro_batch_size)
                         for e in edges}
        self.replica = {e.src: layout.modules[e.src].coordinate(rank)["dp"] for e in edges}
        # Edges into a CP language model route rows by position instead (colocated_cp).
        self.cp_geometry: dict[str, CPBridgeGeometry] = {
            e.src: cp_bridge_geometry(layout, e, rank, micro_batch_size)
            for e in edges if layout.modules[e.dst].parallel.context > 1}

    def bridge(self, edge: Edge, rows: torch.Tensor, batch: dict[str, torch.Tensor],
               language_batch: dict[str, torch.Tensor] | None = None,
               placeholder_id: int | None = None) -> torch.Tensor:
        """This rank's language-slice rows of ``edge``'s encoder output (autograd-aware).

        Args:
            edge: the boundary the rows cross.
            rows: this rank's encoder output (one row per present sample).
            batch: the encoder's micro-batch slice on this rank (its presence mask, and
                its tokens for a CP language model).
            language_batch: the language model's micro-batch slice on this rank (its
                tokens); needed when the language model has context > 1.
            placeholder_id: ``edge``'s placeholder token id; needed likewise.

        Returns:
            ``[n, T, H]`` rows of the language slice's present samples, or, into a CP
            language model, ``[n_local, H]``: one row per placeholder at this rank's
            positions (the row contract of :mod:`mimotron.parallel.context_parallel`).
        """
        cp_geo = self.cp_geometry.get(edge.src)
        if cp_geo is not None:
            if language_batch is None or placeholder_id is None:
                raise ValueError(f"the bridge of {edge.src!r} into a context-parallel "
                                 "language model needs language_batch and placeholder_id")
            key = tokens_key(edge.modality)
            if key in batch:  # native resolution: the real slots only, one per placeholder
                real = real_rows(rows, host_copy(batch, f"has_{edge.modality}"),
                                 host_copy(batch, key))
                rows = rows.reshape(-1, rows.shape[-1])[real].unsqueeze(1)
            return cp_bridge(rows, batch["tokens"], language_batch["tokens"], placeholder_id,
                             cp_geo, self.group)
        geo = self.geometry[edge.src]
        if edge.balanced:  # items dealt by cost: any replica may hold any slice's rows
            if language_batch is None:
                raise ValueError(f"the bridge of {edge.src!r} with data.balance_encoders "
                                 "needs language_batch (its items' replicas and rows)")
            owner, row = balanced_items(language_batch, edge.modality)
            return BalancedBridge.apply(rows, owner, row, geo.src_reader_ranks,
                                        self.replica[edge.src], geo.dst_copies)
        if not geo.needed:
            return rows
        return ColocatedBridge.apply(rows, batch[f"has_{edge.modality}"], geo, self.group)

    def finish(self, forward_only: bool = False) -> None:
        """Nothing is in flight between steps (the bridge is synchronous)."""

    def set_timing(self, enabled: bool) -> None:
        """Nothing to time (see :meth:`pop_transfer_seconds`)."""

    def pop_transfer_seconds(self) -> float:
        """Always 0: the bridge's collectives run inside autograd and count as compute."""
        return 0.0
