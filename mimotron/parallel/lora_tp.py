"""LoRA adapters on tensor-parallel linear layers (Megatron's split of an adapter).

An adapter ``y = s B A x`` (:mod:`mimotron.models.lora`) on a layer that the TP plan
split is split to match, so that no rank ever holds the whole update and the result is
the one-process one:

* **column-parallel** layer (``wq/wk/wv``, ``w1/w3``, ``fc1``; weight ``Shard(0)``, input
  whole, output this rank's features): ``A`` whole on every rank, ``B`` sharded like the
  weight (``Shard(0)``), so ``B_t A x`` is exactly rank ``t``'s output features. ``A``'s
  gradient ``sum_t B_t^T g_t x^T`` is a partial sum over TP: marked, and summed with the
  other marked gradients before the data-parallel sync; the gradient of ``x`` through
  the adapter is partial too, and joins the layer's own partial input gradient, which
  the plan all-reduces.
* **row-parallel** layer (``wo``, ``w2``, ``fc2``; weight ``Shard(1)``, input this rank's
  features, output summed over TP): ``A`` sharded like the weight (``Shard(1)``), its
  rank-``r`` activations ``A_t x_t`` summed over TP (``r`` values per position: the
  adapter's only collective, an all-reduce), then ``B`` whole. Under sequence
  parallelism the layer's output is this rank's chunk of the sequence: the sum is a
  reduce-scatter into that chunk (its backward gathers the chunks' gradients), and
  ``B``'s gradient, from the chunk only, is marked like ``A``'s above.

Dropout on the adapter's input is refused with TP (the ranks would drop different
inputs: :func:`~mimotron.config.lora.check_lora`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from mimotron.models.lora import low_rank
from mimotron.parallel.sequence_parallel import SP_ATTR

__all__ = ["shard_lora"]


def _column(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    assert isinstance(x, DTensor), "a column-parallel layer's input is a DTensor"
    # Each rank's adapter path gives a part of the input's gradient: declare it partial,
    # so the plan's input all-reduce sums it with the layer's own.
    local = x.to_local(grad_placements=[Partial()])
    b = layer.lora_b.to_local()
    return F.linear(low_rank(layer, local, layer.lora_a), b) * layer.lora_state.scale


def _row(layer: nn.Linear, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    local = x.to_local() if isinstance(x, DTensor) else x
    partial = DTensor.from_local(low_rank(layer, local, layer.lora_a.to_local()),
                                 layer.weight.device_mesh, [Partial()], run_check=False)
    # Summed over TP: whole (an all-reduce), or under sequence parallelism this rank's
    # chunk of the sequence (a reduce-scatter, whose backward gathers the chunks'
    # gradients back), as the layer's own output is.
    h = partial.redistribute(placements=[Shard(1) if sequence_parallel else Replicate()])
    return F.linear(h.to_local(), layer.lora_b) * layer.lora_state.scale


def shard_lora(part: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> int:
    """Shard the adapters of a module part's tensor-parallel layers (module docs).

    Call after :func:`~mimotron.models.lora.attach_lora` (whole-shape adapters) on a
    part whose TP plan is applied. Layers the plan did not split keep plain adapters.

    Args:
        part: the module part.
        mesh: its 1-D TP mesh.
        sequence_parallel: the part is a sequence-parallel language model (its
            row-parallel layers output sequence chunks).

    Returns:
        How many adapters were sharded.
    """
    count = 0
    for layer in part.modules():
        if not (isinstance(layer, nn.Linear) and hasattr(layer, "lora_state")
                and isinstance(layer.weight, DTensor)):
            continue
        placement = layer.weight.placements[0]
        assert isinstance(placement, Shard), f"unexpected TP placement {placement}"
        if placement.dim == 0:  # column-parallel
            layer.lora_b = nn.Parameter(distribute_tensor(layer.lora_b.detach(), mesh,
                                                          [Shard(0)]))
            setattr(layer.lora_a, SP_ATTR, True)
            layer.lora_state.combine = _column
        else:  # row-parallel
            layer.lora_a = nn.Parameter(distribute_tensor(layer.lora_a.detach(), mesh,
                                                          [Shard(1)]))
            if sequence_parallel:
                setattr(layer.lora_b, SP_ATTR, True)
            layer.lora_state.combine = functools.partial(
                _row, sequence_parallel=sequence_parallel)
        count += 1
    return count
