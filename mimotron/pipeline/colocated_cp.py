"""The colocated bridge into a context-parallel language model.

With ``modules.language.parallel.context = c > 1`` in a colocated placement, language
rank ``q`` (CP coordinate ``r``) needs, per encoder, only the encoder rows of the
placeholders at *its* positions (the row contract of
:mod:`mimotron.parallel.context_parallel`): ``flat[placeholder_selection(tokens, pid, c,
r)]`` where ``flat`` is the encoder output of its language slice flattened to one row
per placeholder token. Every rank holds the tokens of both its encoder slice and its
language slice, so both ends of every transfer compute its size from tokens alone — no
counts are exchanged.

``ColocatedCPBridge`` is an autograd function over the (colocated) world, one
``all_to_all_single`` with variable splits each way:

* forward — the reader of each encoder replica (the rank at TP 0, CP 0 of the encoder;
  its TP copies hold the same rows) sends every rank ``q`` the rows of the samples in
  ``q``'s language slice ∩ the replica's encoder slice whose placeholders lie in ``q``'s
  CP positions, in row-major order. Readers are in DP order (rank order), so ``q``'s
  received rows are exactly its contract rows, in order. Other ranks send nothing.
* backward — only language TP rank 0 of each (DP, CP) slot sends (its TP copies hold
  identical gradients; this counts each once, exactly, without dividing): every rank of
  encoder replica ``e`` (all its TP copies run the encoder backward) receives the
  gradient of the rows it was sent for. Each placeholder row lives in exactly one
  (language DP, CP) slot, so the pieces tile the encoder rows: they are copied into a
  zero tensor, no sum is needed.

Every rank issues both collectives, with zero splits where it has nothing to send or
receive (docs/design.md, "Collective ordering"). The route (indices and splits) is a
pure function of the tokens (:func:`plan_route`), computed per micro-batch; the
geometry (who holds which slice) is fixed for the run (:func:`cp_bridge_geometry`).
:class:`~mimotron.pipeline.colocated.ColocatedTransport` uses this bridge whenever the
destination has context > 1; layouts without CP keep the all-gather bridge (bitwise
unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimotron.parallel.context_parallel import position_membership
from mimotron.parallel.layout import Layout
from mimotron.pipeline.edges import Edge, slice_range


@dataclass(frozen=True)
class CPBridgeGeometry:
    """Who holds what on a colocated edge into a CP language model (fixed for a run).

    Per-rank tuples are indexed by the bridge's ranks: the encoder's, which start at
    global rank 0 (the world, or the language model's first stage), so by global rank.
    """

    rank: int
    cp_size: int  # the language model's CP degree
    src_slices: tuple[tuple[int, int], ...]  # encoder sample slice of every rank
    src_dp: tuple[int, ...]  # encoder DP coordinate of every rank
    dst_slices: tuple[tuple[int, int], ...]  # language sample slice of every rank
    dst_cp: tuple[int, ...]  # language CP coordinate of every rank
    readers: tuple[int, ...]  # per encoder DP replica (DP order), the rank that sends
    grad_senders: tuple[bool, ...]  # language TP rank 0: sends gradients back

    @property
    def world_size(self) -> int:
        return len(self.src_dp)


def cp_bridge_geometry(layout: Layout, edge: Edge, rank: int, mbs: int) -> CPBridgeGeometry:
    """The geometry of a colocated edge into a CP language model, seen from ``rank`` (pure).

    The bridge spans the encoder's ranks: the world, or in the first-stage placement
    the language model's first stage, whose ranks all take rows.

    Args:
        layout: a colocated placement (the first-stage one included).
        edge: an encoder -> language boundary.
        rank: this global rank.
        mbs: the global micro-batch size (rows when packing).
    """
    src, dst = layout.modules[edge.src], layout.modules[edge.dst]
    assert src.rank_offset == 0 and rank in src.ranks, "the bridge spans the encoder's ranks"
    world = src.ranks
    src_coord = [src.coordinate(r) for r in world]
    dst_coord = [dst.coordinate(r) for r in world]
    readers = tuple(src.rank_at(dp=d) for d in range(src.parallel.data))
    # Received rows are concatenated in sender (rank) order; they must be in sample order.
    assert list(readers) == sorted(readers), "encoder readers must be in DP order"
    return CPBridgeGeometry(
        rank=rank,
        cp_size=dst.parallel.context,
        src_slices=tuple(slice_range(mbs, src.parallel.data, c["dp"]) for c in src_coord),
        src_dp=tuple(c["dp"] for c in src_coord),
        dst_slices=tuple(slice_range(mbs, dst.parallel.data, c["dp"]) for c in dst_coord),
        dst_cp=tuple(c["cp"] for c in dst_coord),
        readers=readers,
        grad_senders=tuple(c["tp"] == 0 for c in dst_coord),
    )


@dataclass(frozen=True)
class Route:
    """One micro-batch's transfers on this rank (indices and splits, per global rank)."""

    fwd_send_index: torch.Tensor  # flat encoder rows sent, destination after destination
    fwd_send_splits: list[int]
    fwd_recv_splits: list[int]
    bwd_send_index: torch.Tensor  # received-row gradients sent back, rank after rank
    bwd_send_splits: list[int]
    bwd_recv_splits: list[int]
    bwd_recv_index: torch.Tensor  # flat encoder rows the returned gradients belong to
    num_flat_rows: int


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return lo, max(lo, hi)


class _Placeholders:
    """The placeholder tokens of one slice, in row-major order (= flat row order)."""

    def __init__(self, tokens: torch.Tensor, placeholder_id: int, first_sample: int,
                 cp_size: int) -> None:
        where = (tokens == placeholder_id).nonzero()
        self.sample = where[:, 0] + first_sample  # micro-batch sample index of each row
        self.position = where[:, 1]
        self.seq_len, self.cp_size = tokens.shape[1], cp_size

    def rows(self, samples: tuple[int, int], cp_rank: int) -> torch.Tensor:
        """Flat row indices of ``samples``' placeholders at ``cp_rank``'s positions."""
        held = position_membership(self.seq_len, self.cp_size, cp_rank, self.position.device)
        keep = (self.sample >= samples[0]) & (self.sample < samples[1]) & held[self.position]
        return keep.nonzero().flatten()


def plan_route(geo: CPBridgeGeometry, src_tokens: torch.Tensor, dst_tokens: torch.Tensor,
               placeholder_id: int, num_flat_rows: int) -> Route:
    """The transfers of one micro-batch, from the tokens of this rank's two slices (pure).

    Args:
        geo: the edge's geometry on this rank.
        src_tokens: ``[B_src, S]`` tokens of this rank's encoder slice.
        dst_tokens: ``[B_dst, S]`` tokens of this rank's language slice.
        placeholder_id: the encoder's placeholder token id.
        num_flat_rows: this rank's encoder output rows, flattened (``N * T``).

    Raises:
        ValueError: the encoder output does not have one row per placeholder token.
    """
    me, world, device = geo.rank, range(geo.world_size), src_tokens.device
    # Index bookkeeping on the host: the splits are host ints anyway, and one copy of
    # each slice's tokens replaces a device sync per destination.
    src_tokens, dst_tokens = src_tokens.cpu(), dst_tokens.cpu()
    src = _Placeholders(src_tokens, placeholder_id, geo.src_slices[me][0], geo.cp_size)
    if num_flat_rows != src.sample.numel():
        raise ValueError(
            f"the encoder output has {num_flat_rows} rows (flattened) but its slice's tokens "
            f"hold {src.sample.numel()} placeholders (id {placeholder_id}); the CP bridge "
            "needs one row per placeholder token")
    dst = _Placeholders(dst_tokens, placeholder_id, geo.dst_slices[me][0], geo.cp_size)
    # As encoder: the rows each destination needs from this rank's replica.
    to = [src.rows(_intersect(geo.src_slices[me], geo.dst_slices[q]), geo.dst_cp[q])
          for q in world]
    # As language rank: how many rows come from each encoder replica, in sample order.
    per_replica = [int(dst.rows(_intersect(geo.src_slices[r], geo.dst_slices[me]),
                                geo.dst_cp[me]).numel()) for r in geo.readers]
    offsets = [sum(per_replica[:e]) for e in range(len(per_replica))]
    reader, grad_sender = me in geo.readers, geo.grad_senders[me]
    empty = torch.zeros(0, dtype=torch.long)
    # Gradients go back to every rank of a replica (its TP copies all run the encoder).
    segment = [(offsets[e], offsets[e] + per_replica[e]) for e in geo.src_dp]
    back = [torch.arange(lo, hi) for lo, hi in segment]
    return Route(
        fwd_send_index=(torch.cat([empty, *to]) if reader else empty).to(device),
        fwd_send_splits=[int(t.numel()) if reader else 0 for t in to],
        fwd_recv_splits=[per_replica[geo.src_dp[p]] if p in geo.readers else 0 for p in world],
        bwd_send_index=(torch.cat([empty, *back]) if grad_sender else empty).to(device),
        bwd_send_splits=[int(t.numel()) if grad_sender else 0 for t in back],
        bwd_recv_splits=[int(to[q].numel()) if geo.grad_senders[q] else 0 for q in world],
        bwd_recv_index=torch.cat([empty, *(to[q] for q in world if geo.grad_senders[q])]
                                 ).to(device),
        num_flat_rows=num_flat_rows,
    )


class ColocatedCPBridge(torch.autograd.Function):
    """Route encoder rows to the CP language ranks whose positions hold their placeholders."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, route: Route,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:  # noqa: ANN001
        """``rows``: this rank's encoder output ``[N, T, H]``; returns ``[n_local, H]``;
        ``group``: the bridge's ranks (``None``: the world)."""
        flat = rows.reshape(-1, rows.shape[-1])
        send = flat.index_select(0, route.fwd_send_index)
        out = flat.new_empty((sum(route.fwd_recv_splits), flat.shape[1]))
        dist.all_to_all_single(out, send, route.fwd_recv_splits, route.fwd_send_splits,
                               group=group)
        ctx.route, ctx.rows_shape, ctx.group = route, rows.shape, group
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        route = ctx.route
        send = grad.contiguous().index_select(0, route.bwd_send_index)
        recv = grad.new_empty((sum(route.bwd_recv_splits), grad.shape[1]))
        dist.all_to_all_single(recv, send, route.bwd_recv_splits, route.bwd_send_splits,
                               group=ctx.group)
        # The pieces tile the encoder rows (each lives in one language DP x CP slot).
        full = grad.new_zeros((route.num_flat_rows, grad.shape[1]))
        full.index_copy_(0, route.bwd_recv_index, recv)
        return full.reshape(ctx.rows_shape), None, None


def cp_bridge(rows: torch.Tensor, src_tokens: torch.Tensor, dst_tokens: torch.Tensor,
              placeholder_id: int, geo: CPBridgeGeometry,
              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's contract rows of an encoder's output (autograd-aware).

    Args:
        rows: this rank's encoder output ``[N, T, H]`` (one block per present sample or
            packed item of its encoder slice).
        src_tokens: ``[B_src, S]`` tokens of this rank's encoder slice.
        dst_tokens: ``[B_dst, S]`` tokens of this rank's language slice.
        placeholder_id: the encoder's placeholder token id.
        geo: the edge's geometry on this rank.
        group: the bridge's ranks (``None``: the world).

    Returns:
        ``[n_local, H]``: ``flat[placeholder_selection(dst_tokens, placeholder_id, c, r)]``
        of the language slice's encoder output, ``r`` this rank's CP coordinate.
    """
    num_flat = math.prod(rows.shape[:-1])
    route = plan_route(geo, src_tokens, dst_tokens, placeholder_id, num_flat)
    return ColocatedCPBridge.apply(rows, route, group)
