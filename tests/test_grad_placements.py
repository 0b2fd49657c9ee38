"""Gradients are brought to their parameter's placement before the DP reduce.

DTensor may return a weight gradient as ``_StridedShard(d)`` where the weight is
``Shard(d)`` (it does for an empty input to a row-parallel linear): same global value,
other elements in each rank's local tensor. Some torch versions even compare the two
placements equal. ``align_grad_placements`` must redistribute such a gradient so its
local tensor holds the parameter's elements.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from mimotron.forked_ranks import run_ranks
from mimotron.parallel.data_parallel import align_grad_placements, same_placements


def test_same_placements_tells_strided_from_plain_shards():
    assert same_placements((Shard(1),), (Shard(1),))
    assert not same_placements((_StridedShard(1, split_factor=2),), (Shard(1),))
    assert not same_placements((Shard(0),), (Shard(1),))


def _align(rank: int, world: int) -> tuple[bool, bool]:
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full_weight = torch.arange(32.0).reshape(4, 8)
    full_grad = torch.arange(32.0).reshape(4, 8) * 0.5
    module = nn.Linear(8, 4, bias=False)
    module.weight = nn.Parameter(distribute_tensor(full_weight, mesh, [Shard(1)]))
    strided = distribute_tensor(full_grad, mesh, [_StridedShard(1, split_factor=2)])
    module.weight.grad = strided
    before = torch.equal(strided.to_local(), full_grad.chunk(world, dim=1)[rank])
    align_grad_placements(module)
    grad = module.weight.grad
    after = (same_placements(grad.placements, (Shard(1),))
             and torch.equal(grad.to_local(), full_grad.chunk(world, dim=1)[rank]))
    return before, after


def test_strided_gradient_is_redistributed_to_the_parameter_placement():
    for before, after in run_ranks(2, _align, timeout_s=60):
        assert not before  # the strided local tensor holds other columns
        assert after
