"""The Qwen2.5-VL vision tower (``Qwen2_5_VisionTransformerPretrainedModel``) as our module.

A ViT over flat patch rows of media of any sizes (see :mod:`.qwen_vision`): patch
projection, 2-D RoPE, pre-RMSNorm layers with a biased SwiGLU, and a merger to the
language model's width. Most layers attend within *windows*: squares of
``window_size / (patch_size * spatial_merge_size)`` merged tokens of one frame (smaller at
the frame's right and bottom edges); the layers of ``fullatt_block_indexes`` attend over
whole frames. So that every window is a run of consecutive rows, the embedded patches
are reordered once, window by window (merge blocks kept whole, frames in order), and
stay in that order through every layer; the merger's tokens are put back in the
processor's order at the end. The window and frame segments are the backend's plan.

Layers sit in ``self.layers`` keyed by global index (``layer_ids`` picks a pipeline
stage's); ``pre_process`` holds the patch projection and the reordering,
``post_process`` the merger. A middle stage takes and returns ``[S, hidden]`` hidden
states in window order; every stage reads ``grid_thw``.

:data:`QWEN25_VISION_WEIGHTS` reads ``model.visual.*`` (transformers 5's
``save_pretrained`` of ``Qwen2_5_VLForConditionalGeneration``), ``visual.*`` (the hub
checkpoints) and a bare tower; the language model's tensors are ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mimotron.config.qwen_vl_vision import qwen25_vision_args
from mimotron.models.blocks import is_last_chunk, make_layers, to_residual_dtype
from mimotron.models.hf.qwen_vision import (
    Grid,
    PatchEmbed,
    PatchMerger,
    VisionLayer,
    check_patches,
    frame_lengths,
    layer_items,
    read_grid,
    rotary_positions,
    rotary_tables,
    segments_plan,
)
from mimotron.models.hf.weights import WeightMap

_LAYER_RULES = (
    ("layers.{i}.attn_norm.", "blocks.{i}.norm1."),
    ("layers.{i}.attn.wqkv.", "blocks.{i}.attn.qkv."),
    ("layers.{i}.attn.wo.", "blocks.{i}.attn.proj."),
    ("layers.{i}.mlp_norm.", "blocks.{i}.norm2."),
    ("layers.{i}.mlp.w1.", "blocks.{i}.mlp.gate_proj."),
    ("layers.{i}.mlp.w3.", "blocks.{i}.mlp.up_proj."),
    ("layers.{i}.mlp.w2.", "blocks.{i}.mlp.down_proj."),
)
# Not the tower: anything outside (model.)visual. (the language model, its head).
_NOT_VISION = (r"(?!(model\.)?visual\.)",)

QWEN25_VISION_WEIGHTS = WeightMap(
    rules=(("patch_embed.", "patch_embed.proj."), *_LAYER_RULES,
           ("merger.norm.", "merger.ln_q."), ("merger.w1.", "merger.mlp.0."),
           ("merger.w2.", "merger.mlp.2.")),
    prefixes=("model.visual.", "visual.", ""),
    ignored=_NOT_VISION,
)


def window_order(grid: Grid, spatial_merge_size: int, window_units: int,
                 device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks in window order, and the windows' lengths in patches.

    Args:
        grid: each medium's ``(t, h, w)``.
        spatial_merge_size: ``m``: a merge block is ``m x m`` patches.
        window_units: a window's side in merge blocks.
        device: where the order is made.

    Returns:
        ``order``: ``[S / m**2]`` long, the processor-order index of each merge block in
        window order (per medium: frame, window row, window column, then row-major
        inside the window); ``lengths``: patches per window, in that order.
    """
    s, unit = window_units, spatial_merge_size**2
    orders, lengths, offset = [], [], 0
    for t, h, w in grid:
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        across, down = -(-cols // s), -(-rows // s)  # windows per row, per column
        window = (torch.arange(t, device=device).view(t, 1, 1) * (down * across)
                  + torch.arange(rows, device=device).div(s, rounding_mode="floor")
                  .view(1, rows, 1) * across
                  + torch.arange(cols, device=device).div(s, rounding_mode="floor")
                  .view(1, 1, cols))
        # A stable sort of raster-order blocks by window keeps them row-major inside it.
        orders.append(torch.sort(window.flatten(), stable=True).indices + offset)
        offset += t * rows * cols
        lengths += [min(s, rows - a * s) * min(s, cols - b * s) * unit
                    for _ in range(t) for a in range(down) for b in range(across)]
    if not orders:
        return torch.zeros(0, dtype=torch.long, device=device), []
    return torch.cat(orders), lengths


def _token_order(block_order: torch.Tensor, unit: int) -> torch.Tensor:
    """Row index of every patch in window order (merge blocks kept whole)."""
    inner = torch.arange(unit, device=block_order.device)
    return (block_order[:, None] * unit + inner).flatten()


class Qwen25VisionTower(nn.Module):
    """Qwen2.5-VL's vision tower: ``[num_patches, C*T*P*P]`` -> ``[num_patches / m**2,
    out_hidden_size]`` merged tokens, media in order.

    Args:
        depth: layers of the tower.
        hidden_size: model width.
        intermediate_size: SwiGLU inner width.
        num_heads: attention heads.
        out_hidden_size: the merger's output width.
        in_channels: image channels.
        patch_size: patch side in pixels.
        temporal_patch_size: frames per patch.
        spatial_merge_size: ``m``: ``m x m`` patches merge into one token.
        window_size: a window's side in pixels (``window_size // (patch_size * m)``
            merge blocks).
        fullatt_block_indexes: layers that attend over whole frames.
        rope_theta: the 2-D RoPE base.
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the patch projection (first pipeline stage).
        post_process: hold the merger (last pipeline stage).

    Raises:
        ValueError: inconsistent sizes or options.
    """

    weight_map = QWEN25_VISION_WEIGHTS

    def __init__(self, depth: int, hidden_size: int, intermediate_size: int, num_heads: int,
                 out_hidden_size: int, in_channels: int = 3, patch_size: int = 14,
                 temporal_patch_size: int = 2, spatial_merge_size: int = 2,
                 window_size: int = 112, fullatt_block_indexes: Sequence[int] = (7, 15, 23, 31),
                 rope_theta: float = 10000.0, layer_ids: list[int] | None = None,
                 pre_process: bool = True, post_process: bool = True) -> None:
        super().__init__()
        self.window_units = window_size // (patch_size * spatial_merge_size)
        if self.window_units < 1:
            raise ValueError(f"window_size={window_size} is invalid; expected at least "
                             f"patch_size * spatial_merge_size = {patch_size * spatial_merge_size}")
        self.hidden_size, self.output_size = hidden_size, out_hidden_size
        self.num_layers, self.num_heads = depth, num_heads
        self.spatial_merge_size, self.rope_theta = spatial_merge_size, rope_theta
        self.merge_unit = spatial_merge_size**2
        self.full_attention = frozenset(fullatt_block_indexes)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.patch_embed = PatchEmbed(in_channels, temporal_patch_size, patch_size,
                                          hidden_size, bias=False)
        self.layers = make_layers(
            layer_ids, depth, build=VisionLayer, hidden=hidden_size, num_heads=num_heads,
            ffn_hidden=intermediate_size, gated=True, activation="silu", norm="rms")
        if post_process:
            self.merger = PatchMerger(hidden_size, out_hidden_size, self.merge_unit, "rms")
        # Interleaved 1F1B: global layer ids of each model chunk held.
        self.layer_chunks: list[list[int]] | None = None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a ``qwen2_5_vl`` config.json dict or its vision part.

        Raises:
            ValueError: another model type, or an option the tower does not implement.
        """
        return qwen25_vision_args(config)

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
                chunk: int | None = None) -> torch.Tensor:
        """Patches (first stage) or hidden states -> hidden states / merged tokens.

        Args:
            x: ``[num_patches, C*T*P*P]`` if ``pre_process`` (and ``chunk`` is 0 or
                ``None``), else ``[num_patches, hidden]`` in window order.
            grid_thw: ``[num_media, 3]`` patch grids (a CPU tensor or a list: the plan is
                made on the host).
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks``; ``None`` = every layer held.

        Returns:
            ``[num_patches / m**2, out_hidden_size]`` in the processor's order on the last
            stage (last chunk), else ``[num_patches, hidden]`` in window order.

        Raises:
            ValueError: a bad ``grid_thw`` or one that does not match ``x``'s rows.
        """
        grid = read_grid(grid_thw, self.spatial_merge_size)
        check_patches(x, grid)
        device = x.device
        blocks, windows = window_order(grid, self.spatial_merge_size, self.window_units,
                                       device)
        tokens = _token_order(blocks, self.merge_unit)
        if self.pre_process and not chunk:
            x = to_residual_dtype(self.patch_embed(x)[tokens], self.fp32_residual)
        rope = rotary_tables(rotary_positions(grid, self.spatial_merge_size, device)[tokens],
                             self.hidden_size // self.num_heads, self.rope_theta)
        # Frames stay contiguous in window order (windows never cross frames).
        frames = segments_plan(frame_lengths(grid), device)
        windowed = segments_plan(windows, device)
        for i, layer in layer_items(self.layers, self.layer_chunks, chunk):
            x = layer(x, rope, frames if i in self.full_attention else windowed)
        if not self.post_process or not is_last_chunk(self.layer_chunks, chunk):
            return x
        merged = self.merger(x)
        # Row j of merged is block blocks[j]: scatter back to the processor's order.
        return merged.new_empty(merged.shape).index_copy(0, blocks, merged)
