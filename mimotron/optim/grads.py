"""Gradient helpers of :class:`~mimotron.optim.mimo_optimizer.MimoOptimizer`.

Which local gradient a rank counts towards a module's norm, so that after the module's
sums (``mp``, and ``dp`` for what is sharded over data parallelism) every element of
every parameter is counted exactly once:

* a plain tensor is counted on TP rank 0 only: tensor parallelism shards parameters as
  DTensors (``mimotron.parallel.tensor_parallel``), so a plain one in a module with
  TP > 1 is whole on every TP rank (norms, position embeddings, front ends);
* a DTensor counts its local shard, except along a ``Replicate`` mesh dim inside ``mp``
  (coordinate 0 only);
* shards over data parallelism (FSDP DTensors, ZeRO fragments) go to a separate sum
  that is all-reduced over ``dp``; a ZeRO fragment counts where its model parameter's
  local part would (:func:`counted_on_rank`);
* expert-parallel shards are summed apart, over ``tp_ep_pp``
  (:meth:`~mimotron.optim.mimo_optimizer.MimoOptimizer._module_stats`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard


def collective_device(group: dist.ProcessGroup | None,
                      device: torch.device | None = None) -> torch.device:
    """Where ``group``'s reductions of step values run.

    ``device`` (the parameters' device) when the group has a non-gloo backend for its
    device type (NCCL needs device tensors; the dry run's ``fake`` backend stands in for
    it); the CPU for gloo, for CPU parameters, or without ``device`` when no
    accelerator is available.
    """
    if device is not None:
        if device.type == "cpu":
            return device
        pairs = dict(p.split(":", 1) for p in str(dist.get_backend_config(group)).split(",")
                     if ":" in p)
        return device if pairs.get(device.type, "gloo") != "gloo" else torch.device("cpu")
    backend = str(dist.get_backend(group))
    if backend in ("gloo", "fake") or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def usable(group: Any) -> bool:
    """A real group this rank belongs to, with more than one rank."""
    return isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) > 1


def grads_of(params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    """The gradients that exist, in parameter order."""
    return [p.grad for _, p in params if p.grad is not None]


def reduced_grads(params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    """Grads, with Partial DTensor grads all-reduced to Replicate (norm needs values).

    Every rank holding the parameter visits it in the same order, so the collectives
    over the parameter's mesh line up.
    """
    for _, p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            p.grad = g.redistribute(g.device_mesh, placements)
    return grads_of(params)


def scale_(grads: list[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    if plain:
        torch._foreach_mul_(plain, factor)
    for g in grads:
        if isinstance(g, DTensor):
            g.mul_(factor)


def non_finite_flag(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[1.0]`` when any local gradient element is inf or NaN, else ``[0.0]`` (float64).

    Stays on device: the flag travels in the optimizer's one world collective, which is
    the optimizer's only host sync.
    """
    if not grads:
        return torch.zeros(1, dtype=torch.float64, device=device)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    finite = torch.stack([torch.isfinite(g).all() for g in local]).all()
    return (~finite).to(device=device, dtype=torch.float64).reshape(1)


def dim_ranks(mesh: Any, dim: int) -> set[int]:
    """Ranks of this rank's group along one mesh dim (from the mesh tensor, no groups)."""
    coord = mesh.get_coordinate()
    assert coord is not None, "a rank holding a DTensor must be in its mesh"
    index: list[Any] = list(coord)
    index[dim] = slice(None)
    return set(mesh.mesh[tuple(index)].flatten().tolist())


def counted_on_rank(t: torch.Tensor, mp_ranks: set[int], tp_rank: int) -> bool:
    """Whether this rank counts its local part of ``t`` (a parameter or its gradient).

    A Replicate dim inside the module's mp group is counted on coordinate 0 only (the mp
    SUM would count it once per replica); replicas outside mp are equal and the world
    MAX already keeps one. A plain tensor is duplicated over TP and counts on TP rank 0.
    """
    if not isinstance(t, DTensor):
        # Tensor parallelism shards parameters as DTensors; a plain one is whole on every
        # TP rank (norms, position embeddings, front ends) and is counted on TP rank 0.
        return tp_rank == 0
    mesh = t.device_mesh
    if not any(mesh.size(dim) > 1 and dim_ranks(mesh, dim) <= mp_ranks
               for dim in range(mesh.ndim)):
        # Sharded over ranks outside mp only (FSDP over dp): whole on every TP rank, like a
        # plain tensor, so counted on TP rank 0.
        return tp_rank == 0
    coord = mesh.get_coordinate()
    return not any(pl.is_replicate() and coord[dim] != 0
                   and dim_ranks(mesh, dim) <= mp_ranks
                   for dim, pl in enumerate(t.placements))


def counted_local_grad(p: torch.Tensor, mp_ranks: set[int], tp_rank: int) -> torch.Tensor | None:
    """The local grad this rank counts, or None (no grad, or a replica counted elsewhere).

    See :func:`counted_on_rank` (decided on the gradient's own placements).
    """
    g = p.grad
    if g is None or not counted_on_rank(g, mp_ranks, tp_rank):
        return None
    return g.to_local() if isinstance(g, DTensor) else g


def sharded_outside(p: torch.Tensor, mp_ranks: set[int], dp_ranks: set[int], module: str) -> bool:
    """Whether a DTensor parameter is sharded over ranks outside mp (e.g. FSDP over dp).

    Raises:
        ValueError: it is sharded over ranks in neither the module's mp nor dp group.
    """
    if not isinstance(p, DTensor):
        return False
    mesh, outside = p.device_mesh, False
    for dim, pl in enumerate(p.placements):
        # FSDP2 composed with TP shards dp with a _StridedShard, which is not is_shard().
        if not (pl.is_shard() or isinstance(pl, _StridedShard)) or mesh.size(dim) == 1:
            continue
        ranks = dim_ranks(mesh, dim)
        if ranks <= mp_ranks:
            continue
        if not ranks <= dp_ranks:
            raise ValueError(
                f"module {module!r}: a parameter is sharded over ranks {sorted(ranks)}, "
                "which are in neither its mp nor its dp group"
            )
        outside = True
    return outside
