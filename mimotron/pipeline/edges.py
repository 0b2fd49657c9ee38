"""The module DAG's boundaries and the sample slices of DP replicas (pure layout helpers).

Both transports build on these: the non-colocated communicator
(:mod:`mimotron.pipeline.communicator`) pairs replicas whose slices intersect, and the
colocated transport (:mod:`mimotron.pipeline.colocated`) re-slices rows between DP
layouts on shared ranks. Neither transport imports the other; both import this file.
The data provider uses ``slice_range`` to cut each module's micro-batch slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimotron.parallel.layout import Layout


@dataclass(frozen=True)
class Edge:
    """One module boundary of the DAG (an encoder feeding the language model)."""

    src: str
    dst: str
    modality: str
    colocated: bool


def slice_range(mbs: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Sample range ``[start, end)`` of a DP replica inside a micro-batch."""
    per = mbs // dp_size
    return dp_rank * per, (dp_rank + 1) * per


def build_edges(layout: Layout, modality_of: dict[str, str]) -> list[Edge]:
    """The module boundaries of the DAG, in config order."""
    edges = []
    for src, dsts in layout.topology.items():
        for dst in dsts:
            a, b = layout.modules[src], layout.modules[dst]
            colocated = a.rank_offset == b.rank_offset and a.size == b.size
            edges.append(Edge(src, dst, modality_of[src], colocated))
    return edges
