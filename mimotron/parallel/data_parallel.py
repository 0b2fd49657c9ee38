"""Data parallelism per module: the groups, buckets and placement fix-up gradients need.

The gradients are SUM-reduced over the module's own DP group by
:class:`~mimotron.parallel.grad_sync.GradSync` (plain, overlapped or ZeRO-1); this module
holds the pieces it is built from. Under context parallelism the group is ``dp x cp``
(:func:`replica_group`): each CP rank holds the whole module and backpropagated the loss
of its positions only.

The loss each rank backpropagates is already divided by the *global* loss-token count
(broadcast to every rank, encoder-only ranks included, before the schedule runs), so a
SUM over DP replicas gives exactly the single-device mean over tokens. FSDP's default
AVG would divide a second time by the DP degree, wrongly for encoders whose DP degree
differs from the language model's (docs/design.md, "The parity contract").

Gradients are flattened into buckets of at most ``bucket_bytes`` (:func:`bucket_params`)
so each bucket is one collective; a parameter that received no gradient on this rank
(e.g. an encoder whose modality was absent from this rank's slice) contributes zeros, so
every rank of the group issues the same collectives with the same sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mimotron.parallel.groups import ProcessGroupCollection

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

