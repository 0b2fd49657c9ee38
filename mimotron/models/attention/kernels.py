"""The attention kernels, and the one function that picks among them.

:func:`attend` computes causal (or, with ``causal=False``, bidirectional) attention of
``[B, S, heads, head_dim]`` queries:

* **no plan** (an unpacked row, no context parallelism): ``scaled_dot_product_attention``
  with ``is_causal=True`` — no mask, so the flash kernels run (on the CPU too).
* **a plan** (packed documents, context-parallel chunks; :func:`~mimotron.models.
  attention.documents.attention_segments`): every segment's queries attend to their keys,
  causally aligned at the lower right; with ``causal=False`` (vision towers: one segment
  per image, frame or window) each query sees every key of its segment, which then must
  be its own rows (no context parallelism).

  - ``varlen``: on a GPU in 16-bit, one call of torch's variable-length flash attention
    (:func:`torch.nn.attention.varlen.varlen_attn`) over all segments: no mask and no
    score matrix is made; it keeps its output and a log-sum-exp per query and head.
  - ``segments``: elsewhere (the CPU, fp32), one ``scaled_dot_product_attention`` per
    segment. A segment whose queries are its keys uses ``is_causal=True``; one that
    starts after its document did (only under context parallelism) passes a
    lower-right causal mask of that segment only (``queries x keys`` of one document
    in one chunk, bool). Measured on the CPU
    (``benchmarks/attention.py``), this beats a dense-mask SDPA over the row at
    every length from 1k tokens up, and keeps ``O(S)`` bytes per layer.

``flex_attention`` with a block mask is not used: on the CPU torch 2.13 has no backward
for it ("FlexAttention does not support backward on CPU"), without ``torch.compile``
it materialises the whole score matrix, and on a GPU ``varlen`` is the flash kernel
that document masking needs, with no block mask to build per batch.

The ``varlen`` branch runs on a CPU in the tests: they force :func:`attention_kernel`
to ``varlen`` and put a CPU emulation of the kernel's contract
(:mod:`~mimotron.models.attention.varlen_emulation`) in :func:`varlen_function`'s place.

Under context parallelism the keys arrive gathered in rank order; the plan's
``k_index`` picks each segment's keys from them (``O(S)`` rows, at most twice the row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mimotron.models.attention.documents import AttentionSegments
from mimotron.models.attention.varlen_emulation import VarlenAttention
from mimotron.runtime import accelerator_available

_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def _varlen_device(device: torch.device) -> bool:
    """Whether torch's variable-length flash kernel runs on ``device``.

    The dry run's ``meta`` stand-in for a GPU counts as one (the kernel has a
    shape-only implementation there), but the dry run runs without autocast: under
    ``bf16`` its queries are fp32, so it takes the per-segment branch, not this one.
    """
    return device.type == "meta" or (device.type != "cpu" and accelerator_available())


def attention_kernel(device: torch.device, dtype: torch.dtype, planned: bool) -> str:
    """The kernel :func:`attend` runs: ``sdpa-causal``, ``varlen`` or ``segments``.

    Args:
        device: where attention runs.
        dtype: the queries' dtype (the compute dtype).
        planned: whether rows are packed or context-parallel (an attention plan).
    """
    if not planned:
        return "sdpa-causal"
    return "varlen" if _varlen_device(device) and dtype in _VARLEN_DTYPES else "segments"


def varlen_function() -> VarlenAttention:
    """The variable-length kernel :func:`attend` calls: torch's ``varlen_attn``.

    Looked up at each call (not imported at module level) so that a test can put
    :func:`~mimotron.models.attention.varlen_emulation.varlen_attn_emulated` in its
    place, with :func:`attention_kernel` forced to ``varlen``, and run the GPU branch
    on a CPU.
    """
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           plan: AttentionSegments | None, causal: bool = True) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v``; ``[B, S, heads, head_dim]`` in and out.

    Args:
        q: ``[B, S, heads, head_dim]`` queries (after RoPE).
        k: ``[B, S_k, kv_heads, head_dim]`` keys: this rank's own, or under context
            parallelism the gathered ones (rank order).
        v: like ``k``.
        plan: the segments (packed or context-parallel rows), or ``None``.
        causal: whether a query sees only the keys up to itself (within its segment
            under a plan) or every key (of its segment).

    Returns:
        ``[B, S, heads, head_dim]`` (without a plan a transposed view of SDPA's output,
        so the heads merge for the output projection is a view).

    Raises:
        ValueError: ``causal=False`` with a plan whose segments read keys other than
            their own queries' rows (a context-parallel plan, causal by construction).
    """
    gqa = k.shape[2] != q.shape[2]
    if plan is not None and not causal and (plan.k_index is not None
                                            or plan.k_bounds != plan.q_bounds):
        raise ValueError("non-causal attention needs a plan whose segments attend to their "
                         "own rows (attention_segments without context parallelism)")
    if plan is None:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return out.transpose(1, 2)
    batch, seq, heads, head_dim = q.shape
    flat_q = q.reshape(batch * seq, heads, head_dim)
    flat_k, flat_v = (t.reshape(-1, t.shape[2], head_dim) for t in (k, v))
    if plan.k_index is not None:
        flat_k, flat_v = (t.index_select(0, plan.k_index) for t in (flat_k, flat_v))
    if attention_kernel(q.device, q.dtype, True) == "varlen":
        out = varlen_function()(flat_q, flat_k, flat_v, plan.cu_q, plan.cu_k, plan.max_q,
                                plan.max_k, window_size=(-1, 0) if causal else (-1, -1),
                                enable_gqa=gqa)
    else:
        out = _segments(flat_q, flat_k, flat_v, plan, gqa, causal)
    return out.view(batch, seq, heads, head_dim)


def _segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionSegments,
              gqa: bool, causal: bool = True) -> torch.Tensor:
    """One SDPA per segment over flattened ``[T, heads, head_dim]`` rows (non-causal:
    every query of a segment sees all its keys)."""
    outs = []
    for i in range(plan.num_segments):
        q0, q1 = plan.q_bounds[i], plan.q_bounds[i + 1]
        k0, k1 = plan.k_bounds[i], plan.k_bounds[i + 1]
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0)
                      for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        if not causal or q1 - q0 == k1 - k0:
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        else:
            # Lower-right causal: query i of n sees keys up to i + (m - n). Written as a
            # bool mask of this segment (torch's CausalBias, a tensor subclass, does not
            # survive selective recompute's dispatch mode; on the CPU it would
            # materialise the same mask).
            n, m = q1 - q0, k1 - k0
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
            out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
