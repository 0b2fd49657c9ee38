"""Rotary tables of 3-D positions (M-RoPE): Qwen2.5-VL's sectioned and Qwen3-VL's
interleaved layouts.

A rotary embedding turns frequency ``j`` of a head (``j < head_dim / 2``) by
``position * inv_freq[j]``. With 3-D positions (temporal, height, width;
:mod:`mimotron.data.mrope_positions`) each frequency reads *one* of the three axes, and
the ``mrope_section`` ``(s_t, s_h, s_w)`` (summing to ``head_dim / 2``) says how many
frequencies each axis gets:

* **sectioned** (Qwen2.5-VL): the first ``s_t`` frequencies read the temporal axis, the
  next ``s_h`` the height, the last ``s_w`` the width;
* **interleaved** (Qwen3-VL): frequencies cycle temporal, height, width (``j % 3``) for
  as long as the height and width sections last (``j < 3 * s_h``, ``j < 3 * s_w``); every
  other frequency reads the temporal axis.

Both halves of the head rotate by the same angles (:func:`~mimotron.models.blocks.
apply_rope` takes the half tables). A text token has one position on all three axes, so
its rotation is plain RoPE's whatever the layout. The angle of frequency ``j`` is the
fp32 product ``float(position) * inv_freq[j]``, the one ``transformers`` computes, so the
tables are bitwise theirs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_mrope_section", "mrope_axes", "mrope_tables"]


def check_mrope_section(section: Sequence[int], head_dim: int) -> tuple[int, int, int]:
    """The section as a tuple, checked against the head width.

    Args:
        section: frequencies of the temporal, height and width axes.
        head_dim: per-head width (even).

    Returns:
        ``(s_t, s_h, s_w)``.

    Raises:
        ValueError: not three non-negative integers summing to ``head_dim / 2``.
    """
    values = tuple(section)
    ok = len(values) == 3 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                  for v in values)
    if not ok or sum(values) != head_dim // 2:
        raise ValueError(f"mrope_section={list(values)} is invalid: expected three "
                         f"non-negative integers summing to head_dim / 2 = {head_dim // 2}")
    return values  # type: ignore[return-value]


def mrope_axes(section: Sequence[int], interleaved: bool, head_dim: int) -> torch.Tensor:
    """The position axis (0 temporal, 1 height, 2 width) each frequency reads.

    Args:
        section: ``(s_t, s_h, s_w)``, see :func:`check_mrope_section`.
        interleaved: Qwen3-VL's layout; ``False`` = Qwen2.5-VL's sections.
        head_dim: per-head width.

    Returns:
        int64 ``[head_dim // 2]`` on the default device.

    Raises:
        ValueError: as :func:`check_mrope_section`.
    """
    s_t, s_h, s_w = check_mrope_section(section, head_dim)
    half = head_dim // 2
    if not interleaved:
        return torch.tensor([0] * s_t + [1] * s_h + [2] * s_w, dtype=torch.long)
    j = torch.arange(half)
    height = (j % 3 == 1) & (j < 3 * s_h)
    width = (j % 3 == 2) & (j < 3 * s_w)
    # torch.where, not masked assignment: no data-dependent shapes (the dry run's fake
    # tensors hold no values).
    return torch.where(height, 1, torch.where(width, 2, 0))


def mrope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(cos, sin)`` half tables of 3-D positions.

    Args:
        positions: ``[3, B, S]`` integer positions (temporal, height, width).
        inv_freq: ``[head_dim // 2]`` fp32 inverse frequencies.
        axes: ``[head_dim // 2]`` from :func:`mrope_axes`.

    Returns:
        ``(cos, sin)``, each fp32 ``[B, 1, S, head_dim // 2]`` on ``positions``' device
        (the per-row layout :class:`~mimotron.models.blocks.Attention` takes).

    Raises:
        ValueError: ``positions`` is not ``[3, B, S]`` or the tables' widths differ.
    """
    if positions.dim() != 3 or positions.shape[0] != 3:
        raise ValueError(f"M-RoPE positions of shape {tuple(positions.shape)}: expected "
                         "[3, B, S] (temporal, height, width)")
    if inv_freq.shape != axes.shape:
        raise ValueError(f"inv_freq {tuple(inv_freq.shape)} and axes {tuple(axes.shape)} "
                         "must both be [head_dim // 2]")
    device = positions.device
    # [B, S, half]: each frequency's own axis, then the same fp32 product as 1-D RoPE.
    chosen = positions.permute(1, 2, 0)[..., axes.to(device)].float()
    angles = (chosen * inv_freq.to(device=device, dtype=torch.float32)).unsqueeze(1)
    return angles.cos(), angles.sin()
