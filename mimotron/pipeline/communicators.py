"""The communicators a rank joins, counted from the layout alone, and the device memory
the plan reserves for their buffers.

NCCL gives every communicator a rank joins its own buffers on the device (per channel
and peer, ``NCCL_BUFFSIZE`` each way), allocated outside PyTorch's caching allocator,
so no tensor tracker sees them. :func:`communicators_of` counts a rank's communicators
as training creates them: the world's, one per distinct group set of each module the
rank holds that has the rank in a group of two or more (its TP, CP, PP, DP, expert and
embedding groups: :mod:`mimotron.parallel.groups`, a set shared by two kinds counted
once, as the grid shares it) and one per directed point-to-point link it sends or
receives on (:mod:`mimotron.pipeline.links`). ``mimotron plan`` adds ``count x
NCCL_BUFFER_BYTES`` to each rank's estimate (``--nccl-buffer-mib`` overrides the figure).

``NCCL_BUFFER_BYTES`` is a nominal figure, not a measurement: NCCL's default
``NCCL_BUFFSIZE`` of 4 MiB, for sending and receiving, over 16 channels (what NCCL
commonly opens within an NVLink node). Communicators that use fewer channels, or a
``NCCL_BUFFSIZE`` set lower, need less; ``NCCL_NVLS_ENABLE`` and user buffer
registration add their own.
"""

from __future__ import annotations

from mimotron.parallel.groups import build_module_grid, group_sets
from mimotron.parallel.layout import Layout, bridge_group_ranks
from mimotron.pipeline.edges import build_edges
from mimotron.pipeline.links import transport_links

__all__ = ["NCCL_BUFFER_BYTES", "communicators_of"]

NCCL_BUFFER_BYTES = 4 * 2**20 * 2 * 16
"""Device bytes reserved per communicator: 4 MiB ``NCCL_BUFFSIZE`` x 2 ways x 16
channels (128 MiB)."""


def _module_group_sets(layout: Layout, rank: int) -> int:
    """Distinct group sets of the rank's modules with the rank in a group of 2 or more."""
    count = 0
    for placement in layout.modules.values():
        if rank not in placement.ranks:
            continue
        sets = group_sets(build_module_grid(placement.parallel)).values()
        distinct = {tuple(tuple(g) for g in s) for s in sets}
        count += sum(any(rank in g and len(g) > 1 for g in s) for s in distinct)
    return count


def _links(layout: Layout, rank: int, micro_batch_size: int, balanced: bool) -> int:
    """Directed point-to-point links the rank sends or receives on."""
    modality = {name: name for name in layout.modules}  # routes ignore the modality
    edges = build_edges(layout, modality, balanced)
    return sum(rank in link for link in transport_links(layout, micro_batch_size, edges))


def communicators_of(layout: Layout, rank: int, micro_batch_size: int,
                     balanced: bool = False) -> int:
    """The communicators ``rank`` joins: the world's, its modules' group sets, the
    first-stage placement's bridge group and its point-to-point links.

    Args:
        layout: the placement.
        rank: a global rank.
        micro_batch_size: the global micro-batch size (which bridge pairs exchange).
        balanced: ``data.balance_encoders`` (every encoder replica then sends to every
            language replica).
    """
    return (1 + _module_group_sets(layout, rank) + _bridge_group(layout, rank)
            + _links(layout, rank, micro_batch_size, balanced))


def _bridge_group(layout: Layout, rank: int) -> int:
    """1 on the ranks of a first-stage placement's bridge group (of 2 ranks or more)."""
    ranks = bridge_group_ranks(layout)
    return int(rank in ranks and len(ranks) > 1)
