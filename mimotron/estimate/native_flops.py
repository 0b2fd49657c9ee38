"""Model FLOPs of a native-resolution vision tower (Qwen2.5-VL, Qwen3-VL), per image.

:mod:`mimotron.estimate.flops` counts a fixed-size encoder from its token count. A Qwen
tower runs on each image's real patch rows, attends within segments (Qwen2.5-VL's
windows and whole frames, Qwen3-VL's frames) and merges ``m**2`` rows into a token, so
for ``P`` patch rows of width ``h`` (MLP width ``f``, patch ``C·T·p²`` values, merge
unit ``u = m²``, output width ``o``) the forward matmuls are:

=====================  ==========================================================
piece                  forward FLOPs
=====================  ==========================================================
patch projection       ``2·P·(C·T·p²)·h``
q, k, v and o          ``4 · 2·P·h·h`` per layer (the fused ``qkv`` is three)
attention              ``2 · 2·Σ len²·h`` per layer, over its segments: every frame
                       (``Σ (h·w)²``) in full-attention layers, every window in
                       Qwen2.5-VL's window layers
MLP                    ``3 · 2·P·h·f`` (Qwen2.5-VL's SwiGLU) or ``2 · 2·P·h·f``
merger                 ``2·P·u·h²`` (``u·h`` to ``u·h`` per token) + ``2·P·h·o``
DeepStack merger       the same, once per listed layer (Qwen3-VL)
=====================  ==========================================================

Norms, RoPE, the position table's interpolation and GELU are elementwise and not
counted (the convention of :mod:`mimotron.estimate.flops`). The segment sums come
from :class:`~mimotron.estimate.image_counts.ImageStats`: the data's expectation (mock
data), the bound, or the real grids of a step (:func:`~mimotron.estimate.
image_counts.grid_stats`).
"""

from __future__ import annotations

from mimotron.config.hf_resolve import tower_kwargs
from mimotron.config.schema import ModuleConfig
from mimotron.estimate.image_counts import ImageStats

__all__ = ["merger_flops", "tower_flops"]


def _matmul(m: float, n: float, k: float) -> float:
    """``[m, k] @ [k, n]``: a multiply and an add per term."""
    return 2.0 * m * n * k


def merger_flops(mod: ModuleConfig, stats: ImageStats, num_images: float) -> float:
    """Forward FLOPs of the tower's mergers (the final one and each DeepStack one): the
    part that trains under ``freeze = "encoder"``.

    Args:
        mod: a native-resolution vision module.
        stats: the per-image counts.
        num_images: images run.
    """
    args = tower_kwargs(mod)
    h, unit, out = int(args["hidden_size"]), int(args["spatial_merge_size"]) ** 2, \
        int(args["out_hidden_size"])
    rows = num_images * stats.patches
    one = _matmul(rows / unit, unit * h, unit * h) + _matmul(rows / unit, out, unit * h)
    return one * (1 + len(args.get("deepstack_visual_indexes") or ()))


def tower_flops(mod: ModuleConfig, stats: ImageStats, num_images: float) -> float:
    """Forward FLOPs of a native tower, mergers included, for ``num_images`` images.

    Args:
        mod: a native-resolution vision module (``hf_native`` set).
        stats: the per-image counts (patch rows, segment sums).
        num_images: images run (may be fractional: an average).

    Returns:
        The table's sum (module docstring).
    """
    args = tower_kwargs(mod)
    h, f, depth = int(args["hidden_size"]), int(args["intermediate_size"]), int(args["depth"])
    rows = num_images * stats.patches
    front = _matmul(rows, h, mod.hf_native.patch_dim)
    gated = "window_size" in args  # Qwen2.5-VL: SwiGLU, window layers
    full = set(args.get("fullatt_block_indexes") or ()) if gated else set(range(depth))
    per_layer = 4 * _matmul(rows, h, h) + (3 if gated else 2) * _matmul(rows, f, h)
    squares = (len(full) * stats.frame_square
               + (depth - len(full)) * stats.window_square) * num_images
    attention = 2 * 2.0 * squares * h  # Q K^T and A V of every segment
    return front + depth * per_layer + attention + merger_flops(mod, stats, num_images)
