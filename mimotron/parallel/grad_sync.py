"""Gradient finalisation: one design, three modes (plain DP, overlapped DP, ZeRO-1).

After a training step's backward, every trainable module's gradients are finalised by
one :class:`GradSync` built for the step:

1. the **partial-sum step**: gradients that are partial sums over TP (sequence-parallel
   norm weights, ``sequence_parallel`` marks) are summed over the module's ``tp`` group
   in one flat collective
   (:func:`~mimotron.parallel.sequence_parallel.reduce_sequence_parallel_grads`);
2. the **placement fix-up**: every DTensor gradient is redistributed to its parameter's
   placements (:func:`~mimotron.parallel.data_parallel.align_grad_placements`), so local
   tensors line up across replicas;
3. the **buckets**, each one collective that SUMs a run of gradients:

   * an *all-reduce bucket*: :func:`~mimotron.parallel.data_parallel.bucket_params` over
     the module's dense trainable parameters in registration order
     (``train.grad_bucket_mb`` each), over the replica group
     (:func:`~mimotron.parallel.data_parallel.replica_group`); missing gradients are
     zero-filled, so every rank issues the same collectives with the same sizes;
   * an *expert bucket*: the same over the expert shards, over ``expt_dp`` (the ranks of
     one ``dp`` group hold different experts);
   * a *ZeRO-1 bucket* (:mod:`~mimotron.parallel.zero`): one of the shards' own buckets,
     launched as a reduce-scatter by :meth:`~mimotron.parallel.zero.ZeroShards.launch_reduce`;
     it lands in the optimizer's fragments, so the sharded optimizer's ``reduce_grads``
     waits for it (and, in plain mode, launches and lands each bucket itself, one padded
     copy alive at a time).

Each :class:`ModuleGradSync` owns one module's buckets and its steps 1 and 2;
:class:`GradSync` orders them. The modes differ only in *when* each bucket is launched,
never in what it sums, so every mode gives the same bits:

* **plain** (``overlap=False``): no hooks. :meth:`GradSync.finish` runs, module by
  module in sorted order, steps 1 and 2 and then launches and waits for each bucket
  (one flat copy alive at a time). A ZeRO-1 module's buckets are left to its optimizer.
* **overlapped** (``train.overlap_grad_reduce``): the buckets of every module with a
  group of two or more ranks form one queue, modules in backward order (the language
  model, then the encoders by name), each module's dense buckets last-registered first,
  then its expert buckets so. Post-accumulate-grad hooks, armed by the schedule before
  the last micro-batch's backward (:meth:`GradSync.arm`), mark parameters ready and
  :meth:`GradSync.launch` the queue's head while it is complete; bucket ``i`` only after
  buckets ``< i``, so every rank issues the same collectives in the same order whichever
  order its hooks fire in. :meth:`GradSync.finish` then runs steps 1 and 2 for every
  module, **flushes** the queue (launches, in order, the buckets not launched yet: late
  ones, and those whose hooks did not all fire, e.g. a parameter without a gradient in
  the last micro-batch, or an encoder slice that ran no backward), waits for the
  all-reduces, and treats the modules outside the queue as in plain mode.

An all-reduce bucket's launch redistributes a DTensor gradient to its parameter's
placements first (a TP collective from the hook: the TP ranks of a replica saw the same
samples, so their hooks fire in the same order). *Late* buckets launch from the flush
only (the queue keeps the order, so later buckets wait for them):

* a bucket holding a parameter whose gradient is a partial sum over TP (step 1 must
  come first); summing those per bucket instead would change where each value sits in
  the flat buffer, and with more than two TP ranks the ring reduction's association
  order depends on that position, so the bits could change;
* an expert all-reduce bucket: its placement fix-up would be a collective over the
  expert mesh, whose ranks saw different tokens, so their hooks fire in different
  orders. (A ZeRO-1 expert bucket needs no fix-up and launches early.)

Frozen modules are not finalised at all.
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
    DEFAULT_BUCKET_BYTES,
    align_grad_placements,
    bucket_params,
    replica_group,
    same_placements,
    trainable_params,
)
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.sequence_parallel import SP_ATTR, reduce_sequence_parallel_grads
from mimotron.parallel.zero import ExpertSplitShards, ZeroShards

Shards = ZeroShards | ExpertSplitShards


@dataclass
class GradBucket:
    """One collective: parameters, their group, and its state in the current step."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    """``None``: a group of one rank (missing gradients are only zero-filled)."""
    late: bool
    """Launched by the flush only (TP-partial gradients, expert all-reduce)."""
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


def _tp_partial(params: list[nn.Parameter]) -> bool:
    """Some gradient is a partial sum over TP (summed after the backward)."""
    return any(getattr(p, SP_ATTR, False) for p in params)


def backward_module_order(names: list[str]) -> list[str]:
    """The language model first (its backward runs first), then the encoders by name."""
    return sorted(names, key=lambda n: (n != LANGUAGE, n))


class ModuleGradSync:
    """One trainable module's gradient finalisation: partial sums, fix-ups, buckets.

    Args:
        module: the module part this rank holds.
        pg: its process groups.
        bucket_bytes: upper bound of one collective (``train.grad_bucket_mb``).
        zero: its ZeRO-1 row shards, if its optimizer is sharded and the buckets are to
            be launched here (overlapped mode).
        sharded: its optimizer is sharded (ZeRO-1) and reduce-scatters the gradients;
            implied by ``zero``. Without ``zero`` the module has no buckets here.
    """

    def __init__(self, module: nn.Module, pg: ProcessGroupCollection, bucket_bytes: int,
                 zero: Shards | None = None, sharded: bool = False) -> None:
        self.module, self.pg = module, pg
        self.sharded = sharded or zero is not None
        self.runs: list[list[GradBucket]] = self._runs(zero, bucket_bytes)
        """Buckets by group (dense, then experts), each in registration order."""

    def _runs(self, zero: Shards | None, bucket_bytes: int) -> list[list[GradBucket]]:
        if zero is not None:
            parts = [zero.dense, zero.expert] if isinstance(zero, ExpertSplitShards) else [zero]
            return [[GradBucket(part.bucket_params(i), part.group,
                                _tp_partial(part.bucket_params(i)), part, i)
                     for i in range(part.num_buckets)] for part in parts]
        if self.sharded:
            return []  # the sharded optimizer launches and lands its reduce-scatters
        params = trainable_params(self.module)
        dense = [p for p in params if not is_expert_param(p)]
        experts = [p for p in params if is_expert_param(p)]
        runs = [[GradBucket(b, _real(replica_group(self.pg)), _tp_partial(b))
                 for b in bucket_params(dense, bucket_bytes)]]
        if experts:  # late: see the module docstring
            runs.append([GradBucket(b, _real(self.pg.expt_dp), True)
                         for b in bucket_params(experts, bucket_bytes)])
        return runs

    @property
    def buckets(self) -> list[GradBucket]:
        """Every bucket in registration order (plain mode's launch order)."""
        return [b for run in self.runs for b in run]

    @property
    def backward_buckets(self) -> list[GradBucket]:
        """Each run last-registered first (roughly the order the backward fills them)."""
        return [b for run in self.runs for b in reversed(run)]

    @property
    def overlappable(self) -> bool:
        """Some bucket is a collective of two or more ranks (or a ZeRO-1 reduce-scatter)."""
        return any(b.group is not None for b in self.buckets)

    def fix_up(self) -> None:
        """Steps 1 and 2: TP partial sums, then (unless sharded) DTensor placements.

        A ZeRO-1 bucket aligns its gradients at the launch
        (:meth:`~mimotron.parallel.zero.ZeroShards.launch_reduce`).
        """
        reduce_sequence_parallel_grads(self.module, self.pg.tp)
        if not self.sharded:
            align_grad_placements(self.module)


def launch(bucket: GradBucket) -> None:
    """Start the bucket's asynchronous SUM (missing gradients contribute zeros).

    A ZeRO-1 bucket is handed to its shards (the optimizer waits for it); an all-reduce
    bucket redistributes DTensor gradients to their parameters' placements first and
    keeps its flat buffer until :func:`land`.
    """
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


def land(bucket: GradBucket) -> None:
    """Wait for an all-reduce bucket and write the sums back (no-op otherwise)."""
    if bucket.handle is None:
        return
    bucket.handle.wait()
    offset = 0
    for g in bucket.grads:
        n = g.numel()
        g.copy_(bucket.flat[offset:offset + n].view_as(g))
        offset += n
    bucket.grads, bucket.flat, bucket.handle = [], None, None


class GradSync:
    """A step's gradient finalisation for every module part this rank holds.

    Args:
        modules: the module parts this rank holds, keyed by module name.
        pg_collections: the process groups of each of those modules.
        frozen: modules that do not train (not finalised at all).
        bucket_bytes: upper bound of one collective (``train.grad_bucket_mb``).
        zero: the row shards of the ZeRO-1 modules (overlapped mode launches their
            reduce-scatters; their optimizer waits for them).
        overlap: launch buckets from gradient hooks during the last backward
            (``train.overlap_grad_reduce``); otherwise plain mode.
        sharded: further ZeRO-1 modules given by name only (plain mode: skipped, their
            optimizer reduce-scatters them).
    """

    def __init__(self, modules: dict[str, nn.Module],
                 pg_collections: dict[str, ProcessGroupCollection],
                 frozen: Iterable[str] = (), bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 zero: dict[str, Shards] | None = None, overlap: bool = False,
                 sharded: Iterable[str] = ()) -> None:
        zero, frozen, sharded = zero or {}, set(frozen), set(sharded)
        trained = set(modules) - frozen
        assert not (overlap and (sharded & trained) - set(zero)), "overlap needs the shards"
        self.overlap = overlap
        self.parts: dict[str, ModuleGradSync] = {
            name: ModuleGradSync(modules[name], pg_collections[name], bucket_bytes,
                                 zero.get(name) if overlap else None,
                                 name in zero or name in sharded)
            for name in sorted(modules) if name not in frozen}
        self.modules: list[str] = []
        """The modules whose buckets are in the overlap queue, in backward order."""
        self.buckets: list[GradBucket] = []
        """The overlap queue (empty in plain mode)."""
        if overlap:
            for name in backward_module_order(list(self.parts)):
                if self.parts[name].overlappable:
                    self.modules.append(name)
                    self.buckets += self.parts[name].backward_buckets
        self.num_launched = 0
        """The queue's head: buckets ``< num_launched`` were launched."""
        self.num_launched_early = 0
        """Buckets launched from a hook, i.e. during the backward (the overlap)."""
        self.num_flushed = 0
        """Buckets neither late nor launched from a hook: launched by the flush."""
        self.armed = False
        self._armed_ids: set[int] | None = set()
        self._bucket_of: dict[int, GradBucket] = {}
        self._hooks: list[RemovableHandle] = []
        for bucket in self.buckets:
            if bucket.late:
                continue
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_ready))

    def arm(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """From now on (the last micro-batch's backward) a gradient is final when it lands.

        No effect in plain mode (no hooks).

        Args:
            params: only these parameters (interleaved pipelines: a model chunk's last
                backward comes at its own point of the schedule, so the runner arms each
                chunk's parameters before it); ``None``: every parameter.
        """
        if not self.armed:
            self.armed = True
            self._armed_ids = set()
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
            self.launch_next()
            self.num_launched_early += 1

    def launch_next(self) -> None:
        """Launch the queue's head bucket (:func:`launch`) and advance the head."""
        launch(self.buckets[self.num_launched])
        self.num_launched += 1

    def finish(self) -> None:
        """Finalise every module's gradients (see the module docstring); removes the hooks.

        Plain mode: per module in sorted order, the fix-ups, then each bucket launched
        and landed. Overlapped: every module's fix-ups, the flush (the queue's remaining
        buckets launched in order), every all-reduce landed, then the modules outside
        the queue as in plain mode. ZeRO-1 reduce-scatters stay in flight: the
        optimizer's ``reduce_grads`` waits for them.
        """
        self.close()
        if self.overlap:
            for part in self.parts.values():
                part.fix_up()
            self._flush()
        for name, part in self.parts.items():
            if name in self.modules:
                continue
            if not self.overlap:
                part.fix_up()
            for bucket in part.buckets:  # one flat copy alive at a time
                launch(bucket)
                land(bucket)

    def _flush(self) -> None:
        """Launch the queue's remaining buckets in order, then land every all-reduce."""
        while self.num_launched < len(self.buckets):
            self.num_flushed += not self.buckets[self.num_launched].late
            self.launch_next()
        for bucket in self.buckets:
            land(bucket)

    def close(self) -> None:
        """Remove the hooks (idempotent); the step's ``finally`` calls it on errors too."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.armed = False


def finalize_model_grads(
    modules: dict[str, nn.Module],
    pg_collections: dict[str, ProcessGroupCollection],
    frozen: set[str] | None = None,
    optimizer_reduced: set[str] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Plain-mode gradient finalisation of ``modules`` (a :class:`GradSync` without overlap).

    Args:
        modules: the module parts this rank holds, keyed by module name.
        pg_collections: the process groups of each of those modules.
        frozen: modules that do not train (no gradient sync at all).
        optimizer_reduced: modules whose sharded optimizer reduce-scatters their
            gradients itself (ZeRO-1).
        bucket_bytes: upper bound of one all-reduce (``train.grad_bucket_mb``).
    """
    GradSync(modules, pg_collections, frozen or (), bucket_bytes,
             sharded=optimizer_reduced or ()).finish()
