"""A whole Qwen2.5-VL or Qwen3-VL model from its one folder, in one process.

:class:`QwenVLModel` strings mimotron's parts together as the family's
``...ForConditionalGeneration`` does, so the parts are checked together against
``transformers`` (tests/test_qwen_vl_model.py) before the engine carries them across
ranks:

1. the vision tower (:class:`~mimotron.models.hf.qwen25_vision.Qwen25VisionTower` or
   :class:`~mimotron.models.hf.qwen3_vision.Qwen3VisionTower`, its merger included)
   encodes every image and video of the batch at its native resolution, as one flat
   sequence of patches (``pixel_values`` / ``pixel_values_videos`` and their
   ``grid_thw``, as the family's processor writes them);
2. the merged tokens replace the image (video) placeholder tokens, in order;
3. the 3-D rotary positions are computed from the token ids and the grids
   (:func:`~mimotron.data.mrope_positions.mrope_positions`);
4. the decoder (:class:`~mimotron.models.language.LanguageModel` with M-RoPE) runs on
   them; for Qwen3-VL its first layers add the tower's DeepStack features at the visual
   positions (image and video rows in the order of those positions).

The engine does not run this class: it is the one-process composition of the parts
(what ``MimoModel.forward`` is for the other families).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from mimotron.config.hf_folder import read_hf_config
from mimotron.config.hf_specs import LlamaFamilySpec
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.models.hf.llama import check_llama_folder, decoder_weight_map
from mimotron.models.hf.qwen3_vision import Qwen3VisionTower
from mimotron.models.hf.qwen25_vision import Qwen25VisionTower
from mimotron.models.hf.weights import load_hf_weights
from mimotron.models.language import LanguageModel

__all__ = ["QWEN_VL_TOWERS", "QwenVLModel"]

QWEN_VL_TOWERS: dict[str, type[nn.Module]] = {"qwen2_5_vl": Qwen25VisionTower,
                                              "qwen3_vl": Qwen3VisionTower}
"""``model_type`` -> its vision tower class."""


class QwenVLModel(nn.Module):
    """Vision tower + M-RoPE decoder of one Qwen-VL folder (see the module docstring).

    Args:
        tower: the family's vision tower (merger included).
        language: the decoder, built with the folder's M-RoPE options.
        rule: the family's position layout (placeholder ids, merge size, time scale).
    """

    def __init__(self, tower: nn.Module, language: LanguageModel, rule: MRopeRule) -> None:
        super().__init__()
        self.visual = tower
        self.language_model = language
        self.rule = rule

    @classmethod
    def from_folder(cls, path: str | Path, max_seq_len: int | None = None) -> QwenVLModel:
        """Build the model of a ``qwen2_5_vl`` / ``qwen3_vl`` folder and load its weights.

        Args:
            path: the local folder (``config.json`` + safetensors).
            max_seq_len: longest sequence (``None``: the config's context length).

        Raises:
            ValueError: another ``model_type``, an option mimotron does not implement, or
                a checkpoint that does not match (tensors named).
        """
        config = read_hf_config(path)
        model_type = config.get("model_type")
        if model_type not in QWEN_VL_TOWERS:
            raise ValueError(f"config.json model_type={model_type!r} is not a Qwen-VL model; "
                             f"expected one of {sorted(QWEN_VL_TOWERS)}")
        tower_cls: Any = QWEN_VL_TOWERS[model_type]
        tower = tower_cls(**tower_cls.from_hf_config(config))
        load_hf_weights(tower, path, tower_cls.weight_map)
        spec = LlamaFamilySpec.from_hf_config(config)
        language = LanguageModel(**spec.model_kwargs(max_seq_len))
        weight_map = decoder_weight_map(path, spec)
        check_llama_folder(path, spec, weight_map)
        if spec.tie_word_embeddings:
            language.tie_weights()
        load_hf_weights(language, path, weight_map)
        return cls(tower, language, MRopeRule.from_hf_config(config))

    def _encode(self, pixels: torch.Tensor | None, grid: torch.Tensor | None
                ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Merged tokens and DeepStack features (Qwen3-VL) of one kind of media."""
        if pixels is None or grid is None:
            return None, []
        grid = grid.cpu()  # host arithmetic: no read-back inside the tower
        out = self.visual(pixels, grid)
        return (out, []) if isinstance(out, torch.Tensor) else (out[0], list(out[1]))

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None,
                pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None,
                second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, S, vocab]`` of token rows with their images and videos.

        Args:
            input_ids: ``[B, S]``; each image (video) is a run of the family's image
                (video) token, as long as its merged tokens.
            pixel_values, image_grid_thw: every image's patches and grid, in order.
            pixel_values_videos, video_grid_thw: the same for videos.
            second_per_grid_ts: Qwen2.5-VL: seconds per temporal patch of each video.

        Raises:
            ValueError: placeholder runs that do not match the media.
        """
        lm = self.language_model
        hidden = lm.embed_tokens(input_ids)
        image, image_stack = self._encode(pixel_values, image_grid_thw)
        video, video_stack = self._encode(pixel_values_videos, video_grid_thw)
        image_mask = input_ids == self.rule.image_token_id
        video_mask = input_ids == self.rule.video_token_id
        for mask, rows, kind in ((image_mask, image, "image"), (video_mask, video, "video")):
            count = int(mask.sum())
            if count != (0 if rows is None else rows.shape[0]):
                raise ValueError(f"{count} {kind} placeholder tokens for "
                                 f"{0 if rows is None else rows.shape[0]} {kind} tokens")
            if rows is not None:
                hidden = hidden.masked_scatter(mask.unsqueeze(-1), rows.to(hidden.dtype))
        positions, _ = mrope_positions(input_ids, self.rule, image_grid_thw, video_grid_thw,
                                       second_per_grid_ts=second_per_grid_ts)
        deepstack, visual = _deepstack(image_mask, video_mask, image_stack, video_stack)
        return lm(hidden, position_ids=positions, deepstack=deepstack, visual_mask=visual)


def _deepstack(image_mask: torch.Tensor, video_mask: torch.Tensor,
               image_stack: list[torch.Tensor], video_stack: list[torch.Tensor]
               ) -> tuple[list[torch.Tensor] | None, torch.Tensor | None]:
    """Per DeepStack layer, the features of every visual position in row-major order."""
    if not image_stack and not video_stack:
        return None, None
    visual = image_mask | video_mask
    is_image = image_mask[visual]  # which visual rows are images, in row-major order
    layers = []
    for i in range(max(len(image_stack), len(video_stack))):
        like = (image_stack or video_stack)[i]
        rows = like.new_zeros(int(visual.sum()), like.shape[-1])
        if image_stack:
            rows = rows.masked_scatter(is_image.unsqueeze(-1), image_stack[i])
        if video_stack:
            rows = rows.masked_scatter((~is_image).unsqueeze(-1), video_stack[i])
        layers.append(rows)
    return layers, visual
