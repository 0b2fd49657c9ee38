"""The language model's embedding sharded over the vocabulary (Megatron's VocabParallelEmbedding).

Under tensor parallelism each rank of the TP group holds the contiguous vocabulary
range ``[rank * V / tp, (rank + 1) * V / tp)`` of the ``[V, hidden]`` weight, a DTensor
parameter placed ``Shard(0)`` (the same placement as the output head's, so tied
embeddings share one parameter). A lookup runs on local tensors:

1. token ids outside the rank's range are masked (looked up as local row 0),
2. ``F.embedding`` reads the local shard, and the masked rows of its output are zeroed,
3. the outputs are summed over the TP group (:class:`ReplicatedSum`): every token's row
   comes from exactly one rank, so the sum is the whole lookup, on every rank.

The backward is the local lookup's: the incoming gradient (whole on every TP rank, as
the replicated stream's is) goes through the mask to ``F.embedding``'s backward, which
makes a gradient of the local shard's shape only (``V / tp`` rows; 125 MiB in fp32 at
Llama-2-70B's vocabulary and hidden size at TP 8). ``to_local``'s backward wraps it back
into a ``Shard(0)`` DTensor like the parameter. DTensor's own rule for a row-wise
embedding (``RowwiseParallel``) computes that backward as a ``[V, hidden]`` partial sum
on every rank instead: the whole vocabulary's gradient, ``tp`` times the shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicatedSum(torch.autograd.Function):
    """All-reduce SUM whose result feeds computation replicated on every rank of the group.

    Every rank computes the same thing from the sum, so the gradient reaching each rank's
    partial term is already the full gradient: backward is the identity (an all-reduce
    here would count it once per rank). Megatron's ``reduce_from_tensor_model_parallel_region``.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, None


def vocab_parallel_lookup(tokens: torch.Tensor, weight: torch.Tensor,
                          group: dist.ProcessGroup,
                          padding_idx: int | None = None) -> torch.Tensor:
    """Embedding rows of global ``tokens`` from this rank's vocabulary shard, summed over TP.

    Args:
        tokens: ``[...]`` global token ids, the same on every rank of ``group``.
        weight: this rank's ``[V / tp, hidden]`` rows (a plain tensor: the local shard),
            the ``rank``-th contiguous range in ``group``'s rank order.
        group: the TP group.
        padding_idx: the embedding's global padding row (its gradient stays zero).

    Returns:
        ``[..., hidden]``, the whole lookup, the same on every rank.
    """
    rows = weight.shape[0]
    start = dist.get_rank(group) * rows
    local = tokens - start
    outside = (local < 0) | (local >= rows)
    local_pad = None
    if padding_idx is not None and start <= padding_idx < start + rows:
        local_pad = padding_idx - start
    out = F.embedding(local.masked_fill(outside, 0), weight, local_pad)
    # Zeroing the masked rows also zeroes their gradient into local row 0.
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return ReplicatedSum.apply(out, group)


def _forward(module: nn.Embedding, group: dist.ProcessGroup, tokens: torch.Tensor
             ) -> torch.Tensor:
    """The sharded embedding's ``forward``: the lookup on the local shard (module docs)."""
    weight = module.weight
    # The local shard; to_local's backward makes its gradient a Shard(0) DTensor again.
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return vocab_parallel_lookup(tokens, local, group, module.padding_idx)


class VocabParallelEmbedding(ParallelStyle):
    """A ``parallelize_module`` style: shard an ``nn.Embedding`` over the vocabulary.

    The weight becomes a ``Shard(0)`` DTensor parameter (as ``RowwiseParallel`` makes
    it, so checkpoints, initialisation and tied heads see the same parameter) and the
    module's ``forward`` is replaced on the instance by :func:`vocab_parallel_lookup`:
    plain token ids in, a plain replicated ``[..., hidden]`` tensor out.

    Raises:
        ValueError: (from ``_apply``) a module that is not an ``nn.Embedding``, one with
            ``max_norm`` (renormalising rows in place needs the whole row set), or a
            vocabulary the mesh size does not divide.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.max_norm is not None:
            raise ValueError(f"VocabParallelEmbedding shards an nn.Embedding without max_norm, "
                             f"got {type(module).__name__}")
        size = device_mesh.size()
        if module.num_embeddings % size:
            raise ValueError(f"vocabulary size {module.num_embeddings} is not divisible by "
                             f"tensor={size}")
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, device_mesh, [Shard(0)],
                                        src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(sharded,
                                                         requires_grad=param.requires_grad))
        group = device_mesh.get_group()
        module.forward = lambda tokens: _forward(module, group, tokens)
        return module
