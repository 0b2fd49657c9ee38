"""Stand-ins for an MoE layer's routing counts in the fake-device dry run.

Expert routing reads how many (token, choice) pairs go to each expert
(:data:`mimotron.host_sync.EXPERT_COUNTS`): counts of the router's choices, computed
from parameters, which a fake tensor has no value for. They size the expert-parallel
exchanges and the grouped expert call, so a stand-in must add up: the dry run answers
a *balanced* routing in which every rank routes like this one. Each row of the table
(this rank's counts per global expert, and each received table laid out ``[source
rank, local expert]``) splits the rank's ``total`` choices evenly over the experts (the
first ``total mod E`` get one more). What a rank receives from a peer then equals what
it sends to that peer, so the dispatch and the combine exchange rows of the shapes a
real step would, and the grouped call gets as many rows as the counts say.
"""

from __future__ import annotations


def balanced_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts that differ by at most one, summing to it.

    Args:
        total: the number to split (>= 0).
        parts: how many counts (>= 1).

    Returns:
        ``parts`` counts, the larger ones first.
    """
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def routing_counts(shape: tuple[int, ...], total: int | None) -> list:
    """The stand-in value of an :data:`~mimotron.host_sync.EXPERT_COUNTS` read.

    Args:
        shape: the read table's shape: ``[E]`` (one rank's counts per expert) or
            ``[rows, E]`` (this rank's counts, then tables received, flattened to ``E``).
        total: the (token, choice) pairs this rank routed.

    Returns:
        ``tensor.tolist()`` of the table: every row the balanced split of ``total``.

    Raises:
        ValueError: the read gave no ``total`` or the shape is not a count table (the
            tracker raises it as its ``DryRunError``).
    """
    if total is None or len(shape) not in (1, 2) or shape[-1] < 1:
        raise ValueError(f"a {list(shape)} read of expert routing counts without the total "
                         "its stand-in must add up to (host_sync.to_host(..., total=))")
    row = balanced_split(total, shape[-1])
    return row if len(shape) == 1 else [list(row) for _ in range(shape[0])]
