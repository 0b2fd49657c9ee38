"""What the Qwen2.5-VL and Qwen3-VL vision towers share: patches, 2-D RoPE, layers, mergers.

Both towers take a batch of images and videos of *different* sizes as one flat sequence:
``pixel_values`` holds ``sum(t * h * w)`` patch rows (each ``C * T * P * P`` values, as
the Qwen2-VL image processor writes them), ``grid_thw`` each medium's patch grid. The
processor orders each frame's patches in ``m x m`` blocks (``m`` = ``spatial_merge_size``),
which is why the merger can concatenate every ``m**2`` consecutive rows into one output
token. Nothing is padded to one size and no ``[S, S]`` mask exists: attention runs on our
backend (:func:`~mimotron.models.attention.attend`, ``causal=False``) over a plan of
segments, one per frame (full-attention layers) or per window (Qwen2.5-VL's window
layers), each query seeing every key of its segment.

* :class:`PatchEmbed`: the checkpoint's ``Conv3d`` with kernel = stride = one patch is a
  matrix product on the flattened patch, computed as one (its weight keeps the
  checkpoint's 5-D shape, so weights load as they are).
* 2-D RoPE (:func:`rotary_positions`, :func:`rotary_tables`): a head's first half rotates
  by the patch row, its second half by the column (``head_dim / 4`` frequencies each),
  in the half-split layout of :func:`~mimotron.models.blocks.apply_rope`.
* :class:`VisionLayer`: pre-norm ``x + attn(norm1(x))``, ``x + mlp(norm2(x))``; attention
  with one fused ``wqkv`` (the checkpoints' ``qkv``; a tensor-parallel plan would have to
  split it by heads, not by rows) and a biased ``wo``.
* :class:`PatchMerger`: ``m**2`` rows to one token, ``w2(gelu(w1(norm(x))))``; the
  norm before (Qwen2.5-VL, Qwen3-VL's final merger) or after (Qwen3-VL's DeepStack
  mergers) the rows are concatenated.

The per-forward plan is host arithmetic on ``grid_thw``: pass it as a CPU tensor (or a
list of triples) and the forward reads nothing back from the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.config.qwen_vl_vision import media_tokens
from mimotron.models.attention import AttentionSegments, Documents, attend, attention_segments
from mimotron.models.blocks import RMSNorm, SwiGLU, apply_rope, linear_on_rows, residual_init_std
from mimotron.models.hf.layers import CastLayerNorm, FeedForward

NORMS = ("rms", "layer")
_NORM_EPS = 1e-6  # both families' vision norms (fixed in transformers, not in config.json)

Grid = list[tuple[int, int, int]]
Rope = tuple[torch.Tensor, torch.Tensor]


def read_grid(grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int
              ) -> Grid:
    """Each medium's ``(t, h, w)`` as host integers, checked.

    Args:
        grid_thw: ``[num_media, 3]`` (a device tensor is read back once: pass a CPU one).
        spatial_merge_size: ``h`` and ``w`` must be multiples of it.

    Raises:
        ValueError: a grid that is not ``[num_media, 3]`` positive integers with ``h`` and
            ``w`` multiples of ``spatial_merge_size``.
    """
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    grid = [tuple(int(n) for n in row) for row in rows]
    for row in grid:
        media_tokens(row, spatial_merge_size)  # raises on a bad row
    return grid  # type: ignore[return-value]


def frame_lengths(grid: Grid) -> list[int]:
    """Patches of every frame, media in order: the full-attention layers' segments
    (transformers attends within a frame, ``t`` segments per video, not the whole clip)."""
    return [h * w for t, h, w in grid for _ in range(t)]


def segments_plan(lengths: Sequence[int], device: torch.device) -> AttentionSegments | None:
    """The backend's plan of consecutive segments of ``lengths`` rows (``None``: no rows)."""
    if not lengths:
        return None
    total = sum(lengths)
    return attention_segments(Documents(total, (tuple(accumulate(lengths, initial=0)),)),
                              device)


def rotary_positions(grid: Grid, spatial_merge_size: int, device: torch.device
                     ) -> torch.Tensor:
    """``[S, 2]`` (row, column) of every patch, in the processor's ``m x m`` block order."""
    m = spatial_merge_size
    out = []
    for t, h, w in grid:
        shape = (h // m, w // m, m, m)  # (block row, block column, row in, column in)
        rows = torch.arange(h, device=device).view(h // m, 1, m, 1).expand(shape)
        cols = torch.arange(w, device=device).view(1, w // m, 1, m).expand(shape)
        out.append(torch.stack([rows.flatten(), cols.flatten()], dim=-1).repeat(t, 1))
    if not out:
        return torch.zeros(0, 2, dtype=torch.long, device=device)
    return torch.cat(out)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float) -> Rope:
    """``(cos, sin)``, ``[S, head_dim // 2]`` fp32 each, for :func:`apply_rope`.

    Axial RoPE with ``head_dim / 4`` frequencies of base ``theta``: the first quarter of
    the angles are the row times the frequencies, the second the column times them.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                             device=positions.device) / half))
    angles = torch.cat([positions[:, :1].float() * inv_freq,
                        positions[:, 1:].float() * inv_freq], dim=-1)
    return angles.cos(), angles.sin()


class PatchEmbed(nn.Module):
    """``[N, C*T*P*P]`` flattened patches -> ``[N, hidden]`` (the checkpoint's ``Conv3d``).

    Args:
        in_channels: image channels ``C``.
        temporal_patch_size: frames per patch ``T``.
        patch_size: patch side ``P``.
        hidden_size: output width.
        bias: whether the projection has a bias (Qwen3-VL).
    """

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int,
                 hidden_size: int, bias: bool) -> None:
        super().__init__()
        shape = (hidden_size, in_channels, temporal_patch_size, patch_size, patch_size)
        self.patch_values = math.prod(shape[1:])
        # A convolution's init (models/init.py reads it): unit-scale features of pixels.
        self.init_std = 1.0 / math.sqrt(self.patch_values)
        self.weight = nn.Parameter(torch.randn(shape) * self.init_std)
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Project each patch row; ``pixels`` is cast to the weight's dtype first.

        Raises:
            ValueError: ``pixels`` is not ``[N, C*T*P*P]``.
        """
        if pixels.dim() != 2 or pixels.shape[1] != self.patch_values:
            raise ValueError(f"pixel_values of shape {tuple(pixels.shape)} are invalid; "
                             f"expected [num_patches, {self.patch_values}] (C*T*P*P)")
        return F.linear(pixels.to(self.weight.dtype), self.weight.flatten(1), self.bias)


class VisionAttention(nn.Module):
    """Bidirectional attention within segments, fused biased ``wqkv``, biased ``wo``.

    Args:
        hidden_size: model width.
        num_heads: heads; ``hidden_size / num_heads`` must be a multiple of 4 (2-D RoPE).
        num_layers: depth of the whole stack (scales the init of ``wo``).

    Raises:
        ValueError: a head count that does not give such heads.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        if num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 4:
            raise ValueError(f"num_heads={num_heads} is invalid for hidden_size={hidden_size}: "
                             "expected a divisor leaving heads whose width is a multiple of 4")
        self.head_dim = hidden_size // num_heads
        # Total head counts as blocks.Attention states them (the TP checks read them).
        self.num_heads = self.num_kv_heads = num_heads
        # Rows [q; k; v], each [heads, head_dim] (the checkpoints' qkv layout).
        self.wqkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.wo = nn.Linear(hidden_size, hidden_size)
        self.wo.init_std = residual_init_std(num_layers)

    def forward(self, x: torch.Tensor, rope: Rope, plan: AttentionSegments | None
                ) -> torch.Tensor:
        """``[S, hidden] -> [S, hidden]``; ``rope`` as :func:`rotary_tables` returns it."""
        seq = x.shape[0]
        qkv = linear_on_rows(self.wqkv, x)
        heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(1, seq, 3, heads, self.head_dim).unbind(2)
        out = self.core(q, k, v, rope, plan)
        return linear_on_rows(self.wo, out.reshape(seq, heads * self.head_dim))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
             plan: AttentionSegments | None) -> torch.Tensor:
        """RoPE and the kernel over ``[1, S, heads, head_dim]``; no parameters, so
        selective recompute can run it again."""
        cos, sin = (t.unsqueeze(1) for t in rope)  # [S, 1, head_dim / 2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if plan is None:  # no patches: nothing to attend to
            return q
        return attend(q, k, v, plan, causal=False)


def _norm(kind: str, width: int) -> nn.Module:
    if kind not in NORMS:
        raise ValueError(f"norm={kind!r} is invalid; expected one of {list(NORMS)}")
    return RMSNorm(width, _NORM_EPS) if kind == "rms" else CastLayerNorm(width, eps=_NORM_EPS)


class VisionLayer(nn.Module):
    """``x + attn(attn_norm(x))`` then ``x + mlp(mlp_norm(x))`` over ``[S, hidden]``.

    Args:
        hidden: model width.
        num_heads: attention heads.
        ffn_hidden: MLP inner width.
        gated: a biased SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down: Qwen2.5-VL) or a
            two-layer MLP (``w1``, ``w2``: Qwen3-VL).
        activation: the two-layer MLP's activation (ignored when ``gated``).
        norm: ``"rms"`` (Qwen2.5-VL) or ``"layer"`` (Qwen3-VL).
        num_layers: depth of the whole stack (init scaling only).
    """

    def __init__(self, hidden: int, num_heads: int, ffn_hidden: int, gated: bool,
                 activation: str, norm: str, num_layers: int = 1) -> None:
        super().__init__()
        self.attn_norm = _norm(norm, hidden)
        self.attn = VisionAttention(hidden, num_heads, num_layers)
        self.mlp_norm = _norm(norm, hidden)
        self.mlp = (SwiGLU(hidden, ffn_hidden, num_layers, bias=True) if gated
                    else FeedForward(hidden, ffn_hidden, activation, num_layers))

    def forward(self, x: torch.Tensor, rope: Rope, plan: AttentionSegments | None
                ) -> torch.Tensor:
        """Run the layer; ``plan`` picks the segments (frames or windows)."""
        x = x + self.attn(self.attn_norm(x), rope, plan)
        return x + self.mlp(self.mlp_norm(x))


class PatchMerger(nn.Module):
    """``[S, hidden]`` -> ``[S / merge_unit, out_hidden]``: each ``merge_unit`` rows become
    one token, ``w2(gelu(w1(.)))`` of their normalised concatenation.

    Args:
        hidden: the tower's width.
        out_hidden: the output width (the language model's).
        merge_unit: rows per token (``spatial_merge_size**2``).
        norm: ``"rms"`` or ``"layer"``.
        postshuffle: normalise the concatenated rows (Qwen3-VL's DeepStack mergers)
            instead of each row.
    """

    def __init__(self, hidden: int, out_hidden: int, merge_unit: int, norm: str,
                 postshuffle: bool = False) -> None:
        super().__init__()
        self.width = hidden * merge_unit
        self.postshuffle = postshuffle
        self.norm = _norm(norm, self.width if postshuffle else hidden)
        self.w1 = nn.Linear(self.width, self.width)
        self.w2 = nn.Linear(self.width, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Merge and project; rows must be a multiple of ``merge_unit``."""
        x = (self.norm(x.reshape(-1, self.width)) if self.postshuffle
             else self.norm(x).reshape(-1, self.width))
        return linear_on_rows(self.w2, F.gelu(linear_on_rows(self.w1, x)))


def layer_items(layers: nn.ModuleDict, layer_chunks: list[list[int]] | None,
                chunk: int | None) -> list[tuple[int, nn.Module]]:
    """``(global index, layer)`` of model chunk ``chunk``, or of every layer held."""
    if chunk is None:
        return [(int(i), layer) for i, layer in layers.items()]
    assert layer_chunks is not None, "chunk given to a module without layer_chunks"
    return [(i, layers[str(i)]) for i in layer_chunks[chunk]]


def check_patches(pixels: torch.Tensor, grid: Grid) -> None:
    """Raise ``ValueError`` unless ``pixels`` has one row per patch of ``grid``."""
    expected = sum(t * h * w for t, h, w in grid)
    if pixels.shape[0] != expected:
        raise ValueError(f"pixel_values has {pixels.shape[0]} patch rows, grid_thw "
                         f"{[list(g) for g in grid]} describes {expected}")
