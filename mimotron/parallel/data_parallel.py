"""Data parallelism per module: SUM-reduce gradients over the module's own DP group.

Under context parallelism the group is ``dp x cp`` (:func:`replica_group`): each CP rank
holds the whole module and backpropagated the loss of its positions only.

The loss each rank backpropagates is already divided by the *global* loss-token count
(broadcast to every rank, encoder-only ranks included, before the schedule runs), so a
SUM over DP replicas gives exactly the single-device mean over tokens. FSDP's default
AVG would divide a second time by the DP degree, wrongly for encoders whose DP degree
differs from the language model's (docs/design.md, "The parity contract").

Gradients are flattened into buckets of at most ``bucket_bytes`` so each bucket is one
collective; a parameter that received no gradient on this rank (e.g. an encoder whose
modality was absent from this rank's slice) contributes zeros, so every rank of the
group issues the same collectives with the same sizes.

Expert-parallel shards (MoE experts under ``parallel.expert > 1``) are summed over the
module's ``expt_dp`` group, not ``dp``: the ranks of one ``dp`` group hold different
experts, and the ranks holding the same experts together saw every token routed to them.

A module whose optimizer is sharded over its DP group (ZeRO-1, see
:mod:`~mimotron.parallel.zero`) reduce-scatters its own gradients inside the optimizer
step: the caller names it in ``optimizer_reduced`` and it is skipped here, so nothing is
reduced twice and each rank only ever receives the gradient rows it steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.sequence_parallel import reduce_sequence_parallel_grads

if TYPE_CHECKING:
    from mimotron.parallel.overlap import OverlappedGradReducer

DEFAULT_BUCKET_BYTES = 32 * 2**20


def trainable_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that take gradients, in registration order (identical on every replica)."""
    return [p for p in module.parameters() if p.requires_grad]


def bucket_params(params: list[nn.Parameter], bucket_bytes: int) -> Iterable[list[nn.Parameter]]:
    """Consecutive runs of parameters of one dtype and at most ``bucket_bytes`` each.

    A parameter larger than ``bucket_bytes`` gets a bucket of its own.
    """
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def align_grad_placements(module: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements (a TP collective if needed).

    DTensor's sharding propagation may return a weight gradient in a placement other
    than the weight's: with an empty input (an encoder slice with no sample of its
    modality) a row-parallel weight's gradient comes back ``_StridedShard(dim=1)``
    instead of ``Shard(1)``, and accumulating it into the other micro-batches' ``Shard``
    gradient keeps the strided placement. The global values are right, but the *local*
    tensor then holds other columns than the parameter's local shard, so the DP
    all-reduce of local tensors (and the optimizer's local view) would mix different
    columns across replicas. Redistributing here makes every local gradient line up
    with its parameter. The collective, when one is needed, runs on the parameter's own
    TP mesh, whose ranks all see the same samples and therefore decide alike.
    """
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and not same_placements(g.placements, p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def same_placements(a: tuple, b: tuple) -> bool:
    """Placements equal in type and value.

    The type matters: some torch versions define ``_StridedShard(d) == Shard(d)`` (to
    spare DTensor dispatch an all-gather), although their local tensors hold different
    elements.
    """
    if len(a) != len(b):
        return False
    return all(type(x) is type(y) and x == y for x, y in zip(a, b, strict=True))


def allreduce_gradients(
    module: nn.Module,
    group: dist.ProcessGroup | None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    params: list[nn.Parameter] | None = None,
) -> None:
    """SUM trainable parameters' gradients over ``group`` (no-op for one rank).

    Args:
        module: the module part.
        group: the group to sum over.
        bucket_bytes: upper bound of one collective.
        params: the parameters to reduce; ``None`` = every trainable one of ``module``.
    """
    params = trainable_params(module) if params is None else params
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if group is None or dist.get_world_size(group) == 1:
        return
    for bucket in bucket_params(params, bucket_bytes):
        grads = [_local(p.grad) for p in bucket]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n


def replica_group(pg: ProcessGroupCollection) -> dist.ProcessGroup | None:
    """The group over which a module's parameters are replicated and gradients summed.

    ``dp``, or ``dp_cp`` under context parallelism: CP ranks hold the same parameters
    and each backpropagated the loss of its own positions, so their partial gradients
    add up exactly like those of DP replicas.
    """
    cp = pg.cp
    if isinstance(cp, dist.ProcessGroup) and dist.get_world_size(cp) > 1:
        return pg.dp_cp
    return pg.dp


def finalize_model_grads(
    modules: dict[str, nn.Module],
    pg_collections: dict[str, ProcessGroupCollection],
    frozen: set[str] | None = None,
    optimizer_reduced: set[str] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    reducer: OverlappedGradReducer | None = None,
) -> None:
    """Reduce each module's gradients over its own DP group, in sorted module order.

    The DP group is :func:`replica_group`'s: ``dp_cp`` for a context-parallel module.

    Expert-parallel shards (:func:`~mimotron.parallel.expert_parallel.is_expert_param`)
    are summed over the module's ``expt_dp`` group instead, after the dense ones.

    With a ``reducer`` (``train.overlap_grad_reduce``), every module's TP-side fix-ups
    run first, then the reducer finishes its modules (launched during the backward,
    same buckets), then the modules it does not cover are reduced as without it.

    Args:
        modules: the module parts this rank holds, keyed by module name.
        pg_collections: the process groups of each of those modules.
        frozen: modules that do not train (no gradient sync at all).
        optimizer_reduced: modules whose sharded optimizer reduce-scatters their
            gradients itself (ZeRO-1).
        bucket_bytes: upper bound of one all-reduce (``train.grad_bucket_mb``).
        reducer: the step's overlapped reducer, or ``None``.
    """
    skipped = (frozen or set()) | (optimizer_reduced or set())
    if reducer is not None:
        for name in sorted(modules):
            if name not in (frozen or set()):
                reduce_sequence_parallel_grads(modules[name], pg_collections[name].tp)
            if name not in skipped:
                align_grad_placements(modules[name])
        reducer.finish()
    for name in sorted(modules):
        if reducer is not None and name in reducer.modules:
            continue
        if reducer is None and name not in (frozen or set()):
            # Sequence-parallel norm weights: partial over TP, summed before anything else.
            reduce_sequence_parallel_grads(modules[name], pg_collections[name].tp)
        if name in skipped:
            continue
        if reducer is None:
            align_grad_placements(modules[name])
        _reduce_module(modules[name], pg_collections[name], bucket_bytes)


def _reduce_module(module: nn.Module, pg: ProcessGroupCollection, bucket_bytes: int) -> None:
    """Dense parameters over the replica group, expert shards over ``expt_dp``."""
    params = trainable_params(module)
    experts = [p for p in params if is_expert_param(p)]
    if not experts:
        allreduce_gradients(module, replica_group(pg), bucket_bytes, params=params)
        return
    # Expert shards are replicated over expt_dp only (each EP rank holds other experts).
    dense = [p for p in params if not is_expert_param(p)]
    allreduce_gradients(module, replica_group(pg), bucket_bytes, params=dense)
    allreduce_gradients(module, pg.expt_dp, bucket_bytes, params=experts)


def zero_grad_buffer_for_multimodule(modules: dict[str, nn.Module]) -> None:
    """Clear every module part's gradients before a new step (set to None)."""
    for module in modules.values():
        for p in module.parameters():
            p.grad = None
