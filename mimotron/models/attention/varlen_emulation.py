"""A CPU stand-in for torch's variable-length flash attention kernel.

:func:`torch.nn.attention.varlen.varlen_attn` runs on a GPU only (16-bit, CUDA), so the
``varlen`` branch of :func:`~mimotron.models.attention.kernels.attend` would otherwise
never run in a CPU test suite: a wrong argument there (a non-causal window, the key
boundaries passed for the query ones) would pass every test. :func:`varlen_attn_emulated`
takes the same arguments and returns what the kernel returns, computed with plain tensor
ops (any floating dtype, any device, differentiable by autograd), so tests can put it in
the kernel's place (:func:`~mimotron.models.attention.kernels.varlen_function`) and check
the GPU branch against a dense reference.

What it honours, as the flash kernel does:

* segment ``i``'s queries are rows ``[cu_seq_q[i], cu_seq_q[i + 1])`` of ``query`` and
  its keys rows ``[cu_seq_k[i], cu_seq_k[i + 1])`` of ``key``/``value`` (or the first
  ``seqused_k[i]`` of them; or, with ``block_table``, of its pages);
* ``window_size=(left, right)``: in a segment of ``n`` queries and ``m`` keys, query
  ``r`` sees key ``c`` when ``r + (m - n) - left <= c <= r + (m - n) + right``, a
  bound of ``-1`` being no bound; so ``(-1, 0)`` is causal aligned at the lower right
  (the last query sees every key), ``(-1, -1)`` full attention;
* a query that sees no key gets a zero output and a log-sum-exp of ``+inf``;
* ``enable_gqa``: query head ``h`` reads key/value head ``h // (H_q / H_kv)``;
* ``scale`` (default ``1 / sqrt(head_dim)``); 16-bit inputs are computed in fp32 and
  returned in their dtype, as the kernel accumulates;
* query rows no segment covers are left unwritten by the kernel (``torch.empty``):
  here they are NaN, so a result that reads them fails loudly;
* ``return_aux=AuxRequest(lse=True)`` adds the log-sum-exp, ``[H_q, T_q]`` float32 as
  torch's implementation returns it;
* ``seqused_k`` and ``block_table`` are inference-only: with gradients required they
  raise ``RuntimeError`` as torch does. ``num_splits`` changes only the order of a
  floating-point reduction and is accepted and ignored.

Where the kernel's result is undefined it raises ``ValueError`` instead: boundaries past
the end of ``query``/``key``, decreasing boundaries, or a segment longer than ``max_q``
or ``max_k`` (the kernel launches ``max_q`` rows' worth of blocks per segment and sizes
its key splits by ``max_k``, so a longer segment is silently cut short on the GPU).
It checks no dtype, device or head-size limit of the GPU kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: The signature :func:`varlen_attn_emulated` shares with torch's ``varlen_attn``.
VarlenAttention = Callable[..., Any]


def _window_mask(n: int, m: int, window: tuple[int, int], device: torch.device
                 ) -> torch.Tensor:
    """``[n, m]`` bool: which keys each query sees, the window aligned at the lower right."""
    left, right = window
    rows = torch.arange(n, device=device)[:, None] + (m - n)  # the diagonal key of each row
    cols = torch.arange(m, device=device)[None, :]
    allowed = torch.ones(n, m, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= cols >= rows - left
    if right >= 0:
        allowed &= cols <= rows + right
    return allowed


def _check_heads(query: torch.Tensor, kv_heads: int, enable_gqa: bool) -> int:
    """Query heads per key/value head, with torch's checks."""
    heads = query.shape[1]
    if not enable_gqa and heads != kv_heads:
        raise ValueError(f"Expect query and key/value to have the same number of heads but "
                         f"got Hq={heads} and Hkv={kv_heads}. Try setting enable_gqa=True.")
    if heads % kv_heads:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for "
                         f"GQA but got Hq={heads} and Hkv={kv_heads}.")
    return heads // kv_heads


def _bounds(name: str, cu: torch.Tensor, total: int) -> list[int]:
    """``cu`` on the host, checked to be non-decreasing and within ``total`` rows."""
    values = [int(x) for x in cu.tolist()]
    if not values:
        raise ValueError(f"{name} is empty: it must be [N + 1] cumulative positions")
    if any(b < a for a, b in zip(values[:-1], values[1:], strict=True)):
        raise ValueError(f"{name}={values} is invalid: cumulative positions must not decrease")
    if (values[0] < 0 or values[-1] > total):
        raise ValueError(f"{name}={values} is invalid: positions must lie in [0, {total}]")
    return values


def _segment_keys(key: torch.Tensor, value: torch.Tensor, index: int, start: int,
                  used: int, block_table: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment ``index``'s ``used`` keys and values: from ``start``, or from its pages."""
    if block_table is None:
        return key[start:start + used], value[start:start + used]
    pages = block_table[index].long()
    return key[pages].flatten(0, 1)[:used], value[pages].flatten(0, 1)[:used]


def _attend_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int,
                    scale: float, window: tuple[int, int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment: ``[n, H, D]`` output and ``[H, n]`` log-sum-exp, in ``q``'s dtype."""
    n, m = q.shape[0], k.shape[0]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    allowed = _window_mask(n, m, window, q.device)
    sees = allowed.any(dim=1)  # [n]: rows with at least one key
    # A row without keys gets finite scores, then zero weights: no NaN in the backward.
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~sees[:, None], 0.0)
    weights = scores.softmax(dim=-1) * sees[:, None]
    lse = scores.logsumexp(dim=-1).masked_fill(~sees, float("inf"))
    return torch.einsum("hqk,khd->qhd", weights, v), lse


def varlen_attn_emulated(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`torch.nn.attention.varlen.varlen_attn`, computed with plain tensor ops.

    Args:
        query: ``[T_q, H_q, D]``.
        key: ``[T_k, H_kv, D]``, or ``[pages, page_size, H_kv, D]`` with ``block_table``.
        value: like ``key``.
        cu_seq_q: ``[N + 1]`` cumulative query positions of the ``N`` segments.
        cu_seq_k: ``[N + 1]`` cumulative key positions (ignored with ``block_table``).
        max_q: the longest segment's query count (at least).
        max_k: the longest segment's key count (at least).
        return_aux: an ``AuxRequest``; with ``lse=True`` the log-sum-exp is returned too.
        scale: the score scale (``1 / sqrt(D)`` when ``None``).
        window_size: ``(left, right)`` (see the module docstring); ``-1`` is unbounded.
        enable_gqa: allow fewer key/value heads than query heads.
        seqused_k: ``[N]`` keys each segment uses (the first ones); inference only.
        block_table: ``[N, pages]`` int32 page indices of each segment's keys; needs
            ``seqused_k``; inference only.
        num_splits: the kernel's split-KV count; no effect on the result here.

    Returns:
        ``[T_q, H_q, D]`` in ``query``'s dtype, and with ``return_aux.lse`` also the
        ``[H_q, T_q]`` float32 log-sum-exp.

    Raises:
        ValueError: on an argument for which the kernel's result is undefined.
        RuntimeError: ``seqused_k``/``block_table`` with gradients required.
    """
    del num_splits  # Only the floating-point reduction order depends on it.
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    window = (int(window_size[0]), int(window_size[1]))
    kv_heads = key.shape[2] if block_table is not None else key.shape[1]
    group = _check_heads(query, kv_heads, enable_gqa)
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if grads and (seqused_k is not None or block_table is not None):
        raise RuntimeError("seqused_k and block_table are inference-only parameters.")
    if block_table is not None and seqused_k is None:
        raise ValueError("block_table requires seqused_k (the keys each segment uses)")
    q_cu = _bounds("cu_seq_q", cu_seq_q, query.shape[0])
    k_cu = None if block_table is not None else _bounds("cu_seq_k", cu_seq_k, key.shape[0])
    if k_cu is not None and len(k_cu) != len(q_cu):
        raise ValueError(f"cu_seq_k has {len(k_cu)} entries and cu_seq_q {len(q_cu)}: "
                         "both must be [N + 1]")
    used = (seqused_k.tolist() if seqused_k is not None
            else [b - a for a, b in zip(k_cu[:-1], k_cu[1:], strict=True)])
    work = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    heads, total = query.shape[1], query.shape[0]
    # The segments are contiguous (cumulative bounds): only the rows before the first
    # and after the last are unwritten.
    outs = [query.new_full((q_cu[0], *query.shape[1:]), float("nan"))]
    lses = [query.new_full((heads, q_cu[0]), float("nan"), dtype=torch.float32)]
    for i, (q0, q1) in enumerate(zip(q_cu[:-1], q_cu[1:], strict=True)):
        n, m = q1 - q0, int(used[i])
        if n > max_q or m > max_k:
            raise ValueError(f"segment {i} has {n} queries and {m} keys, more than "
                             f"max_q={max_q} / max_k={max_k}: the kernel would cut it short")
        k, v = _segment_keys(key, value, i, 0 if k_cu is None else k_cu[i], m, block_table)
        if k.shape[0] != m:
            raise ValueError(f"segment {i} reads {m} keys, only {k.shape[0]} exist")
        seg_out, seg_lse = _attend_segment(query[q0:q1].to(work), k.to(work), v.to(work),
                                           group, scale, window)
        outs.append(seg_out.to(query.dtype))
        lses.append(seg_lse.detach().float())
    outs.append(query.new_full((total - q_cu[-1], *query.shape[1:]), float("nan")))
    lses.append(query.new_full((heads, total - q_cu[-1]), float("nan"), dtype=torch.float32))
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    if return_aux is not None and getattr(return_aux, "lse", False):
        return out, lse
    return out
