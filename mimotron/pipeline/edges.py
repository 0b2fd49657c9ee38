"""The module DAG's boundaries and the sample slices of DP replicas (pure layout helpers).

Both transports build on these: the non-colocated communicator
(:mod:`mimotron.pipeline.communicator`) sends along the bridge routes between replicas
whose slices intersect (:func:`bridge_routes`, whose links
:mod:`mimotron.pipeline.links` gives a process group each), and the colocated transport
(:mod:`mimotron.pipeline.colocated`) re-slices rows between DP layouts on shared ranks.
Neither transport imports the other; both import this file. The data provider uses
``slice_range`` to cut each module's micro-batch slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimotron.parallel.layout import Layout, ModulePlacement


@dataclass(frozen=True)
class Edge:
    """One module boundary of the DAG (an encoder feeding the language model)."""

    src: str
    dst: str
    modality: str
    colocated: bool
    balanced: bool = False
    """Items dealt to the encoder's replicas by cost (``data.balance_encoders``): any
    encoder replica may hold rows of any language replica's samples."""


def slice_range(mbs: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Sample range ``[start, end)`` of a DP replica inside a micro-batch."""
    per = mbs // dp_size
    return dp_rank * per, (dp_rank + 1) * per


def build_edges(layout: Layout, modality_of: dict[str, str], balanced: bool = False
                ) -> list[Edge]:
    """The module boundaries of the DAG, in config order (``balanced``: every edge's
    items dealt by cost, ``data.balance_encoders``)."""
    edges = []
    for src, dsts in layout.topology.items():
        for dst in dsts:
            # Shared ranks (colocated, or the encoder on the destination's first stage).
            edges.append(Edge(src, dst, modality_of[src], layout.colocated, balanced))
    return edges


def bridge_pairs(layout: Layout, edge: Edge, mbs: int) -> list[tuple[int, int, int, int]]:
    """``(src leader, dst leader, start, end)`` for each replica pair sharing samples."""
    return [(s, d, lo, hi) for s, d, lo, hi, cp in bridge_routes(layout, edge, mbs) if cp == 0]


def bridge_routes(layout: Layout, edge: Edge, mbs: int
                  ) -> list[tuple[int, int, int, int, int]]:
    """``(src leader, dst leader, start, end, dst cp rank)`` of every bridge transfer.

    One route per replica pair sharing samples and per context-parallel coordinate of
    the destination (its first stage's TP-0 rank at that coordinate): a CP rank
    receives only the rows of the placeholders among its positions. Routes of one
    pair are consecutive, in CP order; without CP they are :func:`bridge_pairs`. On a
    balanced edge every replica pair has a route (an encoder replica may encode items
    of any sample) and ``[start, end)`` is the destination's slice.
    """
    src, dst = layout.modules[edge.src], layout.modules[edge.dst]
    out = []
    for i in range(src.parallel.data):
        a0, a1 = (0, mbs) if edge.balanced else slice_range(mbs, src.parallel.data, i)
        for j in range(dst.parallel.data):
            b0, b1 = slice_range(mbs, dst.parallel.data, j)
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                for r in range(dst.parallel.context):
                    out.append((_leader(src, i, last=True), _leader(dst, j, last=False, cp=r),
                                lo, hi, r))
    return out


def _leader(mod: ModulePlacement, dp_rank: int, last: bool, cp: int = 0) -> int:
    """The rank that talks across a boundary for one DP replica (TP 0, edge stage)."""
    return mod.rank_at(cp=cp, dp=dp_rank, pp=mod.parallel.pipeline - 1 if last else 0)
