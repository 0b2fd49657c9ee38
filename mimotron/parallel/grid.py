"""A named N-D grid of ranks, the groups along any set of its dims, and DeviceMesh views.

Follows Megatron-Core's ``HyperCommGrid`` convention: the grid covers the contiguous
ranks ``[rank_offset, rank_offset + prod(shape))`` and the FIRST dim name varies fastest,
so ``rank = rank_offset + sum(coord[i] * stride[i])`` with ``stride[i] = prod(shape[:i])``.
With dims ``["tp", "cp", "dp", "pp"]`` neighbouring ranks are tensor-parallel peers.

Group creation (``create_pg``, ``create_custom_pg``, ``to_device_mesh`` with groups
missing) is collective over the WHOLE world: each call makes its whole set of disjoint
groups in one split of the world (:func:`~mimotron.parallel.group_factory.create_groups`),
so every rank must make the same calls in the same order, even ranks outside this grid.
Enumeration (``get_rank_enum``, ``get_coordinate``) is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from mimotron.parallel.group_factory import create_groups, groups_one_at_a_time

BASE_VIEW = "base"

# Cache key of a group set: (view name, dims in that view's grid order).
_Key = tuple[str, tuple[str, ...]]
# A group set by membership: the rank tuples of all its groups.
_Members = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class _View:
    """One factorisation of the grid's ranks into named dims (first dim fastest)."""

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    shared_dims: tuple[str, ...]

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[:i]) for i in range(len(self.shape)))

    def stride_of(self, dim: str) -> int:
        return self.strides[self.dim_names.index(dim)]

    def size_of(self, dim: str) -> int:
        return self.shape[self.dim_names.index(dim)]


def _check_shape(shape: list[int], dim_names: list[str], what: str) -> None:
    if len(shape) == 0:
        raise ValueError(f"{what}: shape must have at least one dim, got {shape}")
    if len(shape) != len(dim_names):
        raise ValueError(
            f"{what}: shape {shape} and dim_names {dim_names} must have the same length"
        )
    for name, size in zip(dim_names, shape, strict=True):
        if not isinstance(size, int) or size < 1:
            raise ValueError(
                f"{what}: shape entry for dim {name!r} must be an int >= 1, got {size!r}"
            )
    if len(set(dim_names)) != len(dim_names):
        raise ValueError(f"{what}: dim_names must be unique, got {dim_names}")


class HyperCommGrid:
    """A named N-D rank grid over ``[rank_offset, rank_offset + prod(shape))``.

    Args:
        shape: size of each dim, e.g. ``[tp, cp, dp, pp]``.
        dim_names: name of each dim; the first varies fastest over ranks.
        rank_offset: first global rank of the grid.
        backend: backend for the groups this grid creates (``None`` = the world's).
        timeout: timeout of those groups; ``None`` = torch's default for new groups
            (30 min, not the world group's timeout), so pass the run's timeout here.

    Raises:
        ValueError: a non-positive size, ``shape``/``dim_names`` length mismatch,
            duplicate names, or a negative ``rank_offset``.
    """

    def __init__(
        self,
        shape: list[int],
        dim_names: list[str],
        rank_offset: int = 0,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        _check_shape(list(shape), list(dim_names), "HyperCommGrid")
        if rank_offset < 0:
            raise ValueError(f"HyperCommGrid: rank_offset must be >= 0, got {rank_offset}")
        self._views: dict[str, _View] = {
            BASE_VIEW: _View(tuple(shape), tuple(dim_names), tuple(dim_names))
        }
        self.rank_offset = rank_offset
        self.backend = backend
        self.timeout = timeout
        self._pgs: dict[_Key, ProcessGroup | None] = {}
        self._custom_pgs: dict[str, ProcessGroup | None] = {}
        # Groups with identical members are one object: a second copy would only double
        # the communicators (and gloo's connection set-up) for nothing.
        self._pg_by_members: dict[_Members, ProcessGroup | None] = {}

    @property
    def shape(self) -> list[int]:
        """Sizes of the base view's dims."""
        return list(self._views[BASE_VIEW].shape)

    @property
    def dim_names(self) -> list[str]:
        """Names of the base view's dims, fastest first."""
        return list(self._views[BASE_VIEW].dim_names)

    @property
    def size(self) -> int:
        """Number of ranks in the grid."""
        return math.prod(self._views[BASE_VIEW].shape)

    @property
    def rank_range(self) -> range:
        """The global ranks of the grid."""
        return range(self.rank_offset, self.rank_offset + self.size)

    @property
    def views(self) -> list[str]:
        """Names of the registered views, the base view first."""
        return list(self._views)

    def view_dim_names(self, view: str | None = None) -> list[str]:
        """Names of a view's dims, fastest first (``None`` = base view)."""
        return list(self._view(view).dim_names)

    def register_view(
        self, name: str, shape: list[int], dim_names: list[str], shared_dims: list[str]
    ) -> None:
        """Add a second factorisation of the same ranks, e.g. the expert view.

        Args:
            name: view name used as ``view=`` in the other methods.
            shape: sizes of the view's dims; their product must equal ``size``.
            dim_names: names of the view's dims, fastest first.
            shared_dims: dims present in both views with the same size and stride, hence
                the same groups; their process groups are shared objects.

        Raises:
            ValueError: duplicate view name, bad shape, or a shared dim that differs.
        """
        if name in self._views:
            raise ValueError(f"register_view: view {name!r} already exists")
        _check_shape(list(shape), list(dim_names), f"register_view({name!r})")
        view = _View(tuple(shape), tuple(dim_names), tuple(shared_dims))
        if math.prod(view.shape) != self.size:
            raise ValueError(
                f"register_view({name!r}): prod(shape) = {math.prod(view.shape)} must equal "
                f"the grid size {self.size} (base shape {self.shape})"
            )
        base = self._views[BASE_VIEW]
        for dim in shared_dims:
            if dim not in base.dim_names or dim not in view.dim_names:
                raise ValueError(
                    f"register_view({name!r}): shared dim {dim!r} must be in both the base "
                    f"dims {base.dim_names} and the view dims {view.dim_names}"
                )
            if (base.size_of(dim), base.stride_of(dim)) != (view.size_of(dim), view.stride_of(dim)):
                raise ValueError(
                    f"register_view({name!r}): shared dim {dim!r} has size/stride "
                    f"{view.size_of(dim)}/{view.stride_of(dim)} in the view but "
                    f"{base.size_of(dim)}/{base.stride_of(dim)} in the base view"
                )
        self._views[name] = view

    def _view(self, view: str | None) -> _View:
        name = BASE_VIEW if view is None else view
        if name not in self._views:
            raise ValueError(f"unknown view {name!r}; registered views: {list(self._views)}")
        return self._views[name]

    def _key(self, dims: str | list[str], view: str | None) -> _Key:
        """Grid-ordered cache key; dims all shared with the base view map to the base."""
        v = self._view(view)
        names = [dims] if isinstance(dims, str) else list(dims)
        if not names:
            raise ValueError("dims must name at least one dim")
        unknown = [d for d in names if d not in v.dim_names]
        if unknown or len(set(names)) != len(names):
            raise ValueError(f"dims {names} must be distinct names from {list(v.dim_names)}")
        if all(d in v.shared_dims for d in names):
            view = BASE_VIEW
            v = self._views[BASE_VIEW]
        ordered = tuple(d for d in v.dim_names if d in names)
        return (BASE_VIEW if view is None else view, ordered)

    def get_coordinate(
        self, rank: int | None = None, view: str | None = None
    ) -> dict[str, int] | None:
        """Coordinates of ``rank`` (default: this rank) in a view; ``None`` outside the grid."""
        if rank is None:
            rank = dist.get_rank()
        if rank not in self.rank_range:
            return None
        v = self._view(view)
        local = rank - self.rank_offset
        return {
            name: (local // stride) % size
            for name, size, stride in zip(v.dim_names, v.shape, v.strides, strict=True)
        }

    def is_current_rank_in_grid(self) -> bool:
        """Whether this process's global rank lies in the grid."""
        return dist.get_rank() in self.rank_range

    def get_rank_enum(self, dims: str | list[str], view: str | None = None) -> list[list[int]]:
        """All groups obtained by varying ``dims`` with the other dims fixed.

        Pure: creates nothing. Ranks within a group are ascending; groups are ordered by
        their smallest rank. The order of ``dims`` does not matter.
        """
        view_name, ordered = self._key(dims, view)
        v = self._views[view_name]
        fixed = [i for i, d in enumerate(v.dim_names) if d not in ordered]
        groups: dict[tuple[int, ...], list[int]] = {}
        for local in range(self.size):
            coord = [(local // s) % n for n, s in zip(v.shape, v.strides, strict=True)]
            groups.setdefault(tuple(coord[i] for i in fixed), []).append(self.rank_offset + local)
        # Dicts keep insertion order and ranks were visited ascending: both orders hold.
        return list(groups.values())

    def has_pg(self, dims: str | list[str], view: str | None = None) -> bool:
        """Whether the groups of ``dims`` were already created."""
        return self._key(dims, view) in self._pgs

    def create_pg(
        self, dims: str | list[str], view: str | None = None, **pg_options: Any
    ) -> ProcessGroup | None:
        """Create every group of ``get_rank_enum(dims, view)``; collective over the world.

        Args:
            dims: dim name(s) to vary.
            view: view the dims belong to (``None`` = base view).
            **pg_options: extra keyword arguments for ``torch.distributed.new_group``
                (e.g. ``pg_options``, ``group_desc``); ``backend`` and ``timeout`` come
                from the grid unless given here.

        Returns:
            The group holding this rank, or ``None`` when this rank is outside the grid.

        Raises:
            ValueError: the groups of these dims already exist, or unknown dims/view.
        """
        key = self._key(dims, view)
        if key in self._pgs:
            raise ValueError(f"process groups for dims {list(key[1])} (view {key[0]!r}) exist")
        pg = self._new_groups(self.get_rank_enum(list(key[1]), key[0]), pg_options)
        self._pgs[key] = pg
        return pg

    def create_custom_pg(
        self, name: str, rank_groups: list[list[int]], **pg_options: Any
    ) -> ProcessGroup | None:
        """Create groups not spanned by dims (e.g. embedding groups); collective.

        Args:
            name: cache name; creating the same name twice raises.
            rank_groups: disjoint groups of ranks of this grid.
            **pg_options: as for :meth:`create_pg`.

        Returns:
            The group holding this rank, or ``None`` if no group holds it.
        """
        if name in self._custom_pgs:
            raise ValueError(f"custom process group {name!r} exists")
        flat = [r for g in rank_groups for r in g]
        if (
            not all(rank_groups)
            or len(set(flat)) != len(flat)
            or not set(flat) <= set(self.rank_range)
        ):
            raise ValueError(
                f"create_custom_pg({name!r}): rank_groups {rank_groups} must be disjoint, "
                f"non-empty groups of ranks in {self.rank_range}"
            )
        pg = self._new_groups([sorted(g) for g in rank_groups], pg_options)
        self._custom_pgs[name] = pg
        return pg

    def has_custom_pg(self, name: str) -> bool:
        """Whether :meth:`create_custom_pg` ran for ``name``."""
        return name in self._custom_pgs

    def get_custom_pg(self, name: str) -> ProcessGroup | None:
        """The custom group holding this rank (``None`` if none holds it).

        Raises:
            ValueError: ``name`` was not created with :meth:`create_custom_pg`.
        """
        if not self.has_custom_pg(name):
            raise ValueError(f"custom process group {name!r} was not created")
        return self._custom_pgs[name]

    def _new_groups(
        self, groups: list[list[int]], pg_options: dict[str, Any]
    ) -> ProcessGroup | None:
        members: _Members = tuple(tuple(g) for g in groups)
        # Only option-free group sets are shared: options may differ between uses.
        if not pg_options and members in self._pg_by_members:
            return self._pg_by_members[members]
        if self.rank_range.stop > dist.get_world_size():
            raise ValueError(
                f"grid ranks {self.rank_range} exceed the world size {dist.get_world_size()}"
            )
        if not pg_options and self.backend in (None, dist.get_backend()):
            # The set at once: one world-wide split (parallel/group_factory.py).
            mine = create_groups(groups, self.timeout)
            self._pg_by_members[members] = mine
            return mine
        options = {"backend": self.backend, **pg_options}  # a group at a time
        return groups_one_at_a_time(groups, options.pop("timeout", self.timeout),
                                    options.pop("group_desc", None), **options)

    def get_pg(self, dims: str | list[str], view: str | None = None) -> ProcessGroup | None:
        """The group of ``dims`` holding this rank (``None`` outside the grid).

        Raises:
            ValueError: the groups were not created with :meth:`create_pg`.
        """
        key = self._key(dims, view)
        if key not in self._pgs:
            raise ValueError(
                f"process groups for dims {list(key[1])} (view {key[0]!r}) were not created; "
                f"call create_pg first (created: {[list(k[1]) for k in self._pgs]})"
            )
        return self._pgs[key]

    def to_device_mesh(
        self,
        device_type: str = "cpu",
        dims: list[str] | None = None,
        view: str | None = None,
    ) -> DeviceMesh:
        """A ``DeviceMesh`` over ``dims`` (default: all dims of the view) of this rank.

        The mesh axes are the dims in reverse grid order (slowest first), so the mesh's
        last axis is the fastest-varying dim, as DeviceMesh expects; for the base grid
        ``["tp", "cp", "dp", "pp"]`` the axes are ``("pp", "dp", "cp", "tp")``. For a
        subset of dims the mesh spans the ranks varying over those dims with the other
        dims fixed at this rank's coordinates.

        The mesh reuses this grid's groups (``DeviceMesh.from_group``), one per dim,
        creating the missing ones with :meth:`create_pg`: so call this collectively on
        every world rank, in the same order. A rank outside the grid gets a mesh over the
        grid's first slice whose ``get_coordinate()`` is ``None``; it has no groups.
        """
        v = self._view(view)
        names = list(v.dim_names) if dims is None else list(dims)
        self._key(names, view)  # Validates the names.
        ordered = tuple(d for d in v.dim_names if d in names)
        pgs = [
            self.get_pg(d, view) if self.has_pg(d, view) else self.create_pg(d, view)
            for d in ordered
        ]
        axis_names = tuple(reversed(ordered))
        sizes = [v.size_of(d) for d in axis_names]
        groups = self.get_rank_enum(list(ordered), view)
        me = dist.get_rank()
        mine = next((g for g in groups if me in g), None)
        if mine is None:
            # Outside the grid: a group-less mesh, only so that every rank holds one.
            mesh = torch.tensor(groups[0], dtype=torch.int).reshape(sizes)
            return DeviceMesh(device_type, mesh, mesh_dim_names=axis_names, _init_backend=False)
        mesh = torch.tensor(mine, dtype=torch.int).reshape(sizes)
        axis_pgs = list(reversed(pgs))
        assert all(pg is not None for pg in axis_pgs)
        return DeviceMesh.from_group(axis_pgs, device_type, mesh, mesh_dim_names=axis_names)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape, strict=True))
        return f"HyperCommGrid({dims}, ranks={self.rank_range.start}..{self.rank_range.stop - 1})"
