"""Overlapped gradient reduction: bucket all-reduces launched during the last backward.

With ``train.overlap_grad_reduce = true`` the data-parallel SUM of
:func:`~mimotron.parallel.data_parallel.finalize_model_grads` starts while the backward
still runs. The buckets are exactly those of the non-overlapped path
(:func:`~mimotron.parallel.data_parallel.bucket_params` over each module's trainable
parameters in registration order, ``train.grad_bucket_mb`` each), so each all-reduce
sums the same flat tensor over the same group: the result is bit-identical.

Only the *launch order* changes, and it is fixed: modules in backward order (the
language model, then the encoders by name), each module's buckets last-registered first
(roughly the order the backward produces them). Bucket ``i`` is launched only after
buckets ``< i`` were, so every rank of a group issues the same collectives in the same
order even when its hooks fire in another order or never (an encoder slice without a
sample of its modality): the step's :meth:`OverlappedGradReducer.finish` launches the
rest in order, zero-filling missing gradients, and waits for every handle.

A post-accumulate-grad hook marks a parameter ready on the step's last micro-batch only
(earlier micro-batches just accumulate); :meth:`OverlappedGradReducer.arm` is called by
the schedule before that backward. Some buckets must not start early because something
has to happen to their gradients first; they are *late* and launch from ``finish``
after it happened (the queue keeps the order, so later buckets wait for them):

* a bucket holding a DTensor parameter: ``align_grad_placements`` may redistribute its
  gradient (a TP collective) after the backward;
* a bucket holding a parameter whose gradient is a partial sum over TP
  (``sequence_parallel`` marks): it is TP-reduced after the backward.

Not covered (reduced at the end as without overlap): frozen modules, modules whose
ZeRO-1 optimizer reduce-scatters the gradients itself, modules with expert-parallel
parameters, and modules whose replica group has a single rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from mimotron.names import LANGUAGE
from mimotron.parallel.data_parallel import bucket_params, replica_group, trainable_params
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.sequence_parallel import SP_ATTR


@dataclass
class GradBucket:
    """One all-reduce: parameters, their group, and its state in the current step."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup
    late: bool
    """Must wait for ``finish`` (DTensor or TP-partial gradients)."""
    pending: set[int] = field(default_factory=set)
    """``id`` of the parameters whose last-micro-batch gradient has not arrived."""
    grads: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None
    handle: dist.Work | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def backward_module_order(names: list[str]) -> list[str]:
    """The language model first (its backward runs first), then the encoders by name."""
    return sorted(names, key=lambda n: (n != LANGUAGE, n))


def covered_modules(modules: dict[str, nn.Module],
                    pg_collections: dict[str, ProcessGroupCollection],
                    skipped: set[str]) -> list[str]:
    """Modules whose dense gradients the reducer handles, in launch order."""
    out = []
    for name in backward_module_order(list(modules)):
        group = replica_group(pg_collections[name])
        if name in skipped or group is None or dist.get_world_size(group) == 1:
            continue
        if any(is_expert_param(p) for p in trainable_params(modules[name])):
            continue
        out.append(name)
    return out


class OverlappedGradReducer:
    """Launches each module's gradient buckets as soon as the last backward fills them.

    Args:
        modules: the module parts this rank holds, keyed by module name.
        pg_collections: the process groups of each of those modules.
        skipped: modules not reduced here (frozen, or ZeRO-1: the optimizer reduces).
        bucket_bytes: upper bound of one all-reduce (``train.grad_bucket_mb``).
    """

    def __init__(self, modules: dict[str, nn.Module],
                 pg_collections: dict[str, ProcessGroupCollection], skipped: set[str],
                 bucket_bytes: int) -> None:
        self.modules = covered_modules(modules, pg_collections, skipped)
        self.buckets: list[GradBucket] = []
        for name in self.modules:
            group = replica_group(pg_collections[name])
            for params in reversed(list(bucket_params(trainable_params(modules[name]),
                                                      bucket_bytes))):
                late = any(isinstance(p, DTensor) or getattr(p, SP_ATTR, False)
                           for p in params)
                self.buckets.append(GradBucket(params, group, late))
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

    def arm(self) -> None:
        """From now on (the last micro-batch's backward) a gradient is final when it lands."""
        self.armed = True
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}

    def _on_ready(self, p: nn.Parameter) -> None:
        if not self.armed:
            return
        self._bucket_of[id(p)].pending.discard(id(p))
        while (self.num_launched < len(self.buckets)
               and not self.buckets[self.num_launched].late
               and not self.buckets[self.num_launched].pending):
            self._launch(self.buckets[self.num_launched])
            self.num_launched_early += 1

    def _launch(self, bucket: GradBucket) -> None:
        """Start the bucket's asynchronous SUM (missing gradients contribute zeros)."""
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket.grads = [_local(p.grad) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        bucket.handle = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=bucket.group,
                                        async_op=True)
        self.num_launched += 1

    def finish(self) -> None:
        """Launch the remaining buckets in order, wait for all, write the sums back.

        Called by ``finalize_model_grads`` after the TP-side fix-ups (partial norm sums,
        DTensor placements) the late buckets wait for; removes the hooks.
        """
        self.close()
        while self.num_launched < len(self.buckets):
            self._launch(self.buckets[self.num_launched])
        for bucket in self.buckets:
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
