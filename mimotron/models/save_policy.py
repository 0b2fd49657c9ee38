"""What ``recompute = "selective"`` keeps of a layer: the outputs of its expensive ops.

torchtitan's selective ``op`` mode and Megatron-Core's ``recompute_modules`` (norms,
activations, core attention) do the same thing from two sides: the whole transformer
layer runs under a non-reentrant checkpoint, and a per-operator policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``) says which outputs the
forward keeps for the recomputation. :class:`SavePolicy` keeps

* the matmuls' outputs (``mm``, ``addmm``, ``bmm``, ``linear``): q, k, v, ``wo``'s
  and ``w2``'s outputs, the SwiGLU gate and up projections;
* SDPA's outputs (every fused variant, the CPU flash kernel included: the output and
  its log-sum-exp; the math variant decomposes into ``bmm`` and ``softmax``, and its
  ``bmm`` outputs are kept);
* the functional collectives' outputs (``_c10d_functional.*``, ``wait_tensor`` and
  ``_wrap_tensor_autograd`` included: DTensor's TP reductions and sequence-parallel
  reduce-scatters), so the recomputation does not communicate them again;

and recomputes everything else: norms, RoPE, SiLU and the gate product, residual adds,
casts, views. Three exceptions, each keeping less:

* a matmul whose output is a ``Partial`` DTensor (a row-parallel ``wo`` / ``w2`` under
  TP): its reduction's output is kept instead, and the full-size partial sum is made
  again (one GEMM) when the recomputation reaches it;
* the all-gather of a sequence-parallel linear's input (a functional all-gather whose
  result is not reduced again): keeping it would keep the gathered input that
  :mod:`mimotron.parallel.sequence_saved` exists not to keep, so it is issued again in
  the recomputation (as ``full`` does), its ``wait_tensor`` with it;
* c10d's in-place collectives (the context-parallel key/value gather, the MoE
  all-to-alls): they fill buffers the caller made, which a cached output cannot do, so
  they run again, on every rank of the group in the forward's order.

A policy is made per checkpointed call: its state (which collectives were issued
again) lives for one layer's forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn._varlen_attn)
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

_aten = torch.ops.aten

# SDPA's kernels, looked up by name: which exist depends on the build.
_SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward")

SAVED_OPS: frozenset[Any] = frozenset(
    [_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.linear.default,
     torch.ops.torch_attn._varlen_attn.default]  # packed/context-parallel rows on a GPU
    + [getattr(_aten, name).default for name in _SDPA_OPS if hasattr(_aten, name)])
"""The compute ops whose outputs :class:`SavePolicy` keeps (overload packets resolved)."""

_FUNCTIONAL_NAMESPACE = "_c10d_functional"
_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")
# Functional ops whose output aliases a collective's output (the wait, the autograd wrap).
_ALIASING = ("wait_tensor", "_wrap_tensor_autograd")


def _is_functional_collective(func: Any) -> bool:
    return func.namespace == _FUNCTIONAL_NAMESPACE


def _has_partial_placement(out: Any) -> bool:
    """Whether ``out`` is a DTensor holding unreduced partial sums."""
    from torch.distributed.tensor import DTensor

    return isinstance(out, DTensor) and any(p.is_partial() for p in out.placements)


class SavePolicy:
    """The selective-recompute policy of one checkpointed layer call (module docs).

    Args:
        keep_gathers: keep the outputs of functional all-gathers too (``False`` under
            sequence parallelism, whose gathered linear inputs must not be kept).
    """

    def __init__(self, keep_gathers: bool = True) -> None:
        self.keep_gathers = keep_gathers
        # Outputs of collectives issued again in the recomputation, by storage, until
        # their wait_tensor: that wait must then run again too, not return a kept tensor.
        self.reissued: set[int] = set()

    def __call__(self, ctx: SelectiveCheckpointContext, func: Any, *args: Any,
                 **kwargs: Any) -> CheckpointPolicy:
        """Save or recompute ``func``'s output (called after the forward ran it)."""
        if func in SAVED_OPS:
            if _has_partial_placement(ctx.op_output):
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if not _is_functional_collective(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        op = func.__name__.split(".")[0]
        if op in _ALIASING:
            # Its output is its input (waited on, wrapped): kept with it or not at all.
            key = _storage_key(args[0])
            if key in self.reissued:
                if op == "wait_tensor":
                    self.reissued.discard(key)
                return CheckpointPolicy.MUST_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        if not self.keep_gathers and op in _GATHERS:
            self.reissued.update(_storage_key(t) for t in _tensors(ctx.op_output))
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def _tensors(out: Any) -> list[torch.Tensor]:
    items = out if isinstance(out, (list, tuple)) else [out]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
