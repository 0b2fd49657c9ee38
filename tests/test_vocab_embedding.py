"""The vocabulary-parallel embedding: a rank's gradient is its shard only, and exact.

The whole-model TP parity cases (``tests/test_parity.py``, tensor=2) check it inside
training; here the point is what one rank's backward makes: no tensor of the whole
vocabulary's size, a ``Shard(0)`` gradient whose rows equal one process's; on TP groups
where a rank's place differs from its global rank (4 ranks), lookups and gradients equal
``nn.Embedding``'s, a padding row in the upper shard included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mimotron.forked_ranks import run_ranks

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


def _tokens_and_grad(padding_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids from every quarter of the vocabulary, repeated ids and (when set) the padding
    row next to the id at the same local offset in the lower shard (a padding row applied
    on the wrong shard zeroes that id's gradient)."""
    tokens = torch.randint(0, VOCAB, (2, 8))
    tokens[0, :4] = torch.tensor([0, VOCAB // 4, VOCAB // 2 + 1, VOCAB - 1])
    tokens[1, 0] = tokens[1, 1]
    if padding_idx is not None:
        tokens[1, 2:6] = torch.tensor([padding_idx, padding_idx, padding_idx - VOCAB // 2,
                                       padding_idx - VOCAB // 4])
    return tokens, torch.randn(2, 8, HIDDEN)


def _sharded_against_plain(mesh, padding_idx: int | None) -> dict:  # noqa: ANN001
    """One sharded lookup and backward against ``nn.Embedding``'s, on ``mesh``'s group."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module

    from mimotron.parallel.vocab_embedding import VocabParallelEmbedding

    torch.manual_seed(1)
    reference = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
    tokens, grad_out = _tokens_and_grad(padding_idx)
    expected = reference(tokens)
    (expected * grad_out).sum().backward()

    sharded = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
    sharded.load_state_dict(reference.state_dict())
    parallelize_module(sharded, mesh, VocabParallelEmbedding())
    out = sharded(tokens)
    (out * grad_out).sum().backward()
    group = mesh.get_group()
    shard = VOCAB // mesh.size()
    rows = slice(dist.get_rank(group) * shard, (dist.get_rank(group) + 1) * shard)
    result = {"group_rank": dist.get_rank(group),
              "out_equal": torch.equal(out, expected),
              "grad_equal": torch.equal(sharded.weight.grad.to_local(),
                                        reference.weight.grad[rows])}
    if padding_idx is not None:
        pad_rows = tokens == padding_idx
        result["pad_out_zero"] = bool((out[pad_rows] == 0).all())
        # Zero although the padding id occurs, so the check above is not vacuous.
        result["pad_grad"] = (reference.weight.grad[padding_idx].abs().sum().item(),
                              sharded.weight.grad.full_tensor()[padding_idx].abs().sum().item())
    return result


def _offset_groups_rank(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    # "tp" groups are {0, 1}, {2, 3}; "dp" groups {0, 2}, {1, 3}: on each, a rank's place
    # in its group differs from its global rank somewhere (rank 2 is first of {2, 3}).
    return {"tp": _sharded_against_plain(mesh["tp"], None),
            "dp": _sharded_against_plain(mesh["dp"], None),
            "tp_padded": _sharded_against_plain(mesh["tp"], VOCAB - 3)}


@pytest.fixture(scope="module")
def offset_groups() -> list[dict]:
    return run_ranks(4, _offset_groups_rank, timeout_s=120)


def test_lookup_and_gradient_use_the_rank_inside_the_tp_group(offset_groups) -> None:
    assert [r["tp"]["group_rank"] for r in offset_groups] == [0, 1, 0, 1]
    assert [r["dp"]["group_rank"] for r in offset_groups] == [0, 0, 1, 1]
    for rank, r in enumerate(offset_groups):
        for mesh_dim in ("tp", "dp"):
            assert r[mesh_dim]["out_equal"] and r[mesh_dim]["grad_equal"], (rank, mesh_dim, r)


def test_padding_idx_in_the_upper_shard_is_zero_and_gets_no_gradient(offset_groups) -> None:
    for rank, r in enumerate(offset_groups):
        padded = r["tp_padded"]
        # nn.Embedding's semantics: the padding row is zero (initialised so) and its
        # gradient stays zero; every other row's gradient is exact on its shard.
        assert padded["pad_out_zero"] and padded["out_equal"], (rank, padded)
        assert padded["grad_equal"], (rank, padded)
        assert padded["pad_grad"] == (0.0, 0.0), (rank, padded)
