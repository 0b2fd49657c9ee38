"""Point-to-point links: one process group per direction of every neighbour pair.

Under NCCL a process group runs a pair of ranks' point-to-point operations in issue
order on one stream, and a send completes only together with its receive. When one
group carries both directions between two ranks, a rank's send queued before its
receive waits for the peer's receive, which may itself be queued behind the peer's own
send: the two ranks wait on each other, although gloo (which buffers sends) runs the
same plan. Pipeline plans send as soon as a compute ends and receive just before the
compute that needs it (1F1B, the interleaved ring, encoders feeding the language
model), which is exactly that order.

So each *directed* link ``src -> dst`` gets a two-rank process group of its own: on it
``src`` only sends and ``dst`` only receives, in the same order (the plans keep each
channel's receives in the sender's order; :mod:`mimotron.pipeline.actions_check`). Every
stream then holds operations of one kind, a send never stands before a receive, and a
plan that completes with buffered sends completes under NCCL too. The cost is two
communicators per neighbour pair, created once at set-up. ``mimotron.commcheck``
replays every multi-rank test's communication under NCCL's rules to check it.

The links are a pure function of the layout (:func:`p2p_links`); every rank makes the
groups in one sorted order (:func:`build_link_groups`), a set of links sharing no rank
at a time (one world-wide split each, :mod:`mimotron.parallel.group_factory`), so the
world-wide operations grow with the links a rank has, not with the world's.
"""

from __future__ import annotations

from datetime import timedelta
from itertools import product

import torch.distributed as dist

from mimotron.parallel.group_factory import colour_sets, create_groups
from mimotron.parallel.layout import (
    Layout,
    ModulePlacement,
    is_colocated_pipeline,
    language_pipeline,
)
from mimotron.pipeline.edges import Edge, bridge_routes

Link = tuple[int, int]  # (sending rank, receiving rank)


def _stage_links(mod: ModulePlacement) -> set[Link]:
    """Stage ``s -> s + 1`` at every (TP, CP, DP) coordinate, and the interleaving ring."""
    par, out = mod.parallel, set()
    pp = par.pipeline
    if pp == 1:
        return out
    ring = par.virtual_pipeline > 1
    for tp, cp, dp in product(range(par.tensor), range(par.context), range(par.data)):
        ranks = [mod.rank_at(tp=tp, cp=cp, dp=dp, pp=s) for s in range(pp)]
        pairs = list(zip(ranks[:-1], ranks[1:], strict=True))
        pairs += [(ranks[-1], ranks[0])] if ring else []
        for a, b in pairs:
            out |= {(a, b), (b, a)}  # activations one way, gradients the other
    return out


def p2p_links(layout: Layout, micro_batch_size: int, edges: list[Edge]) -> list[Link]:
    """Every directed point-to-point link of a split layout, sorted.

    Args:
        layout: the placement of every module (non-colocated).
        micro_batch_size: the global micro-batch size (which replica pairs share
            samples at a module boundary).
        edges: the module boundaries (``build_edges``).
    """
    links: set[Link] = set()
    for mod in layout.modules.values():
        links |= _stage_links(mod)
    for edge in edges:
        if not edge.colocated:
            for src, dst, *_ in bridge_routes(layout, edge, micro_batch_size):
                links |= {(src, dst), (dst, src)}
    return sorted(links)


def transport_links(layout: Layout, micro_batch_size: int, edges: list[Edge]) -> list[Link]:
    """The links a layout's transport sends on (``build_transport``'s choice): a split
    layout's stages and bridges; a colocated layout's language stages where it is
    pipelined (its bridges are collectives), none otherwise.

    Args:
        layout: the placement of every module.
        micro_batch_size: the global micro-batch size.
        edges: the module boundaries (``build_edges``).
    """
    if is_colocated_pipeline(layout):
        return p2p_links(language_pipeline(layout), micro_batch_size, [])
    return [] if layout.colocated else p2p_links(layout, micro_batch_size, edges)


def build_link_groups(links: list[Link], rank: int, timeout: timedelta | None = None
                      ) -> dict[Link, dist.ProcessGroup]:
    """One process group per link (collective: every rank calls it with the same links).

    Returns:
        This rank's links (as sender or receiver) and their groups.
    """
    mine = {}
    for links_of_set in colour_sets(links):  # disjoint links: one split each
        group = create_groups([sorted(link) for link in links_of_set], timeout, "p2p link")
        for src, dst in links_of_set:
            if rank in (src, dst):
                mine[(src, dst)] = group
    return mine
