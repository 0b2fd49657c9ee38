"""Overlapped gradient reduction: bucket collectives launched during the last backward.

With ``train.overlap_grad_reduce = true`` the data-parallel SUM of
:func:`~mimotron.parallel.data_parallel.finalize_model_grads` starts while the backward
still runs. The buckets are exactly those of the non-overlapped path, so each
collective sums the same flat tensor over the same group and the result is
bit-identical:

* a plain module: :func:`~mimotron.parallel.data_parallel.bucket_params` over its
  trainable parameters in registration order (``train.grad_bucket_mb`` each), each an
  all-reduce over the replica group; an expert-parallel module's dense parameters so,
  then its expert shards' over ``expt_dp`` (as ``_reduce_module``);
* a ZeRO-1 module (:mod:`~mimotron.parallel.zero`): the shards' own buckets, each a
  reduce-scatter (:meth:`~mimotron.parallel.zero.ZeroShards.launch_reduce`) that the
  optimizer's ``reduce_grads`` then only waits for (an expert-parallel one: its dense
  part's buckets, then its expert part's).

Only the *launch order* changes, and it is fixed: modules in backward order (the
language model, then the encoders by name), each module's buckets last-registered first
(roughly the order the backward produces them). Bucket ``i`` is launched only after
buckets ``< i`` were, so every rank of a group issues the same collectives in the same
order even when its hooks fire in another order or never (an encoder slice without a
sample of its modality): the step's :meth:`OverlappedGradReducer.finish` launches the
rest in order, zero-filling missing gradients, and waits for every all-reduce.

A post-accumulate-grad hook marks a parameter ready on the step's last micro-batch only
(earlier micro-batches just accumulate); :meth:`OverlappedGradReducer.arm` is called by
the schedule before that backward.

A DTensor (tensor-parallel) gradient may come back in another placement than its
parameter's (``align_grad_placements``); the launch redistributes it first (a ZeRO-1
bucket: :meth:`~mimotron.parallel.zero.ZeroShards.launch_reduce`), a TP collective
issued from the hook. The TP ranks of a replica saw the same samples, so
their backward graphs and hook sequences are the same and the collective lines up; the
values are those the end-of-backward alignment would produce.

*Late* buckets launch from ``finish`` only (the queue keeps the order, so later buckets
wait for them):

* a bucket holding a parameter whose gradient is a partial sum over TP
  (``sequence_parallel`` marks), all-reduce or ZeRO-1 reduce-scatter alike. Those are
  TP-summed after the backward in one flat collective per module; summing them per
  bucket instead would change which position each value has in the flat buffer, and
  with more than two TP ranks the ring reduction's association order depends on that
  position, so the bits could change;
* an expert-parallel all-reduce bucket (over ``expt_dp``): its placement fix-up would be
  a collective over the expert mesh, whose ranks saw different tokens, so their hooks
  fire in different orders and a collective issued from one could not line up. (A
  ZeRO-1 expert module's reduce-scatter needs no fix-up and launches early.)

Not covered (reduced at the end as without overlap): frozen modules and modules whose
every group has a single rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mimotron.names import LANGUAGE
from mimotron.parallel.data_parallel import (
    bucket_params,
    replica_group,
    same_placements,
    trainable_params,
)
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.sequence_parallel import SP_ATTR
from mimotron.parallel.zero import ExpertSplitShards, ZeroShards

Shards = ZeroShards | ExpertSplitShards


@dataclass
class GradBucket:
    """One collective: parameters, their group, and its state in the current step."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    """``None``: a group of one rank (missing gradients are only zero-filled)."""
    late: bool
    """Must wait for ``finish`` (TP-partial gradients)."""
    zero: ZeroShards | None = None
    """Set for a ZeRO-1 bucket: ``zero``'s bucket ``index`` is reduce-scattered."""
    index: int = 0
    pending: set[int] = field(default_factory=set)
    """``id`` of the parameters whose last-micro-batch gradient has not arrived."""
    grads: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None
    handle: dist.Work | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _real(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return group if group is not None and dist.get_world_size(group) > 1 else None


def backward_module_order(names: list[str]) -> list[str]:
    """The language model first (its backward runs first), then the encoders by name."""
    return sorted(names, key=lambda n: (n != LANGUAGE, n))


def _zero_buckets(zero: Shards) -> list[GradBucket]:
    """A ZeRO-1 module's reduce-scatters: each part's buckets, last-registered first."""
    parts = [zero.dense, zero.expert] if isinstance(zero, ExpertSplitShards) else [zero]
    out = []
    for part in parts:
        for i in reversed(range(part.num_buckets)):
            params = part.bucket_params(i)
            out.append(GradBucket(params, part.group, _tp_partial(params), part, i))
    return out


def _tp_partial(params: list[nn.Parameter]) -> bool:
    """Some gradient is a partial sum over TP (summed after the backward): a late bucket."""
    return any(getattr(p, SP_ATTR, False) for p in params)


def _allreduce_buckets(params: list[nn.Parameter], group: dist.ProcessGroup | None,
                       bucket_bytes: int, late: bool = False) -> list[GradBucket]:
    """All-reduce buckets of ``bucket_params``, last-registered first."""
    return [GradBucket(b, group, late or _tp_partial(b))
            for b in reversed(list(bucket_params(params, bucket_bytes)))]


def module_buckets(module: nn.Module, pg: ProcessGroupCollection, zero: Shards | None,
                   bucket_bytes: int) -> list[GradBucket]:
    """One module's buckets in launch order; empty if none has a group of two ranks."""
    if zero is not None:
        return _zero_buckets(zero)
    params = trainable_params(module)
    dense = [p for p in params if not is_expert_param(p)]
    experts = [p for p in params if is_expert_param(p)]
    out = _allreduce_buckets(dense, _real(replica_group(pg)), bucket_bytes)
    if experts:  # late: see the module docstring
        out += _allreduce_buckets(experts, _real(pg.expt_dp), bucket_bytes, late=True)
    return out if any(b.group is not None for b in out) else []


class OverlappedGradReducer:
    """Launches each module's gradient buckets as soon as the last backward fills them.

    Args:
        modules: the module parts this rank holds, keyed by module name.
        pg_collections: the process groups of each of those modules.
        frozen: modules that do not train (never reduced).
        bucket_bytes: upper bound of one all-reduce (``train.grad_bucket_mb``).
        zero: the row shards of the ZeRO-1 modules (their reduce-scatters are launched
            here and waited for by the optimizer).
    """

    def __init__(self, modules: dict[str, nn.Module],
                 pg_collections: dict[str, ProcessGroupCollection], frozen: set[str],
                 bucket_bytes: int, zero: dict[str, Shards] | None = None) -> None:
        zero = zero or {}
        self.modules: list[str] = []
        self.buckets: list[GradBucket] = []
        for name in backward_module_order(list(modules)):
            if name in frozen:
                continue
            buckets = module_buckets(modules[name], pg_collections[name], zero.get(name),
                                     bucket_bytes)
            if buckets:
                self.modules.append(name)
                self.buckets += buckets
        self._bucket_of: dict[int, GradBucket] = {}
        self._hooks: list[RemovableHandle] = []
        self.armed = False
        self.num_launched = 0
        self.num_launched_early = 0
        """Buckets launched from a hook, i.e. during the backward (the overlap)."""
        for bucket in self.buckets:
            if bucket.late:
                continue
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_ready))

    def arm(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """From now on (the last micro-batch's backward) a gradient is final when it lands.

        Args:
            params: only these parameters (interleaved pipelines: a model chunk's last
                backward comes at its own point of the schedule, so the runner arms each
                chunk's parameters before it); ``None``: every parameter.
        """
        if not self.armed:
            self.armed = True
            self._armed_ids: set[int] | None = set()
            for bucket in self.buckets:
                bucket.pending = {id(p) for p in bucket.params}
        if params is None:
            self._armed_ids = None
        elif self._armed_ids is not None:
            self._armed_ids.update(id(p) for p in params)

    def _on_ready(self, p: nn.Parameter) -> None:
        if not self.armed or (self._armed_ids is not None and id(p) not in self._armed_ids):
            return
        self._bucket_of[id(p)].pending.discard(id(p))
        while (self.num_launched < len(self.buckets)
               and not self.buckets[self.num_launched].late
               and not self.buckets[self.num_launched].pending):
            self._launch(self.buckets[self.num_launched])
            self.num_launched_early += 1

    def _launch(self, bucket: GradBucket) -> None:
        """Start the bucket's asynchronous SUM (missing gradients contribute zeros)."""
        self.num_launched += 1
        if bucket.zero is not None:
            bucket.zero.launch_reduce(bucket.index)
            return
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif isinstance(p.grad, DTensor) and not same_placements(p.grad.placements,
                                                                     p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if bucket.group is None:
            return
        bucket.grads = [_local(p.grad) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        bucket.handle = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=bucket.group,
                                        async_op=True)

    def finish(self) -> None:
        """Launch the remaining buckets in order, wait for the all-reduces, write back.

        Called by ``finalize_model_grads`` after the TP-side fix-ups (partial norm sums,
        DTensor placements) the late buckets wait for; removes the hooks. The ZeRO-1
        reduce-scatters stay in flight: the optimizer's ``reduce_grads`` waits for them.
        """
        self.close()
        while self.num_launched < len(self.buckets):
            self._launch(self.buckets[self.num_launched])
        for bucket in self.buckets:
            if bucket.handle is None:
                continue
            bucket.handle.wait()
            offset = 0
            for g in bucket.grads:
                n = g.numel()
                g.copy_(bucket.flat[offset:offset + n].view_as(g))
                offset += n
            bucket.grads, bucket.flat, bucket.handle = [], None, None
    def close(self) -> None:
        """Remove the hooks (idempotent); the step's ``finally`` calls it on errors too."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.armed = False
