"""The vocabulary-parallel embedding: a rank's gradient is its shard only, and exact.

The whole-model TP parity cases (``tests/test_parity.py``, tensor=2) check it inside
training; here the point is what one rank's backward makes: no tensor of the whole
vocabulary's size, a ``Shard(0)`` gradient whose rows equal one process's.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mimotron.testing import run_ranks

VOCAB, HIDDEN = 64, 8


class _LargestOutput(TorchDispatchMode):
    """Records the most elements any op's output held on this rank (local shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        from torch.distributed.tensor import DTensor

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                local = t._local_tensor if isinstance(t, DTensor) else t
                self.largest = max(self.largest, local.numel())
        return out


def _embedding_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from mimotron.parallel.vocab_embedding import VocabParallelEmbedding

    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, HIDDEN)
    # Every range of the vocabulary, a repeated id (its rows' gradients add up).
    tokens = torch.randint(0, VOCAB, (2, 8))
    tokens[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])
    tokens[1, 0] = tokens[1, 1]
    grad_out = torch.randn(2, 8, HIDDEN)
    expected = reference(tokens)
    (expected * grad_out).sum().backward()

    sharded = nn.Embedding(VOCAB, HIDDEN)
    sharded.load_state_dict(reference.state_dict())
    parallelize_module(sharded, init_device_mesh("cpu", (world,)), VocabParallelEmbedding())
    out = sharded(tokens)
    backward = _LargestOutput()
    with backward:
        (out * grad_out).sum().backward()
    grad = sharded.weight.grad
    rows = slice(rank * VOCAB // world, (rank + 1) * VOCAB // world)
    assert isinstance(grad, DTensor) and tuple(grad.placements) == (Shard(0),)
    return {"out_equal": torch.equal(out, expected),
            "grad_local_shape": tuple(grad.to_local().shape),
            "grad_equal": torch.equal(grad.to_local(), reference.weight.grad[rows]),
            "largest_in_backward": backward.largest}


def test_vocab_parallel_embedding_gradient_is_the_shard_only() -> None:
    results = run_ranks(2, _embedding_rank, timeout_s=120)
    shard = VOCAB // 2 * HIDDEN
    for r in results:
        assert r["out_equal"] and r["grad_equal"], r
        assert r["grad_local_shape"] == (VOCAB // 2, HIDDEN)
        # No [vocab, hidden] partial sum: the backward's largest tensor is the shard.
        assert r["largest_in_backward"] == shard, r
