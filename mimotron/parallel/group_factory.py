"""Process groups made a kind at a time: one world-wide operation per set of disjoint
groups, not one per group.

``torch.distributed.new_group`` is collective over the whole world: every rank calls it
for every group, in one order, and with NCCL eagerly initialised (the default group bound
to a device, as :func:`~mimotron.runtime.init_runtime` binds it) each call is a
world-wide ``ncclCommSplit`` that ranks outside the group join with no colour. A layout
of 4,096 ranks has thousands of groups (its TP, DP, PP groups and two point-to-point
links per pipeline neighbour pair), so as many world-wide operations at start-up.

``torch.distributed.split_group`` makes a whole set of *disjoint* groups (every TP group
of a module, say) in one split of the world communicator: :func:`create_groups` uses it
where the default group's backend splits (NCCL bound to a device). Point-to-point links
overlap (a rank has a link to each neighbour, both ways), so :func:`colour_sets` deals
them into sets of disjoint links first: the operations then grow with a rank's number
of links (a few), not with the world's.

Elsewhere (gloo on a CPU, the fake backend of dry runs) ``split_group`` is not available;
:func:`emulated_split_group` keeps its contract (every world rank calls it with the same
split, and a rank gets the group holding it, or ``None``) with one ``new_group`` per
group, made by every rank in order: gloo connects only a group's members, so this costs
a non-member nothing but the call. (``new_group(use_local_synchronization=True)``, where
only members call, cannot stand in: torch names such a group from the number of groups
the calling process already holds, which differs between ranks that join different
groups.) The tests run this path, and ``tests/test_group_factory.py`` checks what a real
split needs: every rank issues the same splits in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["SplitGroup", "colour_sets", "create_groups", "emulated_split_group",
           "groups_one_at_a_time", "splits_natively"]

SplitGroup = Callable[..., ProcessGroup | None]
"""``split_group(parent_pg=None, split_ranks=..., timeout=..., group_desc=...)``."""


def splits_natively() -> bool:
    """Whether ``torch.distributed.split_group`` serves this world: a default group bound
    to a device whose backend can split its communicator (NCCL)."""
    default = dist.distributed_c10d._get_default_group()
    device = default.bound_device_id
    if device is None:
        return False
    try:
        backend = default._get_backend(device)
    except RuntimeError:  # no backend for that device type
        return False
    return bool(getattr(backend, "supports_splitting", False))


def check_split(split_ranks: Sequence[Sequence[int]], world_size: int) -> None:
    """``split_group``'s rules for ``split_ranks``: non-empty, disjoint groups of ranks of
    the world.

    Raises:
        ValueError: an empty group, a rank twice, or a rank outside ``[0, world_size)``.
    """
    flat = [r for group in split_ranks for r in group]
    if not split_ranks or not all(split_ranks):
        raise ValueError(f"split_ranks={split_ranks!r} is invalid: expected non-empty groups")
    if len(set(flat)) != len(flat):
        raise ValueError(f"split_ranks={split_ranks!r} is invalid: expected disjoint groups")
    if not all(0 <= r < world_size for r in flat):
        raise ValueError(f"split_ranks={split_ranks!r} is invalid: expected ranks in "
                         f"[0, {world_size})")


def emulated_split_group(parent_pg: ProcessGroup | None = None,
                         split_ranks: Sequence[Sequence[int]] | None = None,
                         timeout: timedelta | None = None, pg_options: Any = None,
                         group_desc: str | None = None) -> ProcessGroup | None:
    """``split_group``'s contract where the backend cannot split (gloo, fake).

    Args:
        parent_pg: must be ``None`` (the world), as every caller here splits the world.
        split_ranks: disjoint groups of world ranks (:func:`check_split`).
        timeout: the new group's timeout.
        pg_options: the backend's options, as ``new_group`` takes them.
        group_desc: a description for logs.

    Returns:
        The group holding this rank, or ``None``.
    """
    assert parent_pg is None, "the emulation splits the world only"
    assert split_ranks is not None
    check_split(split_ranks, dist.get_world_size())
    options: dict[str, Any] = {"pg_options": pg_options} if pg_options is not None else {}
    return groups_one_at_a_time(split_ranks, timeout, group_desc, **options)


def groups_one_at_a_time(groups: Sequence[Sequence[int]], timeout: timedelta | None = None,
                         desc: str | None = None, **options: Any) -> ProcessGroup | None:
    """Each group by its own ``new_group``, every rank calling it for every group in order
    (``new_group``'s contract): where no split serves (gloo, another backend, options).

    Args:
        groups: disjoint groups of world ranks.
        timeout: their timeout.
        desc: a description for logs.
        **options: ``new_group``'s other arguments (``backend``, ``pg_options``).

    Returns:
        The group holding this rank, or ``None``.
    """
    me, mine = dist.get_rank(), None
    for group in groups:
        pg = dist.new_group(sorted(group), timeout=timeout, group_desc=desc, **options)
        if me in group:
            assert mine is None, f"rank {me} is in two groups of {groups}"
            mine = pg
    return mine


def create_groups(groups: Sequence[Sequence[int]], timeout: timedelta | None = None,
                  desc: str | None = None, split: SplitGroup | None = None
                  ) -> ProcessGroup | None:
    """Make a set of disjoint groups in one world-wide operation; collective over the
    world (every rank calls it with the same ``groups``, in the same order of calls).

    Args:
        groups: disjoint groups of world ranks.
        timeout: their timeout (``None``: the backend's default).
        desc: a description for logs (``group_desc``).
        split: the split to use (default: ``split_group`` where the backend splits,
            :func:`emulated_split_group` elsewhere).

    Returns:
        The group holding this rank, or ``None``.
    """
    check_split(groups, dist.get_world_size())
    if split is None:
        split = dist.split_group if splits_natively() else emulated_split_group
    return split(parent_pg=None, split_ranks=[sorted(g) for g in groups], timeout=timeout,
                 group_desc=desc)


def colour_sets(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Deal directed links into sets whose links share no rank, in order (greedy: each
    link goes to the first set where neither of its ranks is taken).

    Both directions of a pair land in different sets, so each gets a group of its own.
    The number of sets is at most twice the most links any rank has, minus one.
    """
    sets: list[list[tuple[int, int]]] = []
    taken: list[set[int]] = []
    for pair in pairs:
        a, b = pair
        for members, used in zip(sets, taken, strict=True):
            if a not in used and b not in used:
                members.append(pair)
                used.update(pair)
                break
        else:
            sets.append([pair])
            taken.append({a, b})
    return sets
