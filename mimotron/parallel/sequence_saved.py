"""Sequence parallelism keeps the sharded input of its column-parallel linears.

Under sequence parallelism (:mod:`mimotron.parallel.sequence_parallel`) the input of
``attn`` (``wq``/``wk``/``wv``) and of ``mlp`` (``w1``/``w3``) arrives sharded along the
sequence and is all-gathered before the linears. Autograd would keep the *gathered*
tensor for the linears' weight gradients: ``2 x hidden`` bytes per token (bf16) that
every TP rank holds whole, more than a third of a layer's activations at TP 8. Megatron
keeps the shard and all-gathers it again in backward; so does this.

How: a pack hook (``torch.autograd.graph.saved_tensors_hooks``) around ``attn`` and
``mlp`` recognises saved tensors that are views of the gathered input (by storage) and
keeps, instead, the shard it was gathered from plus the view's geometry. The first
unpack in backward all-gathers the shard again over the TP group and every other unpack
of the same forward reuses that tensor; it is freed once the last linear's backward has
run. The all-gather in backward is a plain ``dist.all_gather`` over the TP group, in
the order autograd runs the layer's nodes, which is the same on every TP rank.

Saved-tensor hooks do not nest: inside ``attn`` and ``mlp`` these replace any enclosing
pair, such as activation checkpointing's (``modules.<m>.recompute``). So everything
these hooks do not keep themselves is handed on to the enclosing pair, and so is the
shard they keep: under checkpointing nothing stays alive but what checkpoint keeps, and
the shard is recomputed with the rest of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Gathered:
    """One forward's gathered input: the shard it came from, regathered on demand."""

    shard: torch.Tensor
    group: dist.ProcessGroup
    storage: int
    full: torch.Tensor | None = None

    def regather(self) -> torch.Tensor:
        if self.full is None:
            parts = [torch.empty_like(self.shard) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, self.shard.contiguous(), group=self.group)
            self.full = torch.cat(parts, dim=1)
        return self.full


@dataclass
class _Packed:
    """A saved view of the gathered input, kept as its shard plus the view's geometry."""

    source: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    spec: Any = None  # the DTensor spec when the saved tensor was a DTensor
    shard: Any = None  # what the enclosing pack hook made of the shard, if there is one
    outer_unpack: Any = None  # the unpack hook paired with that pack hook


@dataclass
class _Outer:
    """A saved tensor handed to the enclosing pack hook (checkpoint, a measurement).

    The unpack hook is the one paired with that pack hook at packing time: by the time of
    the backward the keeper's ``outer`` may be another pair (a recomputation's).
    """

    packed: Any
    unpack: Any


@dataclass
class _ShardKeeper:
    """The hooks of one ``attn`` or ``mlp`` module."""

    group: dist.ProcessGroup
    shard: torch.Tensor | None = None
    current: _Gathered | None = None
    outer: tuple[Any, Any] | None = None
    contexts: list[Any] = field(default_factory=list)

    def before_gather(self, module: nn.Module, args: tuple) -> None:
        self.shard = args[0]

    def after_gather(self, module: nn.Module, args: tuple) -> None:
        assert self.shard is not None, "the shard-recording pre-hook did not run"
        self.current = _Gathered(self.shard, self.group, _storage(_local(args[0])))
        self.shard = None
        # Only the innermost pair of saved-tensor hooks runs, so what this pack does not
        # keep itself goes on to the enclosing pair: activation checkpointing then still
        # recomputes, and a measurement (mimotron.dryrun.saved_bytes) still counts.
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.contexts.append(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        self.contexts[-1].__enter__()

    def after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.contexts:
            self.contexts.pop().__exit__(None, None, None)
        if self.current is not None and self.outer is not None:
            # Every pack handed the shard to the enclosing hook, and unpack takes it from
            # there: holding it here too would keep what checkpointing drops.
            self.current.shard = None
        self.current = None

    def pack(self, t: torch.Tensor) -> Any:
        local = _local(t)
        if self.current is None or _storage(local) != self.current.storage:
            return t if self.outer is None else _Outer(self.outer[0](t), self.outer[1])
        source = self.current
        kept = None if self.outer is None else self.outer[0](source.shard)
        return _Packed(source, tuple(local.shape), tuple(local.stride()),
                       local.storage_offset(), getattr(t, "_spec", None), kept,
                       None if self.outer is None else self.outer[1])

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        if not isinstance(packed, _Packed):
            return packed
        if packed.shard is not None:
            # The enclosing hook's own copy of the shard (recomputed under checkpoint).
            packed.source.shard = packed.outer_unpack(packed.shard)
            packed.shard = None
        full = packed.source.regather()
        local = full.as_strided(packed.size, packed.stride, packed.offset)
        if packed.spec is None:
            return local
        from torch.distributed.tensor import DTensor

        spec = packed.spec
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def keep_sharded_inputs(layers: nn.ModuleDict, group: dist.ProcessGroup) -> int:
    """Install the hooks on every layer's ``attn`` and ``mlp`` (after the TP plan).

    Must run after ``parallelize_module``: the hook that records the shard is prepended
    to the plan's gathering pre-hook, the one that opens the pack context follows it.

    Args:
        layers: a sequence-parallel language stage's layers.
        group: the TP group the inputs are gathered over.

    Returns:
        The number of modules hooked.
    """
    count = 0
    for layer in layers.values():
        for name in ("attn", "mlp"):
            module = getattr(layer, name)
            keeper = _ShardKeeper(group)
            module.register_forward_pre_hook(keeper.before_gather, prepend=True)
            module.register_forward_pre_hook(keeper.after_gather)
            module.register_forward_hook(keeper.after_forward, always_call=True)
            count += 1
    return count
