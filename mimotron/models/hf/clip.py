"""CLIP and SigLIP vision towers (``CLIPVisionModel``, ``SiglipVisionModel``) as our modules.

Both are ViTs with pre-LayerNorm encoder layers with biases; CLIP adds a class token and
a LayerNorm before the encoder, SigLIP has a bias on its patch convolution. The output is
chosen as LLaVA does: ``vision_feature_layer`` picks a hidden state (``-1`` = the last
layer's output, ``-2`` = the one before; ``0`` would be the embeddings), which is never
post-layernormed, and ``vision_feature_select_strategy="default"`` drops the class token
(``"full"`` keeps every token). Layers past the chosen one are not built at all, so the
tower's ``num_layers`` is the number of layers it uses and its checkpoint's later layers
are ignored. ``post_layernorm=True`` applies the final LayerNorm (SigLIP's
``last_hidden_state``); it needs the last layer's output.

Layers sit in ``self.layers`` keyed by global index (``layer_ids`` picks a pipeline
stage's); ``pre_process`` holds the embeddings, ``post_process`` the output selection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mimotron.config.hf_specs import check_activation, clip_tower_args, siglip_tower_args
from mimotron.config.hf_specs import used_layers as used_layers
from mimotron.models.blocks import chunk_modules, is_last_chunk, make_layers, to_residual_dtype
from mimotron.models.hf.layers import CastLayerNorm, PreLNEncoderLayer
from mimotron.models.hf.weights import WeightMap

STRATEGIES = ("default", "full")

_LAYER_RULES = (
    ("layers.{i}.attn_norm.", "encoder.layers.{i}.layer_norm1."),
    ("layers.{i}.attn.wq.", "encoder.layers.{i}.self_attn.q_proj."),
    ("layers.{i}.attn.wk.", "encoder.layers.{i}.self_attn.k_proj."),
    ("layers.{i}.attn.wv.", "encoder.layers.{i}.self_attn.v_proj."),
    ("layers.{i}.attn.wo.", "encoder.layers.{i}.self_attn.out_proj."),
    ("layers.{i}.mlp_norm.", "encoder.layers.{i}.layer_norm2."),
    ("layers.{i}.mlp.w1.", "encoder.layers.{i}.mlp.fc1."),
    ("layers.{i}.mlp.w2.", "encoder.layers.{i}.mlp.fc2."),
)
_EMBED_RULES = (
    ("patch_embed.", "embeddings.patch_embedding."),
    ("class_embedding", "embeddings.class_embedding"),
    ("pos_embed", "embeddings.position_embedding.weight"),
    ("pre_norm.", "pre_layrnorm."),
    ("final_norm.", "post_layernorm."),
)
# What a full CLIPModel / SiglipModel holds besides the vision tower, and SigLIP's
# attention-pooling head: not ours, so not "unexpected".
_NOT_VISION = (r"text_model\.", r"logit_scale$", r"logit_bias$", r"text_projection\.",
               r"visual_projection\.")

CLIP_WEIGHTS = WeightMap(
    rules=_EMBED_RULES + _LAYER_RULES,
    prefixes=("vision_model.", ""),
    ignored=_NOT_VISION,
    reshaped=frozenset({"class_embedding"}),
)
SIGLIP_WEIGHTS = WeightMap(
    rules=_EMBED_RULES + _LAYER_RULES,
    prefixes=("vision_model.", ""),
    ignored=(*_NOT_VISION, r"(vision_model\.)?head\."),
)

class ViTTower(nn.Module):
    """A CLIP- or SigLIP-style vision tower: ``[n, C, H, W] -> [n, tokens, hidden]``.

    Args:
        image_size: input height and width.
        patch_size: patch side; must divide ``image_size``.
        num_channels: image channels.
        hidden_size: model width.
        intermediate_size: MLP inner width.
        num_hidden_layers: layers of the checkpoint's tower.
        num_attention_heads: attention heads.
        hidden_act: MLP activation (``quick_gelu``, ``gelu``, ``gelu_pytorch_tanh``, ...).
        layer_norm_eps: LayerNorm epsilon.
        class_token: prepend a learned class token (CLIP) and a pre-encoder LayerNorm.
        patch_bias: the patch convolution has a bias (SigLIP).
        vision_feature_layer: which hidden state to output (see module docs).
        vision_feature_select_strategy: ``"default"`` drops the class token, ``"full"``
            keeps all tokens.
        post_layernorm: apply the final LayerNorm to the output.
        layer_ids: global layer indices this instance holds (``None`` = all used).
        pre_process: hold the embeddings (first pipeline stage).
        post_process: produce the selected output (last pipeline stage).

    Raises:
        ValueError: inconsistent sizes or options.
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_channels: int,
        hidden_size: int,
        intermediate_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        hidden_act: str,
        layer_norm_eps: float,
        class_token: bool,
        patch_bias: bool,
        vision_feature_layer: int = -1,
        vision_feature_select_strategy: str = "full",
        post_layernorm: bool = False,
        layer_ids: list[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        _check_options(image_size, patch_size, class_token, num_hidden_layers,
                       vision_feature_layer, vision_feature_select_strategy, post_layernorm)
        check_activation("hidden_act", hidden_act)
        self.image_size = image_size
        self.hidden_size = self.output_size = hidden_size
        self.num_layers = used_layers(num_hidden_layers, vision_feature_layer)
        self.pre_process, self.post_process = pre_process, post_process
        self.drop_class_token = vision_feature_select_strategy == "default"
        num_patches = (image_size // patch_size) ** 2
        self.num_positions = num_patches + int(class_token)
        self.num_tokens = self.num_positions - int(self.drop_class_token)
        if pre_process:
            self.patch_embed = nn.Conv2d(num_channels, hidden_size, patch_size, stride=patch_size,
                                         bias=patch_bias)
            self.class_embedding = (nn.Parameter(torch.zeros(1, hidden_size))
                                    if class_token else None)
            self.pos_embed = nn.Parameter(torch.zeros(self.num_positions, hidden_size))
            self.pre_norm = CastLayerNorm(hidden_size, eps=layer_norm_eps) if class_token else None
        self.layers = make_layers(
            layer_ids, self.num_layers, build=PreLNEncoderLayer, hidden=hidden_size,
            num_heads=num_attention_heads, ffn_hidden=intermediate_size, activation=hidden_act,
            eps=layer_norm_eps,
        )
        self.final_norm = (CastLayerNorm(hidden_size, eps=layer_norm_eps)
                           if post_process and post_layernorm else None)
        # Interleaved 1F1B: global layer ids of each model chunk held (LanguageModel's).
        self.layer_chunks: list[list[int]] | None = None
        # The residual stream in fp32 under autocast (train.fp32_residual_connection).
        self.fp32_residual = False

    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """Patch, class and position embeddings (plus CLIP's pre-LayerNorm)."""
        if pixels.dim() != 4 or tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"the vision tower expects [n, C, {self.image_size}, {self.image_size}] images, "
                f"got input of shape {tuple(pixels.shape)}"
            )
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.pos_embed
        return x if self.pre_norm is None else self.pre_norm(x)

    def forward(self, x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """Images (first stage) or hidden states -> hidden states / selected features.

        Args:
            x: ``[n, C, H, W]`` if ``pre_process`` (and ``chunk`` is 0 or ``None``), else
                ``[n, num_positions, hidden]``.
            chunk: interleaved pipelines only: run model chunk ``chunk`` of
                ``layer_chunks``; ``None`` = every layer.

        Returns:
            ``[n, num_tokens, hidden]`` on the last stage (last chunk), else
            ``[n, num_positions, hidden]``.
        """
        if self.pre_process and not chunk:
            x = to_residual_dtype(self.embed(x), self.fp32_residual).contiguous()
        for layer in chunk_modules(self.layers, self.layer_chunks, chunk):
            x = layer(x)
        if not self.post_process or not is_last_chunk(self.layer_chunks, chunk):
            return x
        if self.final_norm is not None:
            x = self.final_norm(x)
        return x[:, 1:] if self.drop_class_token else x


def _check_options(image_size: int, patch_size: int, class_token: bool, num_hidden_layers: int,
                   feature_layer: int, strategy: str, post_layernorm: bool) -> None:
    if patch_size < 1 or image_size % patch_size:
        raise ValueError(f"patch_size={patch_size} is invalid: expected a divisor of "
                         f"image_size={image_size}")
    if strategy not in STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is invalid; expected "
                         f"one of {list(STRATEGIES)}")
    if strategy == "default" and not class_token:
        raise ValueError("vision_feature_select_strategy='default' drops the class token, "
                         "but this tower has none; use 'full'")
    if post_layernorm and used_layers(num_hidden_layers, feature_layer) != num_hidden_layers:
        raise ValueError(f"post_layernorm=True needs the last layer's output, but "
                         f"vision_feature_layer={feature_layer}")


class ClipVisionTower(ViTTower):
    """The vision tower of CLIP (``CLIPVisionModel``); see :class:`ViTTower` for arguments
    other than the architecture, which :meth:`from_hf_config` reads from ``config.json``."""

    weight_map = CLIP_WEIGHTS

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(class_token=True, patch_bias=False, **kwargs)

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a ``CLIPVisionConfig`` or ``CLIPConfig`` dict.

        Raises:
            ValueError: another model type, or an option the tower does not implement.
        """
        return clip_tower_args(config)


class SiglipVisionTower(ViTTower):
    """The vision tower of SigLIP (``SiglipVisionModel``, without its pooling head); see
    :class:`ViTTower` for arguments other than the architecture."""

    weight_map = SIGLIP_WEIGHTS

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(class_token=False, patch_bias=True, **kwargs)

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
        """Constructor arguments from a ``SiglipVisionConfig`` or ``SiglipConfig`` dict.

        Raises:
            ValueError: another model type, or an option the tower does not implement.
        """
        return siglip_tower_args(config)
