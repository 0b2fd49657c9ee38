"""The plain loop's own attention core for the language model: RoPE, documents, GQA.

:func:`tests.reference.reference_run` builds the model with the engine's classes, so
without this module the decoder's attention core (rotary positions, the causal and
per-document mask of packed rows, grouped-query attention) would be the engine's own
code on both sides of every parity comparison, and a bug there (a document that sees the
previous one) would pass them all. :func:`install_reference_attention` replaces the
``core`` of every decoder layer of the reference's model copy with
:meth:`ReferenceAttention.core`, which ignores the engine's RoPE tables and mask and
computes, from the batch's ``doc_ids`` alone:

* positions: ``0 .. S-1`` per row, or, for packed rows, the index of each token inside
  its document (the count of earlier tokens of the same document; ``position_ids`` is
  not read);
* rotate-half RoPE from inverse frequencies written out here (the ``rope_theta`` and
  ``rope_scaling`` the model was built with: the plain formula, ``linear`` and ``llama3``
  as ``transformers`` defines them);
* a dense boolean mask: key ``j`` is visible to query ``i`` iff ``j <= i`` and, for
  packed rows, both are in the same document (padding, ``-1``, is a document of its own);
* grouped-query attention by ``repeat_interleave`` of the key/value heads;
* ``softmax(q k^T / sqrt(d) + mask) v`` in fp32, explicitly.

Nothing of ``mimotron.models.blocks`` (``apply_rope``, ``rope_cache``), of
``mimotron.data.packing`` or of ``mimotron.parallel.context_attention`` is used. The
encoders' bidirectional attention is not replaced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def reference_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None
                       ) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2]`` (fp32): ``theta ** (-2i / head_dim)``.

    Args:
        head_dim: per-head width (even).
        theta: the RoPE base.
        scaling: ``None`` or a ``transformers`` rope-parameters dict whose ``rope_type``
            (or legacy ``type``) is ``default``, ``linear`` (every frequency divided by
            ``factor``) or ``llama3`` (Llama 3.1's frequency-dependent scaling).

    Returns:
        The inverse frequencies.

    Raises:
        ValueError: on an odd ``head_dim`` or a ``rope_type`` not written here.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} is invalid: rotary embeddings need it even")
    inv_freq = 1.0 / float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                      / head_dim)
    rope_type = "default" if scaling is None else (
        scaling.get("rope_type") or scaling.get("type") or "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_type={rope_type!r} is not written in the reference; expected "
                     "'default', 'linear' or 'llama3'")


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: wavelengths above ``old / low`` divided by ``factor``, below ``old / high``
    kept, and in between a linear blend in ``old / wavelength``."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    out = []
    for f in inv_freq.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < old / high:
            out.append(f)
        elif wavelength > old / low:
            out.append(f / factor)
        else:
            blend = (old / wavelength - low) / (high - low)
            out.append((1 - blend) * f / factor + blend * f)
    return torch.tensor(out, dtype=torch.float32)


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's index inside its document: ``[B, S]`` long from ``doc_ids`` ``[B, S]``.

    Counts the earlier positions of the row holding the same document id, so positions
    restart at 0 at each document (padding, ``-1``, counts as one more document).
    """
    seq = doc_ids.shape[-1]
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)  # [B, query, key]
    earlier = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril(-1)
    return (same & earlier).sum(-1)


def visible_keys(doc_ids: torch.Tensor | None, batch: int, seq: int,
                 device: torch.device) -> torch.Tensor:
    """Dense mask ``[B, S, S]``: ``[b, i, j]`` True iff query ``i`` may read key ``j``.

    Causal (``j <= i``); with ``doc_ids``, also ``doc_ids[b, i] == doc_ids[b, j]``.
    """
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    if doc_ids is None:
        return causal.expand(batch, seq, seq)
    return causal & (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2))


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (the hand-computed tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[B, S, H, D]`` at ``positions`` ``[B, S]``, in fp32.

    Pair ``(x[..., i], x[..., i + D/2])`` turns by ``positions * inv_freq[i]``.
    """
    work = _work_dtype(x)
    angles = positions.to(work)[..., None] * inv_freq.to(x.device, work)  # [B, S, D/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].to(work), x[..., half:].to(work)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           visible: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE, grouped-query attention and ``softmax(q k^T / sqrt(d) + mask) v`` in fp32.

    Args:
        q: ``[B, S, Hq, D]`` queries before RoPE.
        k: ``[B, S, Hkv, D]`` keys before RoPE; ``Hkv`` divides ``Hq`` and query head
            ``h`` reads key/value head ``h // (Hq / Hkv)``.
        v: like ``k``, values.
        positions: ``[B, S]`` RoPE positions.
        visible: ``[B, S, S]`` bool, True where query ``i`` may read key ``j``.
        inv_freq: ``[D / 2]`` RoPE inverse frequencies.

    Returns:
        ``[B, S, Hq, D]`` in ``q``'s dtype.
    """
    group = q.shape[2] // k.shape[2]
    assert group * k.shape[2] == q.shape[2], (q.shape, k.shape)
    qr, kr = rotate(q, positions, inv_freq), rotate(k, positions, inv_freq)
    kr = kr.repeat_interleave(group, dim=2)
    vr = v.to(_work_dtype(v)).repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qr, kr) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    # Every query sees at least itself, so no row of the softmax is all -inf.
    out = torch.einsum("bhij,bjhd->bihd", scores.softmax(dim=-1), vr)
    return out.to(q.dtype)


class ReferenceAttention:
    """The attention core the reference installs in every decoder layer.

    Set :attr:`doc_ids` to the batch's ``doc_ids`` (``None`` for unpacked rows) before
    each forward of the model.

    Attributes:
        inv_freq: RoPE inverse frequencies of the language model.
        doc_ids: ``[B, S]`` documents of the current batch's rows, or ``None``.
        calls: how many times :meth:`core` ran (one per layer per forward).
    """

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self.doc_ids: torch.Tensor | None = None
        self.calls = 0

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             *engine_args: object, **engine_kwargs: object) -> torch.Tensor:
        """``Attention.core``'s replacement; the engine's RoPE tables and mask (or
        attention plan) arrive in ``engine_args``/``engine_kwargs`` and are not read.

        Args:
            q: ``[B, S, Hq, D]`` after the q norm, before RoPE.
            k: ``[B, S, Hkv, D]`` after the k norm, before RoPE.
            v: like ``k``.

        Returns:
            ``[B, S, Hq, D]``.
        """
        batch, seq = q.shape[0], q.shape[1]
        assert q.shape[-1] == 2 * self.inv_freq.numel(), (q.shape, self.inv_freq.shape)
        doc_ids = self.doc_ids
        if doc_ids is None:
            positions = torch.arange(seq, device=q.device).expand(batch, seq)
        else:
            assert doc_ids.shape == (batch, seq), (doc_ids.shape, q.shape)
            doc_ids = doc_ids.to(q.device)
            positions = document_positions(doc_ids)
        self.calls += 1
        return attend(q, k, v, positions, visible_keys(doc_ids, batch, seq, q.device),
                      self.inv_freq)


def install_reference_attention(model: nn.Module) -> ReferenceAttention:
    """Replace the attention core of every layer of ``model.language_model``.

    The RoPE base and scaling are the language model's (``rope_theta``,
    ``rope_scaling``: the built-in default, or a Hugging Face ``config.json``'s).

    Args:
        model: a whole ``MimoModel`` (one process).

    Returns:
        The installed core's state; set its ``doc_ids`` before each forward.
    """
    lm = model.language_model
    state = ReferenceAttention(reference_inv_freq(lm.head_dim, lm.rope_theta, lm.rope_scaling))
    for layer in lm.layers.values():
        assert layer.attn.causal and layer.attn.head_dim == lm.head_dim
        # An instance attribute: Attention.forward's ``self.core(...)`` finds it first.
        layer.attn.core = state.core
    return state
