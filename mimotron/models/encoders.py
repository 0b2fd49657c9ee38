"""Modality encoders (ViT, audio), the MLP projector, and their pairing.

Every encoder is pipeline-splittable: ``layer_ids`` picks which global layers an instance
holds (they live in ``self.layers`` keyed by the global index, so parameter names are
the same whatever the split), ``pre_process`` adds the input embedding (patch / conv
front end and position embedding), ``post_process`` adds the final norm. A middle stage
maps hidden states ``[n, tokens, hidden]`` to hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mimotron.models.blocks import (
    RMSNorm,
    chunk_modules,
    is_last_chunk,
    linear_on_rows,
    make_layers,
    to_residual_dtype,
)


class _EncoderStack(nn.Module):
    """Shared body of the encoders: optional front end, selected layers, optional norm.

    Args:
        front_end: raw input -> ``[n, num_tokens, hidden]`` on the first stage, else
            ``None`` (then the stage also has no position embedding).
        num_tokens: tokens per sample.
        hidden_size: model width.
        num_layers: transformer layers of the whole encoder.
        num_heads: attention heads.
        ffn_hidden_size: SwiGLU width (0 = default).
        layer_ids: global layer indices this instance holds (``None`` = all).
        post_process: hold the final norm.
    """

    def __init__(
        self,
        front_end: nn.Module | None,
        num_tokens: int,
        hidden_size: int,
        num_layers: int,
        num_heads: int,
        ffn_hidden_size: int,
        layer_ids: list[int] | None,
        post_process: bool,
    ) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.hidden_size = hidden_size
        self.pre_process = front_end is not None
        self.post_process = post_process
        # Registered first so parameters are listed in data-flow order.
        self.front_end = front_end
        if front_end is not None:
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, hidden_size))
        self.layers = make_layers(
            layer_ids,
            num_layers,
            hidden=hidden_size,
            num_heads=num_heads,
            ffn_hidden=ffn_hidden_size,
            causal=False,
        )
        self.final_norm = RMSNorm(hidden_size) if post_process else None
        # Interleaved 1F1B: global layer ids of each model chunk held (see LanguageModel).
        self.layer_chunks: list[list[int]] | None = None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Encode raw input (first stage) or hidden states (later stages).

        Args:
            x: raw modality input if ``pre_process`` (and ``chunk`` is 0 or ``None``),
                else ``[n, num_tokens, hidden]``.
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks``; ``None`` = every layer.

        Returns:
            ``[n, num_tokens, hidden]``: final-normed on the last stage (last chunk).
        """
        if self.front_end is not None and not chunk:
            # Contiguous: the front end's output is a transposed view, and every linear
            # of the first layer would copy it (and save its copy) otherwise.
            x = to_residual_dtype(self.front_end(x) + self.pos_embed, self.fp32_residual)
            x = x.contiguous()
        for layer in chunk_modules(self.layers, self.layer_chunks, chunk):
            x = layer(x)
        if self.final_norm is not None and is_last_chunk(self.layer_chunks, chunk):
            x = self.final_norm(x)
        return x


class PatchEmbedding(nn.Module):
    """Non-overlapping square patches to vectors: ``[n, C, H, W] -> [n, num_patches, hidden]``.

    Args:
        image_size: height and width of the (square) input.
        patch_size: patch side.
        in_channels: image channels.
        hidden_size: output width.
    """

    def __init__(self, image_size: int, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.image_size = image_size
        # A stride-patch conv is a Linear over each flattened patch; the output keeps the
        # row-major patch order.
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed the patches of ``x``; raises ``ValueError`` on a wrongly sized image."""
        if x.dim() != 4 or tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"VisionEncoder expects [n, C, {self.image_size}, {self.image_size}] images, "
                f"got input of shape {tuple(x.shape)}"
            )
        return self.proj(x).flatten(2).transpose(1, 2)


class AudioFrontEnd(nn.Module):
    """Spectrogram to tokens: ``[n, num_freq_bins, num_frames] -> [n, num_tokens, hidden]``.

    A ``k=3, s=1`` conv over time (frequency bins as channels) and GELU, then a conv with
    kernel = stride = ``num_frames // num_tokens`` that pools frames into tokens.

    Args:
        num_freq_bins: spectrogram bins (input channels).
        num_frames: spectrogram frames.
        num_tokens: output tokens; divides ``num_frames``.
        hidden_size: output width.
    """

    def __init__(self, num_freq_bins: int, num_frames: int, num_tokens: int, hidden_size: int):
        super().__init__()
        self.num_freq_bins = num_freq_bins
        self.num_frames = num_frames
        stride = num_frames // num_tokens
        self.conv1 = nn.Conv1d(num_freq_bins, hidden_size, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(hidden_size, hidden_size, kernel_size=stride, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed ``x``; raises ``ValueError`` on a wrongly sized spectrogram."""
        if x.dim() != 3 or tuple(x.shape[-2:]) != (self.num_freq_bins, self.num_frames):
            raise ValueError(
                f"AudioEncoder expects [n, {self.num_freq_bins}, {self.num_frames}] "
                f"spectrograms, got input of shape {tuple(x.shape)}"
            )
        return self.conv2(F.gelu(self.conv1(x))).transpose(1, 2)


class VisionEncoder(_EncoderStack):
    """ViT over non-overlapping square patches; ``[n, C, H, W] -> [n, num_patches, hidden]``.

    Args:
        image_size: height and width of the (square) input.
        patch_size: patch side; must divide ``image_size``.
        in_channels: image channels.
        hidden_size: model width.
        num_layers: transformer layers in the whole encoder.
        num_heads: attention heads.
        ffn_hidden_size: SwiGLU width (0 = default).
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the patch and position embeddings (first pipeline stage).
        post_process: hold the final norm (last pipeline stage).

    Raises:
        ValueError: if ``patch_size`` does not divide ``image_size``.
    """

    def __init__(
        self,
        image_size: int = 8,
        patch_size: int = 2,
        in_channels: int = 1,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        ffn_hidden_size: int = 0,
        layer_ids: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        if patch_size < 1 or image_size % patch_size:
            raise ValueError(
                f"patch_size={patch_size} is invalid: expected a divisor of image_size={image_size}"
            )
        front_end = (
            PatchEmbedding(image_size, patch_size, in_channels, hidden_size)
            if pre_process
            else None
        )
        num_patches = (image_size // patch_size) ** 2
        super().__init__(
            front_end,
            num_patches,
            hidden_size,
            num_layers,
            num_heads,
            ffn_hidden_size,
            layer_ids,
            post_process,
        )


class AudioEncoder(_EncoderStack):
    """Conv front end over time plus transformer layers; ``[n, F, T] -> [n, tokens, hidden]``.

    See :class:`AudioFrontEnd` for the front end.

    Args:
        num_freq_bins: spectrogram bins (input channels).
        num_frames: spectrogram frames.
        num_audio_tokens: output tokens; must divide ``num_frames``.
        hidden_size: model width.
        num_layers: transformer layers in the whole encoder.
        num_heads: attention heads.
        ffn_hidden_size: SwiGLU width (0 = default).
        layer_ids: global layer indices this instance holds (``None`` = all).
        pre_process: hold the conv front end and position embedding.
        post_process: hold the final norm.

    Raises:
        ValueError: if ``num_audio_tokens`` does not divide ``num_frames``.
    """

    def __init__(
        self,
        num_freq_bins: int = 129,
        num_frames: int = 16,
        num_audio_tokens: int = 4,
        hidden_size: int = 64,
        num_layers: int = 1,
        num_heads: int = 4,
        ffn_hidden_size: int = 0,
        layer_ids: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        if num_audio_tokens < 1 or num_frames % num_audio_tokens:
            raise ValueError(
                f"num_audio_tokens={num_audio_tokens} is invalid: expected a divisor of "
                f"num_frames={num_frames}"
            )
        front_end = (
            AudioFrontEnd(num_freq_bins, num_frames, num_audio_tokens, hidden_size)
            if pre_process
            else None
        )
        super().__init__(
            front_end,
            num_audio_tokens,
            hidden_size,
            num_layers,
            num_heads,
            ffn_hidden_size,
            layer_ids,
            post_process,
        )


class Projector(nn.Module):
    """Two-layer GELU MLP from encoder width to language-model width.

    Args:
        in_size: encoder hidden size.
        out_size: language-model hidden size.
        hidden_size: inner width; 0 = ``out_size``.
    """

    def __init__(self, in_size: int, out_size: int, hidden_size: int = 0) -> None:
        super().__init__()
        inner = hidden_size or out_size
        self.fc1 = nn.Linear(in_size, inner)
        self.fc2 = nn.Linear(inner, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_size] -> [..., out_size]``."""
        # As matrices: under TP a sharded linear cannot view zero rows (an empty slice)
        # back to [0, tokens, ...] unless tokens divide by the degree (linear_on_rows).
        return linear_on_rows(self.fc2, F.gelu(linear_on_rows(self.fc1, x)))


class ModalitySubmodule(nn.Module):
    """An encoder followed by its projector into the language model's embedding space.

    On a pipeline-split encoder, only the last stage holds the projector (pass
    ``projector=None`` elsewhere); then ``forward`` returns encoder hidden states.

    Args:
        encoder: a :class:`VisionEncoder`, :class:`AudioEncoder` or any module mapping
            the input to ``[n, tokens, hidden]``.
        projector: maps encoder width to language width, or ``None`` on non-last stages.
    """

    def __init__(self, encoder: nn.Module, projector: nn.Module | None) -> None:
        super().__init__()
        self.encoder = encoder
        self.projector = projector

    @property
    def pre_process(self) -> bool:
        """Whether this instance takes raw modality input."""
        return bool(getattr(self.encoder, "pre_process", True))

    @property
    def post_process(self) -> bool:
        """Whether this instance emits language-model embeddings."""
        return self.projector is not None

    @property
    def num_tokens(self) -> int:
        """Embeddings emitted per sample (placeholder tokens in the text)."""
        return int(self.encoder.num_tokens)

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Encode and project: raw input -> ``[n, tokens, lm_hidden]`` (see class docs).

        ``chunk`` (interleaved pipelines) runs one model chunk of the encoder; the
        projector follows the last one only.
        """
        if chunk is None:
            x = self.encoder(x)
            return x if self.projector is None else self.projector(x)
        x = self.encoder(x, chunk=chunk)
        last = is_last_chunk(self.encoder.layer_chunks, chunk)
        return x if self.projector is None or not last else self.projector(x)
