"""Tensor parallelism per module with DTensor plans, and a vocab-parallel loss.

Plans for the built-in blocks (Megatron's split): attention ``wq/wk/wv`` column-wise and
``wo`` row-wise; SwiGLU ``w1/w3`` column-wise and ``w2`` row-wise; the language model's
embedding sharded over the vocabulary (:mod:`mimotron.parallel.vocab_embedding`: a local
lookup whose gradient is the shard's only) and its output head column-wise with *local*
logits, so the loss (:func:`vocab_parallel_loss`) never gathers full logits; encoder
projectors ``fc1`` column-wise and ``fc2`` row-wise. Everything else (norms, position
embeddings, the patch/conv front ends) stays a plain tensor, whole on every TP rank; the
global grad norm counts plain parameters on TP rank 0 only (``mimotron.optim.grads``).
Per-head q/k norms (Qwen3) are plain too but see only this rank's heads, so their
gradients are summed over TP (marked like the sequence-parallel norms).

Weights are initialised on the full shape first (from ``(seed, name)``) and then
sharded, so any TP degree starts from the same model as one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from mimotron.parallel.sequence_parallel import (
    HEAD_NORMS,
    mark_sequence_parallel_params,
    sequence_parallel_plan,
)
from mimotron.parallel.sequence_saved import keep_sharded_inputs
from mimotron.parallel.vocab_embedding import ReplicatedSum, VocabParallelEmbedding

# (projection, column-wise?) in the order the plan lists them.
_PROJECTIONS = (("attn.wq", True), ("attn.wk", True), ("attn.wv", True), ("attn.wo", False),
                ("mlp.w1", True), ("mlp.w3", True), ("mlp.w2", False))
COLUMN_WISE = (*(p.rsplit(".", 1)[1] for p, column in _PROJECTIONS if column), "fc1", "output")
"""The linear layers the plans split by output features (a projector's ``fc1``, the
output head), by their names' last part."""
ROW_WISE = (*(p.rsplit(".", 1)[1] for p, column in _PROJECTIONS if not column), "fc2")
"""The linear layers the plans split by input features, by their names' last part."""


def _block_plan(prefix: str, layers: nn.ModuleDict) -> dict[str, object]:
    """Plan entries for the projections each layer has.

    The toy blocks have all of ``_PROJECTIONS``; the Hugging Face encoder layers
    (:mod:`mimotron.models.hf.layers`) have no ``w3``. Biases follow their weights:
    column-wise shards the bias, row-wise keeps it whole and adds it once.
    """
    plan: dict[str, object] = {}
    for idx, layer in layers.items():
        names = {n for n, _ in layer.named_modules()}
        base = f"{prefix}layers.{idx}"
        for name, column in _PROJECTIONS:
            if name in names:
                plan[f"{base}.{name}"] = ColwiseParallel() if column else RowwiseParallel()
    return plan


def tensor_parallel_plan(module: nn.Module, is_language: bool,
                         sequence_parallel: bool = False) -> dict[str, object]:
    """The DTensor plan for one built-in module part (encoder submodule or LM stage).

    ``sequence_parallel`` (language only) swaps in the entries of
    :func:`~mimotron.parallel.sequence_parallel.sequence_parallel_plan`.
    """
    if is_language:
        plan = _block_plan("", module.layers)
        if module.embed is not None:
            # Each rank holds a vocabulary range, masks the rest, outputs are all-reduced;
            # its gradient is the shard's only (mimotron.parallel.vocab_embedding).
            plan["embed"] = VocabParallelEmbedding()
        if module.output is not None:
            plan["output"] = ColwiseParallel()  # local logits: [.., vocab / tp]
        if sequence_parallel:
            plan.update(sequence_parallel_plan(module.layers, module.output is not None))
        return plan
    plan = _block_plan("encoder.", module.encoder.layers)
    if module.projector is not None:
        plan["projector.fc1"] = ColwiseParallel()
        plan["projector.fc2"] = RowwiseParallel()
    return plan


def _check_heads(layers: nn.ModuleDict, tp: int, prefix: str) -> None:
    """Raise unless ``tp`` divides every layer's query and key/value head count.

    Column-wise ``wk``/``wv`` then give each rank whole key/value heads, and the query
    heads of a rank are exactly those that read its key/value heads (contiguous groups).
    """
    for idx, layer in layers.items():
        attn = layer.attn
        for key, heads in (("num_heads", attn.num_heads), ("num_kv_heads", attn.num_kv_heads)):
            if heads % tp:
                raise ValueError(
                    f"tensor={tp} does not divide {key}={heads} of {prefix}layers.{idx}.attn; "
                    f"the TP degree must divide the number of (key/value) heads"
                )


def mark_tensor_partial_params(module: nn.Module, sequence_parallel: bool) -> None:
    """Mark the plain parameters whose gradients are partial sums over the TP group.

    The sequence-sharded norms under sequence parallelism, and the per-head q/k norms
    (Qwen3) under any TP degree, since each rank normalises only its own heads. The
    data-parallel sync sums them over TP first
    (:func:`~mimotron.parallel.sequence_parallel.reduce_sequence_parallel_grads`).
    Call it again after ``to_empty``, which replaces parameters and drops the marks.
    """
    if sequence_parallel:
        mark_sequence_parallel_params(module)
    mark_sequence_parallel_params(module, HEAD_NORMS)


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, is_language: bool,
                          sequence_parallel: bool = False) -> nn.Module:
    """Shard a module part over a 1-D TP mesh in place; mark replicated parameters.

    With ``sequence_parallel`` (a language model part only) the residual stream and the
    norms hold ``seq / tp`` per rank (:mod:`mimotron.parallel.sequence_parallel`): the
    part gets ``sequence_parallel_group`` and its sharded norms' weights are marked.

    Biases follow their weights (column-wise layers shard theirs, row-wise layers keep
    theirs whole and add it once). A language model with tied embeddings is re-tied
    after sharding: the embedding (row-wise over the vocabulary) and the head
    (column-wise over the vocabulary) shard the shared ``[vocab, hidden]`` matrix the
    same way, ``Shard(0)``.

    Raises:
        ValueError: the vocabulary, or a layer's head or key/value head count, does not
            divide by the TP degree.
    """
    tp = mesh.size()
    if is_language and module.embed is not None and module.embed.num_embeddings % tp:
        raise ValueError(f"vocabulary size {module.embed.num_embeddings} is not divisible by "
                         f"tensor={tp}; the padded vocabulary must divide by the TP degree")
    if is_language:
        _check_heads(module.layers, tp, "")
    else:
        _check_heads(module.encoder.layers, tp, "encoder.")
    plan = tensor_parallel_plan(module, is_language, sequence_parallel)
    parallelize_module(module, mesh, plan)
    if sequence_parallel:
        module.sequence_parallel_group = mesh.get_group()
        keep_sharded_inputs(module.layers, mesh.get_group())
    mark_tensor_partial_params(module, sequence_parallel)
    if is_language and getattr(module, "tie_word_embeddings", False):
        module.tie_weights()
    return module


class _PickLogit(torch.autograd.Function):
    """``x.gather(-1, index[..., None])[..., 0]`` keeping only the index for backward.

    ``gather`` would save its whole input (the shifted fp32 logits, 4 bytes per logit);
    its gradient needs only the input's shape.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(index)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        (index,) = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
        return out.scatter_(-1, index.unsqueeze(-1), grad.unsqueeze(-1).to(ctx.dtype)), None


def vocab_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                        group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]:
    """Cross-entropy over vocab-sharded logits without gathering them (Megatron's method).

    Args:
        logits: this rank's vocabulary shard ``[B, S, V / tp]`` (contiguous ranges in rank
            order within ``group``).
        labels: ``[B, S]`` global token ids.
        loss_mask: ``[B, S]``.
        group: the TP group.

    Returns:
        Like :func:`mimotron.models.language.language_loss`: (loss sum over masked tokens,
        number of masked tokens, per-sample "every masked argmax is right" bool ``[B]``).
    """
    logits = logits.float()
    shard = logits.shape[-1]
    start = dist.get_rank(group) * shard
    # Softmax normaliser across shards: max (no grad needed), then sum of exps.
    local_max = logits.max(dim=-1).values
    global_max = local_max.detach().clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - global_max.unsqueeze(-1)
    sum_exp = ReplicatedSum.apply(shifted.exp().sum(dim=-1), group)
    local_ids = labels - start
    in_range = (local_ids >= 0) & (local_ids < shard)
    picked = _PickLogit.apply(shifted, local_ids.clamp(0, shard - 1))
    target = ReplicatedSum.apply(torch.where(in_range, picked, torch.zeros_like(picked)),
                                  group)
    token_loss = torch.log(sum_exp) - target
    mask = loss_mask.float()
    loss_sum = (token_loss * mask).sum()
    # Global argmax = smallest index attaining the global max (torch.argmax's tie rule).
    with torch.no_grad():
        local_arg = logits.argmax(dim=-1) + start
        candidate = torch.where(local_max >= global_max, local_arg,
                                torch.full_like(local_arg, torch.iinfo(torch.int64).max))
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=group)
        scored = mask > 0
        wrong = ((candidate != labels) & scored).any(dim=-1)
        correct = ~wrong & scored.any(dim=-1)
    return loss_sum, mask.sum(), correct
