"""The Whisper encoder (``WhisperModel.encoder``) as our module, with output downsampling.

Front end: ``conv1`` (k=3) + GELU, ``conv2`` (k=3, stride 2) + GELU over log-mel features
``[n, num_mel_bins, 2 * max_source_positions]``, plus the fixed sinusoidal positions
(``embed_positions``, a buffer: Whisper never trains them). Then pre-LayerNorm encoder
layers (the key projection has no bias) and the final ``layer_norm``. The output
``[n, max_source_positions, d_model]`` is then downsampled by ``downsample_factor`` k
before the projector: ``"avg"`` averages k consecutive frames (width stays ``d_model``),
``"stack"`` concatenates them (width ``k * d_model``); k = 1 leaves it unchanged.

Layers sit in ``self.layers`` keyed by global index (``layer_ids`` picks a pipeline
stage's); ``pre_process`` holds the front end, ``post_process`` the final norm and the
downsampling.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.config.hf_specs import check_activation, whisper_tower_args
from mimotron.models.blocks import chunk_modules, is_last_chunk, make_layers, to_residual_dtype
from mimotron.models.hf.layers import CastLayerNorm, PreLNEncoderLayer
from mimotron.models.hf.weights import WeightMap

DOWNSAMPLE_MODES = ("avg", "stack")

WHISPER_WEIGHTS = WeightMap(
    rules=(
        ("conv1.", "conv1."),
        ("conv2.", "conv2."),
        ("embed_positions", "embed_positions.weight"),
        ("layers.{i}.attn_norm.", "layers.{i}.self_attn_layer_norm."),
        ("layers.{i}.attn.wq.", "layers.{i}.self_attn.q_proj."),
        ("layers.{i}.attn.wk.", "layers.{i}.self_attn.k_proj."),
        ("layers.{i}.attn.wv.", "layers.{i}.self_attn.v_proj."),
        ("layers.{i}.attn.wo.", "layers.{i}.self_attn.out_proj."),
        ("layers.{i}.mlp_norm.", "layers.{i}.final_layer_norm."),
        ("layers.{i}.mlp.w1.", "layers.{i}.fc1."),
        ("layers.{i}.mlp.w2.", "layers.{i}.fc2."),
        ("final_norm.", "layer_norm."),
    ),
    prefixes=("model.encoder.", "encoder.", ""),
    # The decoder and output head of WhisperModel / WhisperForConditionalGeneration.
    ignored=(r"(model\.)?decoder\.", r"proj_out\."),
)

# Whisper's LayerNorms use PyTorch's default epsilon.
_LAYER_NORM_EPS = 1e-5


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper's sinusoidal position table ``[length, channels]`` (sines, then cosines).

    Raises:
        ValueError: odd ``channels``.
    """
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even d_model, got {channels}")
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length).view(-1, 1) * inv_timescales.view(1, -1)
    return torch.cat([scaled_time.sin(), scaled_time.cos()], dim=1)


class WhisperEncoderTower(nn.Module):
    """Whisper's encoder: ``[n, num_mel_bins, 2 * max_source_positions] -> [n, tokens, out]``.

    Args:
        num_mel_bins: mel bins (input channels).
        max_source_positions: encoder positions (frames after the stride-2 conv).
        d_model: model width.
        encoder_layers: transformer layers.
        encoder_attention_heads: attention heads.
        encoder_ffn_dim: MLP inner width.
        activation_function: MLP activation.
        downsample_factor: k consecutive output frames become one token (1 = none).
        downsample_mode: ``"avg"`` or ``"stack"`` (see module docs).
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the conv front end and positions (first pipeline stage).
        post_process: hold the final norm and downsampling (last pipeline stage).

    Raises:
        ValueError: a downsampling that does not divide the frames, or a bad option.
    """

    weight_map = WHISPER_WEIGHTS

    def __init__(
        self,
        num_mel_bins: int,
        max_source_positions: int,
        d_model: int,
        encoder_layers: int,
        encoder_attention_heads: int,
        encoder_ffn_dim: int,
        activation_function: str = "gelu",
        downsample_factor: int = 1,
        downsample_mode: str = "avg",
        layer_ids: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        _check_downsampling(max_source_positions, downsample_factor, downsample_mode)
        check_activation("activation_function", activation_function)
        self.num_mel_bins, self.num_frames = num_mel_bins, 2 * max_source_positions
        self.hidden_size, self.num_layers = d_model, encoder_layers
        self.factor, self.mode = downsample_factor, downsample_mode
        self.num_tokens = max_source_positions // downsample_factor
        self.output_size = d_model * (downsample_factor if downsample_mode == "stack" else 1)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.conv1 = nn.Conv1d(num_mel_bins, d_model, kernel_size=3, padding=1)
            self.conv2 = nn.Conv1d(d_model, d_model, kernel_size=3, stride=2, padding=1)
            # A buffer, not a parameter: fixed in Whisper (requires_grad=False there), so
            # it gets no init draw and no optimizer state; the loader fills it anyway.
            self.register_buffer("embed_positions", sinusoids(max_source_positions, d_model),
                                 persistent=False)
        self.layers = make_layers(
            layer_ids, encoder_layers, build=PreLNEncoderLayer, hidden=d_model,
            num_heads=encoder_attention_heads, ffn_hidden=encoder_ffn_dim,
            activation=activation_function, eps=_LAYER_NORM_EPS, key_bias=False, clamp_fp16=True,
        )
        self.final_norm = CastLayerNorm(d_model, eps=_LAYER_NORM_EPS) if post_process else None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False
        # Interleaved 1F1B: global layer ids of each model chunk held (LanguageModel's).
        self.layer_chunks: list[list[int]] | None = None

    def embed(self, features: torch.Tensor) -> torch.Tensor:
        """Conv front end plus positions: ``[n, mel, frames] -> [n, positions, d_model]``."""
        if features.dim() != 3 or tuple(features.shape[-2:]) != (self.num_mel_bins,
                                                                  self.num_frames):
            raise ValueError(
                f"the Whisper encoder expects [n, {self.num_mel_bins}, {self.num_frames}] "
                f"log-mel features, got input of shape {tuple(features.shape)}"
            )
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)
        return x + self.embed_positions.to(x.dtype)

    def downsample(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, T, d] -> [n, T / k, d]`` (avg) or ``[n, T / k, k * d]`` (stack)."""
        if self.factor == 1:
            return x
        n, frames, width = x.shape
        grouped = x.reshape(n, frames // self.factor, self.factor, width)
        if self.mode == "avg":
            return grouped.mean(dim=2)
        return grouped.reshape(n, frames // self.factor, self.factor * width)

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Features (first stage) or hidden states -> hidden states / downsampled output.

        Args:
            x: log-mel ``[n, num_mel_bins, num_frames]`` if ``pre_process`` (and ``chunk``
                is 0 or ``None``), else ``[n, max_source_positions, d_model]``.
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks``; ``None`` = every layer.

        Returns:
            ``[n, num_tokens, output_size]`` on the last stage (last chunk), else
            ``[n, max_source_positions, d_model]``.
        """
        if self.pre_process and not chunk:
            x = to_residual_dtype(self.embed(x), self.fp32_residual).contiguous()
        for layer in chunk_modules(self.layers, self.layer_chunks, chunk):
            x = layer(x)
        if self.final_norm is None or not is_last_chunk(self.layer_chunks, chunk):
            return x
        return self.downsample(self.final_norm(x))

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a ``WhisperConfig`` dict (``model_type="whisper"``).

        Raises:
            ValueError: another model type, or an option the encoder does not implement.
        """
        return whisper_tower_args(config)


def _check_downsampling(positions: int, factor: int, mode: str) -> None:
    if mode not in DOWNSAMPLE_MODES:
        raise ValueError(f"downsample_mode={mode!r} is invalid; expected one of "
                         f"{list(DOWNSAMPLE_MODES)}")
    if factor < 1 or positions % factor:
        raise ValueError(f"downsample_factor={factor} is invalid: expected a divisor of "
                         f"max_source_positions={positions}")
