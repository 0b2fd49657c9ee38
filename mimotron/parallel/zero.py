"""ZeRO-1: a module's optimizer state sharded over its data-parallel group.

Each parameter is split along its first dimension of size > 1 into ``D`` row chunks
with ``torch.chunk`` semantics (``ceil(rows / D)`` rows each; trailing ranks may get
fewer or none) - the split of a DTensor ``Shard(dim)``. So the state checkpoints as
DTensors with the parameter's own global shape: it reshards to another DP degree and
loads into an unsharded optimizer. The dimension is the first one larger than 1 because
slicing it is a contiguous view (``pos_embed [1, T, H]`` splits along ``T``).

A rank's optimizer steps only its *fragments*, leaf parameters holding its rows of the
model parameters. Under ``train.precision = "fp32"`` they are views of the model's rows,
so the step updates the model in place (the weights are their own master). Under bf16
or fp16 (``param_dtype``) the module is held as Megatron-Core's distributed optimizer
holds it, ``6 + 12 / D`` bytes per parameter: the model parameters in the 16-bit
compute dtype (2 B), an fp32 gradient buffer per parameter (``main_grad``, 4 B,
:mod:`~mimotron.parallel.main_grad`), and per rank the fp32 *master* copy of its rows
(the fragments, 4 / D B) with their Adam moments (8 / D B). The masters start as the fp32
values the model was built or loaded with; the model's 16-bit weights are cast from
them after every step (never the other way round); the gradients are reduce-scattered
from the fp32 ``main_grad`` and the received rows are written back into this rank's
rows of it, which the fragment's ``.grad`` then views (no second fp32 copy); the
all-gather sends the masters cast to 16 bits. One step of a sharded module:

1. ``reduce_grads``: per bucket, the gradients are laid out rank-major (rank ``r``'s
   rows of every parameter, each padded to ``ceil(rows / D)`` rows, then rank
   ``r + 1``'s) and reduce-scattered (SUM): each rank receives exactly the summed rows it
   steps. The data-parallel all-reduce skips the module (it is ``sharded`` in
   :class:`~mimotron.parallel.grad_sync.GradSync`).
2. the optimizer unscales, takes the norm (a fragment sum over the DP group), clips and
   steps the fragments;
3. ``gather_params``: the same layout all-gathered, so every replica holds every row.

With ``train.overlap_grad_reduce`` the reduce-scatter of each bucket is launched during
the last backward (:meth:`ZeroShards.launch_reduce`, called by
:class:`~mimotron.parallel.grad_sync.GradSync`) and step 1 only waits. With
``train.overlap_param_gather`` step 3 only launches the all-gathers; the rows land in
the model (:meth:`ZeroShards.finish_gather`) when the module next runs a forward (pre-hooks
on every submodule), when its ``state_dict`` is read, or before anything else that reads
or writes the parameters (the next optimizer step, a checkpoint save or load). Same
buckets, same collectives: bit-identical either way.

Tensor parallelism (DTensor parameters over the module's ``tp`` axis) and expert
shards (over ``ep``, and ``expt_tp`` with expert tensor parallelism) compose the same
way: what is split over the DP group is the parameter's *local* tensor, so each TP rank
reduce-scatters, steps and all-gathers its own shard with the DP replicas of that shard.
A DTensor gradient whose placements differ from its parameter's (partial, strided) is
redistributed first, as ``align_grad_placements`` does for the all-reduce path. Counted
once in the grad norm: a fragment of a ``Shard`` over ``tp`` on every TP rank, a
fragment of a replicated parameter (plain, or ``Replicate`` over ``tp``) on TP rank 0
only (:func:`~mimotron.optim.grads.counted_on_rank`). The state checkpoints as DTensors
over a mesh nested like the sharding itself: the parameter's own mesh axes, then the DP
group (``(tp, dp)``, ``(ep, expt_dp)``, ``(ep, expt_tp, expt_dp)``), with the
parameter's placements followed by ``Shard(dim)`` of the row split.

Per-rank optimizer state is the state of its rows: the module's (local shard's) state
divided by ``D``, give or take one row per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.utils.hooks import RemovableHandle

from mimotron.parallel.data_parallel import (
    DEFAULT_BUCKET_BYTES,
    bucket_params,
    same_placements,
)
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.main_grad import (
    cast_param_,
    clear_main_grad,
    grad_buffer,
    set_grad_buffer,
    use_main_grad,
)


def shard_dim(shape: torch.Size | tuple[int, ...]) -> int:
    """The dimension a parameter is split along: the first of size > 1 (else 0)."""
    return next((d for d, n in enumerate(shape) if n > 1), 0)


def chunk_range(rows: int, num_shards: int, shard_rank: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of one shard with ``torch.chunk`` (DTensor ``Shard``) semantics."""
    chunk = math.ceil(rows / num_shards)
    start = min(shard_rank * chunk, rows)
    return start, min(start + chunk, rows)


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's rows live in its bucket."""

    name: str
    param: nn.Parameter
    dim: int
    rows: int  # size along dim
    row_numel: int  # elements per row (numel / rows)
    chunk: int  # rows per shard, padded: ceil(rows / D)
    start: int  # this rank's rows [start, end)
    end: int
    offset: int  # elements before this parameter in one rank's segment of the bucket

    @property
    def local(self) -> torch.Tensor:
        """The parameter's local tensor (itself unless a DTensor), its storage."""
        return _local(self.param)

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.row_numel

    @property
    def local_numel(self) -> int:
        return (self.end - self.start) * self.row_numel

    def rows_view(self) -> torch.Tensor:
        """The whole parameter as ``[rows, row_numel]`` (a view: writes reach the model)."""
        return self.local.detach().view(self.rows, self.row_numel)

    def fragment_view(self) -> torch.Tensor:
        """This rank's rows of the parameter, in the parameter's layout (a view)."""
        return self.local.detach().narrow(self.dim, self.start, self.end - self.start)


class ZeroShards:
    """Row shards of one module's parameters over its DP group (ZeRO stage 1).

    Args:
        named_params: the module's trainable ``(name, parameter)`` pairs, identical (names,
            shapes, order) on every rank of ``group``.
        group: the module's data-parallel group (more than one rank), or ``expt_dp`` for
            expert shards.
        bucket_bytes: upper bound of one reduce-scatter / all-gather.
        expert: the parameters are expert-parallel shards (DTensors over an ``ep`` mesh
            axis) and ``group`` is ``expt_dp``, which may be a single rank.
        param_dtype: hold the model parameters in this (16-bit) dtype with fp32 master
            fragments and ``main_grad`` buffers (see the module docstring); the
            parameters are cast here, after their fp32 values were copied into the
            masters. ``None`` (or fp32): fragments are views of the fp32 parameters.

    Raises:
        ValueError: a parameter whose placements are not ``Shard``/``Replicate`` (FSDP's
            strided shards, partial values), a dense parameter that is an expert shard
            or the reverse, a 0-dim or non-contiguous local tensor, or a dense group of
            one rank.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        expert: bool = False,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        _check_params(named_params, expert)
        if dist.get_world_size(group) < 2 and not expert:
            raise ValueError("a sharded optimizer needs a data-parallel group of 2 or more ranks")
        self._expert = expert
        self.group = group
        self.num_shards = dist.get_world_size(group)
        self.shard_rank = dist.get_rank(group)
        # State meshes, one per parameter mesh (None: plain parameters); built lazily.
        self._meshes: dict[DeviceMesh | None, DeviceMesh] = {}
        names = {id(p): n for n, p in named_params}
        self._buckets: list[tuple[list[_Slot], int]] = []
        for bucket in bucket_params([p for _, p in named_params], bucket_bytes):
            slots, offset = [], 0
            for p in bucket:
                slot = self._slot(names[id(p)], p, offset)
                slots.append(slot)
                offset += slot.padded_numel
            self._buckets.append((slots, offset))
        self._slots = {s.name: s for slots, _ in self._buckets for s in slots}
        self.has_master = param_dtype not in (None, torch.float32)
        """Fragments are fp32 masters of 16-bit parameters (not views of the model)."""
        self.fragments = [(s.name, nn.Parameter(self._master_rows(s) if self.has_master
                                                else s.fragment_view()))
                          for s in self._slots.values()]
        self._fragment = dict(self.fragments)
        if self.has_master:
            for s in self._slots.values():
                cast_param_(s.param, param_dtype)
                use_main_grad(s.param)
        # In-flight collectives: bucket index -> (received rows, handle) of a
        # reduce-scatter launched during the backward; one (rows, handle) per bucket of
        # an all-gather launched after the optimizer step.
        self._pending_reduce: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        self._pending_gather: list[tuple[torch.Tensor, dist.Work]] = []

    def _slot(self, name: str, p: nn.Parameter, offset: int) -> _Slot:
        local = _local(p)
        dim = shard_dim(local.shape)
        rows = local.shape[dim]
        start, end = chunk_range(rows, self.num_shards, self.shard_rank)
        return _Slot(name, p, dim, rows, local.numel() // rows,
                     math.ceil(rows / self.num_shards), start, end, offset)

    @staticmethod
    def _master_rows(s: _Slot) -> torch.Tensor:
        """An fp32 copy of this rank's rows (from the parameter's current values)."""
        return s.fragment_view().to(torch.float32, copy=True)

    # ---- the step --------------------------------------------------------------------
    @property
    def num_buckets(self) -> int:
        """Number of reduce-scatter / all-gather buckets (``train.grad_bucket_mb`` each)."""
        return len(self._buckets)

    def bucket_params(self, index: int) -> list[nn.Parameter]:
        """The model parameters of bucket ``index`` (registration order)."""
        return [s.param for s in self._buckets[index][0]]

    def launch_reduce(self, index: int) -> None:
        """Start bucket ``index``'s asynchronous reduce-scatter (SUM) over the DP group.

        The send buffer is a fresh rank-major copy of the gradients, so the backward may
        go on accumulating elsewhere; :meth:`reduce_grads` waits for it. A parameter
        without a gradient on this rank (its modality was absent from the slice)
        contributes zeros. A DTensor gradient in other placements than its parameter's
        is redistributed first: a collective over the parameter's TP mesh, whose ranks
        saw the same samples and launch the same buckets in the same order.
        """
        assert index not in self._pending_reduce, f"bucket {index} launched twice"
        slots, seg = self._buckets[index]
        d = self.num_shards
        parts = []
        for s in slots:
            g = _aligned_local_grad(s.param)
            # Masters: the fp32 main_grad is reduced (zeros of that dtype too).
            grad_dtype = torch.float32 if self.has_master else s.local.dtype
            rows = (torch.zeros(s.rows, s.row_numel, dtype=grad_dtype, device=s.local.device)
                    if g is None else g.reshape(s.rows, s.row_numel))
            rows = F.pad(rows, (0, 0, 0, s.chunk * d - s.rows))
            parts.append(rows.reshape(d, s.padded_numel))
        send = torch.cat(parts, dim=1).reshape(-1)
        recv = send.new_empty(seg)
        handle = dist.reduce_scatter_single(recv, send, op=dist.ReduceOp.SUM, group=self.group,
                                            async_op=True)
        self._pending_reduce[index] = (recv, handle)

    def reduce_grads(self) -> None:
        """Reduce-scatter (SUM) the model gradients into the fragments' ``.grad``.

        Collective over the DP group. Buckets already launched (during the backward, by
        :class:`~mimotron.parallel.grad_sync.GradSync`) are only waited for;
        the others are launched here, in bucket order, each waited for before the next
        is launched. Either way each bucket is the same collective on the same buffer,
        so the result is the same.
        """
        for index, (slots, _) in enumerate(self._buckets):
            if index not in self._pending_reduce:
                # Launched and waited for one at a time: one bucket's padded copy is
                # alive at once (``train.grad_bucket_mb`` bounds it), not the module's.
                self.launch_reduce(index)
            recv, handle = self._pending_reduce.pop(index)
            handle.wait()
            for s in slots:
                frag = self._fragment[s.name]
                rows = recv[s.offset : s.offset + s.local_numel].view(frag.shape)
                frag.grad = self._own_rows(s, rows) if self.has_master else rows

    def _own_rows(self, s: _Slot, rows: torch.Tensor) -> torch.Tensor:
        """The reduced rows written into this rank's rows of ``main_grad`` (a view of them).

        So the fragment's gradient needs no fp32 storage of its own; a parameter that
        had no gradient here keeps a copy of the rows instead.
        """
        buf = _aligned_local_grad(s.param)
        if buf is None:
            return rows.clone()
        own = buf.narrow(s.dim, s.start, s.end - s.start)
        own.copy_(rows)
        return own

    def gather_params(self, async_op: bool = False) -> None:
        """All-gather every rank's rows into the model parameters (collective over DP).

        Args:
            async_op: only launch the all-gathers (``train.overlap_param_gather``); the
                rows land in the model at :meth:`finish_gather`, which the forward
                pre-hooks of :meth:`wait_before_forward` (or any reader) call first.
                Every bucket's receive buffer stays alive until then: one (padded) copy
                of the module's parameters, which ``mimotron plan`` counts
                (:func:`~mimotron.estimate.memory.param_gather_bytes`). Without it, each
                bucket is waited for and copied before the next is launched.
        """
        self.finish_gather()  # a previous gather must land before its buffers go
        for slots, seg in self._buckets:
            recv, handle = self._launch_gather(slots, seg)
            if async_op:
                self._pending_gather.append((recv, handle))
            else:  # one bucket's buffers alive at a time (train.grad_bucket_mb)
                self._land_gather(slots, seg, recv, handle)

    def _launch_gather(self, slots: list[_Slot], seg: int) -> tuple[torch.Tensor, dist.Work]:
        """Start one bucket's all-gather of every rank's padded rows (rank-major)."""
        with torch.no_grad():
            parts = []
            for s in slots:
                local = self._fragment[s.name].detach().reshape(s.end - s.start, s.row_numel)
                local = local.to(s.local.dtype)  # masters: the 16-bit rows are gathered
                parts.append(F.pad(local, (0, 0, 0, s.chunk - (s.end - s.start))).reshape(-1))
            send = torch.cat(parts)
            recv = send.new_empty(self.num_shards * seg)
            return recv, dist.all_gather_single(recv, send, group=self.group, async_op=True)

    def _land_gather(self, slots: list[_Slot], seg: int, recv: torch.Tensor,
                     handle: dist.Work) -> None:
        """Wait for one bucket's all-gather and copy every rank's rows into the model."""
        handle.wait()
        with torch.no_grad():
            table = recv.view(self.num_shards, seg)
            for s in slots:
                full = table[:, s.offset : s.offset + s.padded_numel]
                s.rows_view().copy_(full.reshape(self.num_shards * s.chunk, s.row_numel)
                                    [: s.rows])

    @property
    def gather_pending(self) -> bool:
        """An all-gather was launched and its rows are not in the model yet."""
        return bool(self._pending_gather)

    def finish_gather(self) -> None:
        """Wait for the launched all-gathers and copy the rows into the model (idempotent)."""
        pending, self._pending_gather = self._pending_gather, []
        if not pending:
            return
        for (slots, seg), (recv, handle) in zip(self._buckets, pending, strict=True):
            self._land_gather(slots, seg, recv, handle)

    def wait_before_forward(self, module: nn.Module) -> list[RemovableHandle]:
        """Forward pre-hooks on ``module`` and every submodule: finish a pending gather.

        The handles are returned and also listed on ``module`` (see
        :func:`remove_gather_hooks`).

        Every submodule, not only ``module``: the model calls some of them directly
        (``language_model.embed_tokens``) before its own forward. ``state_dict`` waits
        too, so a save never reads half-gathered rows.
        """
        hooks = [m.register_forward_pre_hook(lambda *_: self.finish_gather())
                 for m in module.modules()]
        hooks.append(module.register_state_dict_pre_hook(lambda *_: self.finish_gather()))
        # Remembered on the module, so an optimizer built later on it removes them.
        module.__dict__.setdefault(GATHER_HOOKS_ATTR, []).extend(hooks)
        return hooks

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the model parameters and of the fragments.

        The fragments' gradients go too (every step's :meth:`reduce_grads` sets them
        anew): with masters each views its rows of the last step's fp32 ``main_grad``,
        and a view keeps the whole buffer alive, so the next backward would hold a
        second fp32 copy of the module's gradients; without, they view the received
        buckets. Also forgets reduce-scatters a hook launched in a step that then
        raised: the next step launches its buckets anew (an abandoned one would assert
        otherwise).
        """
        self._pending_reduce.clear()
        for _, frag in self.fragments:
            frag.grad = None
        for s in self._slots.values():
            if self.has_master:
                clear_main_grad(s.param)  # the fp32 buffer starts afresh each step
            elif set_to_none:
                s.param.grad = None
            elif s.param.grad is not None:
                s.param.grad.zero_()

    def repoint(self) -> None:
        """Re-view the fragments into the current parameter storage.

        Needed only if a parameter's storage was replaced (``load_state_dict(assign=True)``,
        ``.data = ...``); an in-place load keeps the views valid. With masters, the
        model's values were loaded instead: the masters are refreshed from them (to the
        precision the model holds; a checkpoint loads the fp32 masters themselves, see
        :meth:`master_weights`).
        """
        for s in self._slots.values():
            frag = self._fragment[s.name]
            if self.has_master:
                with torch.no_grad():
                    frag.copy_(s.fragment_view())
            else:
                frag.data = s.fragment_view()

    def master_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """``(model parameter, its fp32 master)`` pairs; empty without masters.

        Each master is this rank's rows as a DTensor of the parameter's global shape
        (:meth:`to_dtensor`), sharing the fragment's storage: a checkpoint stores it as
        the model weight (fp32, so a plain fp32 run and any ZeRO layout load the same
        values) and DCP loads into the fragment in place; :meth:`gather_params` then
        casts it into the model.
        """
        if not self.has_master:
            return []
        return [(s.param, self.to_dtensor(s.name, self._fragment[s.name].detach()))
                for s in self._slots.values()]

    def model_param(self, name: str) -> nn.Parameter:
        """The model parameter whose rows fragment ``name`` holds."""
        return self._slots[name].param

    # ---- state conversion --------------------------------------------------------------
    def local_state(self, name: str, value: Any) -> Any:
        """A saved state value as this rank's piece of parameter ``name``.

        Accepts this rank's rows (a sharded state dict of the same layout), the full
        parameter shape (an unsharded state dict: the rows are sliced out) or a DTensor
        loaded by DCP; scalars (``step``) pass through.

        Raises:
            ValueError: a tensor of any other shape (a sharded state dict of another DP
                degree: reshard it through ``sharded_state_dict`` and DCP instead).
        """
        if isinstance(value, DTensor):
            value = value.to_local()
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        s, frag = self._slots[name], self._fragment[name]
        if value.shape == frag.shape:
            return value
        if value.shape == s.local.shape:
            return value.narrow(s.dim, s.start, s.end - s.start).clone()
        raise ValueError(
            f"optimizer state of {name!r} has shape {tuple(value.shape)}: expected this "
            f"rank's shard {tuple(frag.shape)} or the full {tuple(s.local.shape)}; a state "
            "saved with another data-parallel degree loads through sharded_state_dict (DCP)"
        )

    def to_dtensor(self, name: str, value: Any) -> Any:
        """This rank's piece of a state tensor as a DTensor of the parameter's shape.

        Over the parameter's own mesh axes (none for a plain parameter) and then the DP
        group; placements: the parameter's, then ``Shard`` along the split dimension.
        """
        frag = self._fragment[name]
        if not isinstance(value, torch.Tensor) or value.shape != frag.shape or value.dim() == 0:
            return value
        s = self._slots[name]
        outer = s.param.device_mesh if isinstance(s.param, DTensor) else None
        if outer not in self._meshes:
            self._meshes[outer] = self._state_mesh(outer, s.local.device.type)
        placements: list[Placement] = [*outer_placements(s.param), Shard(s.dim)]
        return DTensor.from_local(value, self._meshes[outer], placements, run_check=False,
                                  shape=s.param.shape, stride=s.param.stride())

    def _state_mesh(self, outer: DeviceMesh | None, device_type: str) -> DeviceMesh:
        """``group``, or the parameter mesh's axes followed by ``group``'s.

        Grid ranks are linear in their coordinates, so the rank at parameter-mesh
        position ``i`` and DP index ``d`` is ``outer[i] + dp[d] - me``.
        """
        if outer is None:
            return DeviceMesh.from_group(self.group, device_type)
        me = dist.get_rank()
        dp = torch.tensor(dist.get_process_group_ranks(self.group))
        mesh = outer.mesh.unsqueeze(-1) + (dp - me)
        assert mesh.unique().numel() == mesh.numel(), "the DP group crosses the parameter mesh"
        groups = [outer.get_group(i) for i in range(outer.ndim)] + [self.group]
        names = (*(outer.mesh_dim_names or [f"axis{i}" for i in range(outer.ndim)]),
                 "expt_dp" if self._expert else "dp")
        return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


class ExpertSplitShards:
    """ZeRO-1 of an expert-parallel module: dense rows over ``dp``, expert rows over ``expt_dp``.

    The same interface as :class:`ZeroShards` (what ``MimoOptimizer`` calls), delegating
    by parameter name. ``group`` is the dense part's group; ``expert_names`` and
    ``expert_group`` tell the grad norm which fragments to sum over ``expt_dp`` (and
    then over the EP ranks) instead.

    Args:
        dense: the dense parameters' shards over the module's DP group.
        expert: the expert shards' rows over ``expt_dp`` (``ZeroShards(..., expert=True)``).
    """

    def __init__(self, dense: ZeroShards, expert: ZeroShards) -> None:
        self.dense, self.expert = dense, expert
        self.group = dense.group
        self.expert_group = expert.group
        self.fragments = dense.fragments + expert.fragments
        self.expert_names = {n for n, _ in expert.fragments}

    def _part(self, name: str) -> ZeroShards:
        return self.expert if name in self.expert_names else self.dense

    def reduce_grads(self) -> None:
        """Reduce-scatter both parts (dense over ``dp``, then experts over ``expt_dp``)."""
        self.dense.reduce_grads()
        self.expert.reduce_grads()

    def gather_params(self, async_op: bool = False) -> None:
        """All-gather both parts' rows into the model parameters."""
        self.dense.gather_params(async_op)
        self.expert.gather_params(async_op)

    @property
    def gather_pending(self) -> bool:
        """See :attr:`ZeroShards.gather_pending`."""
        return self.dense.gather_pending or self.expert.gather_pending

    def finish_gather(self) -> None:
        """See :meth:`ZeroShards.finish_gather`."""
        self.dense.finish_gather()
        self.expert.finish_gather()

    def wait_before_forward(self, module: nn.Module) -> list[RemovableHandle]:
        """See :meth:`ZeroShards.wait_before_forward`."""
        return self.dense.wait_before_forward(module) + self.expert.wait_before_forward(module)

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """Clear the model gradients of both parts."""
        self.dense.zero_model_grads(set_to_none)
        self.expert.zero_model_grads(set_to_none)

    def repoint(self) -> None:
        """Re-view both parts' fragments into the current parameter storage."""
        self.dense.repoint()
        self.expert.repoint()

    def model_param(self, name: str) -> nn.Parameter:
        """See :meth:`ZeroShards.model_param`."""
        return self._part(name).model_param(name)

    @property
    def has_master(self) -> bool:
        """See :attr:`ZeroShards.has_master`."""
        return self.dense.has_master

    def master_weights(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """See :meth:`ZeroShards.master_weights`."""
        return self.dense.master_weights() + self.expert.master_weights()

    def local_state(self, name: str, value: Any) -> Any:
        """See :meth:`ZeroShards.local_state`."""
        return self._part(name).local_state(name, value)

    def to_dtensor(self, name: str, value: Any) -> Any:
        """See :meth:`ZeroShards.to_dtensor`."""
        return self._part(name).to_dtensor(name, value)


GATHER_HOOKS_ATTR = "_mimotron_param_gather_hooks"
"""Attribute of a module listing the pre-hooks :meth:`ZeroShards.wait_before_forward` put."""


def remove_gather_hooks(module: nn.Module) -> None:
    """Remove every gather pre-hook a (previous) sharded optimizer put on ``module``."""
    for hook in module.__dict__.pop(GATHER_HOOKS_ATTR, []):
        hook.remove()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (sharing its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def outer_placements(p: torch.Tensor) -> list[Placement]:
    """A DTensor parameter's placements (the row split nests inside them); [] if plain."""
    return list(p.placements) if isinstance(p, DTensor) else []


def _aligned_local_grad(p: nn.Parameter) -> torch.Tensor | None:
    """The local gradient laid out like the parameter's local tensor (detached), or None.

    The gradient is ``.grad``, or the fp32 ``main_grad`` of a 16-bit parameter (any
    ``.grad`` not yet added into it is added first). A DTensor gradient may come back
    replicated, partial or strided (``align_grad_placements``); it is redistributed to
    the parameter's placements and put back (a collective over its mesh when partial),
    so the model holds one local-shard-sized gradient as without ZeRO.
    """
    g = grad_buffer(p)
    if isinstance(g, DTensor):
        if not same_placements(g.placements, p.placements):
            g = g.redistribute(p.device_mesh, p.placements)
            set_grad_buffer(p, g)
        g = g.to_local()
    return None if g is None else g.detach()


def _check_params(named_params: list[tuple[str, nn.Parameter]], expert: bool) -> None:
    """Raise for a parameter whose local tensor cannot be row-sharded (see ZeroShards)."""
    for name, p in named_params:
        if is_expert_param(p) != expert:
            what = "is not" if expert else "is"
            raise ValueError(f"parameter {name!r} {what} an expert-parallel shard")
        if isinstance(p, DTensor):
            if not all(type(pl) is Shard or pl.is_replicate() for pl in p.placements):
                raise ValueError(
                    f"parameter {name!r} has placements {tuple(p.placements)}: "
                    "shard_optimizer splits tensor-parallel (Shard / Replicate) parameters "
                    "only, not FSDP or partial ones; set parallel.shard_optimizer = false"
                )
            p = p.to_local()
        if p.dim() == 0 or not p.is_contiguous():
            raise ValueError(
                f"parameter {name!r} (local shape {tuple(p.shape)}) cannot be row-sharded: "
                "shard_optimizer needs contiguous parameters with at least one dimension"
            )
