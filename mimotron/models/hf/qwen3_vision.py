"""The Qwen3-VL vision tower (``Qwen3VLVisionModel``) as our module.

A ViT over flat patch rows of media of any sizes (see :mod:`.qwen_vision`): a biased
patch projection plus a learned position table, 2-D RoPE, pre-LayerNorm layers with a
two-layer MLP, every layer attending over whole frames, and a merger to the language
model's width. Two things differ from Qwen2.5-VL:

* **Position table.** ``num_position_embeddings`` learned rows form a ``side x side``
  grid, resampled to each frame's ``h x w`` patch grid by bilinear interpolation with
  aligned corners (patch row ``i`` sits at ``i * (side - 1) / (h - 1)`` of the table),
  in the processor's merge-block order, the same for every frame of a video.
* **DeepStack.** After each layer of ``deepstack_visual_indexes`` a merger of its own
  (normalising the concatenated rows) turns the hidden states into language-model
  tokens; the language model adds them to its early layers' hidden states. They come
  out in layer order, the ``j``-th index's merger being checkpoint
  ``deepstack_merger_list.j``.

Layers sit in ``self.layers`` keyed by global index (``layer_ids`` picks a pipeline
stage's); ``pre_process`` holds the embeddings, ``post_process`` the final merger; each
DeepStack merger lives with its layer. :data:`QWEN3_VISION_WEIGHTS` reads
``model.visual.*``, ``visual.*`` and a bare tower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mimotron.config.qwen_vl_vision import qwen3_vision_args
from mimotron.models.blocks import INIT_STD, is_last_chunk, make_layers, to_residual_dtype
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

_MERGER = ("norm.", "w1.", "w2.")
_HF_MERGER = ("norm.", "linear_fc1.", "linear_fc2.")

QWEN3_VISION_WEIGHTS = WeightMap(
    rules=(
        ("patch_embed.", "patch_embed.proj."),
        ("pos_embed", "pos_embed.weight"),
        ("layers.{i}.attn_norm.", "blocks.{i}.norm1."),
        ("layers.{i}.attn.wqkv.", "blocks.{i}.attn.qkv."),
        ("layers.{i}.attn.wo.", "blocks.{i}.attn.proj."),
        ("layers.{i}.mlp_norm.", "blocks.{i}.norm2."),
        ("layers.{i}.mlp.w1.", "blocks.{i}.mlp.linear_fc1."),
        ("layers.{i}.mlp.w2.", "blocks.{i}.mlp.linear_fc2."),
        *((f"merger.{o}", f"merger.{h}") for o, h in zip(_MERGER, _HF_MERGER, strict=True)),
        *((f"deepstack_mergers.{{i}}.{o}", f"deepstack_merger_list.{{i}}.{h}")
          for o, h in zip(_MERGER, _HF_MERGER, strict=True)),
    ),
    prefixes=("model.visual.", "visual.", ""),
    ignored=(r"(?!(model\.)?visual\.)",),  # the language model and its head
)


def _axis_taps(size: int, side: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower and upper table rows of ``size`` patch positions and the upper's weight."""
    where = torch.arange(size, dtype=torch.float32, device=device) * (side - 1) / max(size - 1, 1)
    lower = where.floor()
    return lower.long(), (lower.long() + 1).clamp(max=side - 1), where - lower


def interpolated_positions(table: torch.Tensor, grid: Grid, spatial_merge_size: int
                           ) -> torch.Tensor:
    """``[S, hidden]``: the ``side x side`` table resampled to every frame's patch grid.

    Args:
        table: ``[side * side, hidden]`` learned positions.
        grid: each medium's ``(t, h, w)``.
        spatial_merge_size: ``m``: rows come in the processor's ``m x m`` block order.
    """
    side, m = math.isqrt(table.shape[0]), spatial_merge_size
    square = table.view(side, side, -1)
    out = []
    for t, h, w in grid:
        top, bottom, dy = _axis_taps(h, side, table.device)
        left, right, dx = _axis_taps(w, side, table.device)
        dy, dx = dy[:, None, None], dx[None, :, None]
        rows_top = (1 - dx) * square[top[:, None], left] + dx * square[top[:, None], right]
        rows_bottom = (1 - dx) * square[bottom[:, None], left] + dx * square[bottom[:, None],
                                                                             right]
        frame = (1 - dy) * rows_top + dy * rows_bottom  # [h, w, hidden]
        frame = frame.view(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
        out.append(frame.repeat(t, 1))
    # No media: an empty slice of the table, so it still gets a (zero) gradient.
    return torch.cat(out) if out else table[:0]


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's vision tower: ``[num_patches, C*T*P*P]`` -> merged tokens and DeepStack
    features, ``[num_patches / m**2, out_hidden_size]`` each, media in order.

    Args:
        depth: layers of the tower.
        hidden_size: model width.
        intermediate_size: MLP inner width.
        num_heads: attention heads.
        out_hidden_size: the mergers' output width.
        num_position_embeddings: rows of the learned position table (a square).
        deepstack_visual_indexes: layers whose output a DeepStack merger turns into
            features, in checkpoint order.
        hidden_act: MLP activation (``gelu_pytorch_tanh``, ...).
        in_channels: image channels.
        patch_size: patch side in pixels.
        temporal_patch_size: frames per patch.
        spatial_merge_size: ``m``: ``m x m`` patches merge into one token.
        rope_theta: the 2-D RoPE base.
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the embeddings (first pipeline stage).
        post_process: hold the final merger (last pipeline stage).

    Raises:
        ValueError: inconsistent sizes or options.
    """

    weight_map = QWEN3_VISION_WEIGHTS

    def __init__(self, depth: int, hidden_size: int, intermediate_size: int, num_heads: int,
                 out_hidden_size: int, num_position_embeddings: int = 2304,
                 deepstack_visual_indexes: Sequence[int] = (8, 16, 24),
                 hidden_act: str = "gelu_pytorch_tanh", in_channels: int = 3,
                 patch_size: int = 16, temporal_patch_size: int = 2,
                 spatial_merge_size: int = 2, rope_theta: float = 10000.0,
                 layer_ids: list[int] | None = None, pre_process: bool = True,
                 post_process: bool = True) -> None:
        super().__init__()
        if math.isqrt(num_position_embeddings) ** 2 != num_position_embeddings:
            raise ValueError(f"num_position_embeddings={num_position_embeddings} is invalid; "
                             "expected a square number")
        self.hidden_size, self.output_size = hidden_size, out_hidden_size
        self.num_layers, self.num_heads = depth, num_heads
        self.spatial_merge_size, self.rope_theta = spatial_merge_size, rope_theta
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.patch_embed = PatchEmbed(in_channels, temporal_patch_size, patch_size,
                                          hidden_size, bias=True)
            self.pos_embed = nn.Parameter(torch.randn(num_position_embeddings, hidden_size)
                                          * INIT_STD)
        self.layers = make_layers(
            layer_ids, depth, build=VisionLayer, hidden=hidden_size, num_heads=num_heads,
            ffn_hidden=intermediate_size, gated=False, activation=hidden_act, norm="layer")
        # Layer id -> the index of its DeepStack merger (the checkpoint's list position).
        self.deepstack = {layer: j for j, layer in enumerate(deepstack_visual_indexes)}
        unit = spatial_merge_size**2
        self.deepstack_mergers = nn.ModuleDict({
            str(j): PatchMerger(hidden_size, out_hidden_size, unit, "layer", postshuffle=True)
            for layer, j in self.deepstack.items() if str(layer) in self.layers})
        if post_process:
            self.merger = PatchMerger(hidden_size, out_hidden_size, unit, "layer")
        # Interleaved 1F1B: global layer ids of each model chunk held.
        self.layer_chunks: list[list[int]] | None = None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a ``qwen3_vl`` config.json dict or its vision part.

        Raises:
            ValueError: another model type, or an option the tower does not implement.
        """
        return qwen3_vision_args(config)

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
                deepstack: Sequence[torch.Tensor] = (), chunk: int | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Patches (first stage) or hidden states -> merged tokens and DeepStack features.

        Args:
            x: ``[num_patches, C*T*P*P]`` if ``pre_process`` (and ``chunk`` is 0 or
                ``None``), else ``[num_patches, hidden]``.
            grid_thw: ``[num_media, 3]`` patch grids (a CPU tensor or a list: the plan is
                made on the host).
            deepstack: the DeepStack features earlier pipeline stages made.
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks``; ``None`` = every layer held.

        Returns:
            ``(out, features)``: ``out`` is ``[num_patches / m**2, out_hidden_size]`` on the
            last stage (last chunk), else the ``[num_patches, hidden]`` hidden states;
            ``features`` is ``deepstack`` followed by this call's DeepStack features,
            ``[num_patches / m**2, out_hidden_size]`` each, in layer order.

        Raises:
            ValueError: a bad ``grid_thw`` or one that does not match ``x``'s rows.
        """
        grid = read_grid(grid_thw, self.spatial_merge_size)
        check_patches(x, grid)
        device = x.device
        if self.pre_process and not chunk:
            x = self.patch_embed(x)
            positions = interpolated_positions(self.pos_embed, grid, self.spatial_merge_size)
            x = to_residual_dtype(x + positions.to(x.dtype), self.fp32_residual)
        rope = rotary_tables(rotary_positions(grid, self.spatial_merge_size, device),
                             self.hidden_size // self.num_heads, self.rope_theta)
        frames = segments_plan(frame_lengths(grid), device)
        features = list(deepstack)
        for i, layer in layer_items(self.layers, self.layer_chunks, chunk):
            x = layer(x, rope, frames)
            if i in self.deepstack:
                features.append(self.deepstack_mergers[str(self.deepstack[i])](x))
        if not self.post_process or not is_last_chunk(self.layer_chunks, chunk):
            return x, features
        return self.merger(x), features
