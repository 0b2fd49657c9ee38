"""Tiny Qwen2.5-VL / Qwen3-VL folders as users have them, and transformers' model as the
independent reference of a mimotron run of one.

:func:`save_qwen_folder` writes a random ``Qwen2_5_VLForConditionalGeneration`` /
``Qwen3VLForConditionalGeneration`` (transformers' config classes, eager vision
attention, parameters moved off their constant initial values) with ``save_pretrained``,
and the family's image processor at toy patch sizes. :data:`QWEN_FAMILIES` plugs the
family into :func:`tests.hf_vlm.hf_reference_run`: :func:`qwen_hf_name` maps a
``MimoModel`` parameter to transformers' (the towers' and the decoder's weight maps,
each tested on its own), :func:`qwen_hf_loss` is transformers' mean loss of a mimotron
batch in the native-resolution format (:mod:`mimotron.data.native_batch`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from mimotron.models.hf.llama import LLAMA_WEIGHTS
from tests.hf_vlm import HFFamily, parity_tables

VIDEO, VSTART, VEND = 121, 122, 123
HIDDEN, PATCH, MERGE, TEMPORAL = 48, 2, 2, 2
TEXT = {"vocab_size": 128, "hidden_size": HIDDEN, "intermediate_size": 80,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
VISION = {"hidden_size": 32, "num_heads": 2, "intermediate_size": 40,
          "out_hidden_size": HIDDEN, "spatial_merge_size": MERGE, "patch_size": PATCH,
          "temporal_patch_size": TEMPORAL}
FAMILIES = {
    "qwen2_5_vl": ("Qwen2_5_VL", {**TEXT, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2]}},
        {**VISION, "depth": 3, "window_size": 8, "fullatt_block_indexes": [1]}),
    "qwen3_vl": ("Qwen3VL", {**TEXT, "head_dim": 16, "rope_parameters": {
        "rope_type": "default", "rope_theta": 5e3, "mrope_section": [2, 3, 3],
        "mrope_interleaved": True}},
        {**VISION, "depth": 3, "deepstack_visual_indexes": [0, 2],
         "num_position_embeddings": 16}),
}
"""family -> (transformers class prefix, text_config, vision_config)."""


def save_qwen_folder(path: Path, family: str, image_id: int, max_pixels: int = 4096,
                     text_layers: int | None = None, deepstack: list[int] | None = None
                     ) -> torch.nn.Module:
    """Write a tiny random folder of ``family`` and return transformers' model of it (fp32,
    eval mode). ``image_id`` is its ``image_token_id``; ``text_layers``: the language
    model's layers (default 3); ``deepstack``: Qwen3-VL's ``deepstack_visual_indexes``
    (default ``[0, 2]``)."""
    import transformers

    prefix, text, vision = FAMILIES[family]
    layers = {} if text_layers is None else {"num_hidden_layers": text_layers}
    stack = {} if deepstack is None else {"deepstack_visual_indexes": deepstack}
    config = getattr(transformers, f"{prefix}Config")(
        text_config={**text, **layers}, vision_config={**vision, **stack}, image_token_id=image_id,
        video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    model.model.visual.set_attn_implementation("eager")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, min_pixels=16,
        max_pixels=max_pixels).save_pretrained(path)
    return model.float().eval()


def decoder_name(ours: str) -> str:
    """transformers' in-memory name of a decoder parameter (``model.language_model.*``)."""
    hf = LLAMA_WEIGHTS.to_hf(ours)
    return "model.language_model." + hf[len("model."):] if hf.startswith("model.") else hf


def qwen_hf_name(ours: str, model: Any) -> str:
    """The transformers parameter a ``MimoModel`` parameter of a Qwen-VL run equals."""
    from mimotron.models.hf.qwen_vl import QWEN_VL_TOWERS

    if ours.startswith("language_model."):
        return decoder_name(ours[len("language_model."):])
    head = "modality_submodules.vision.encoder."
    assert ours.startswith(head), ours
    tower = QWEN_VL_TOWERS[model.config.model_type]
    return "model.visual." + tower.weight_map.to_hf(ours[len(head):])


def qwen_hf_loss(model: Any, batch: dict[str, torch.Tensor], given_positions: bool = False
                 ) -> torch.Tensor:
    """transformers' mean loss of a native-resolution mimotron batch: the real patch rows
    of each present item (in text order), its grid, labels -100 off the loss mask (one
    position later: transformers shifts them back). ``given_positions``: the batch's 3-D
    positions instead of the model's own (a batch whose items include videos, which it
    holds at image placeholders: the data path's positions, tested against
    ``get_rope_index`` in ``tests/test_native_video.py``)."""
    tokens = batch["tokens"]
    labels = torch.full_like(tokens, -100)
    trained = batch["loss_mask"].bool()
    labels[:, 1:][trained[:, :-1]] = batch["labels"][:, :-1][trained[:, :-1]]
    present = batch["has_image"].bool()
    grids = batch["image_grid"][present]
    rows = [image[:int(g.prod())] for image, g in zip(batch["image"][present], grids,
                                                       strict=True)]
    pixels = torch.cat(rows) if rows else None
    kinds = (tokens == model.config.image_token_id).long()
    extra = {"position_ids": batch["position_ids"].transpose(0, 1)} if given_positions else {}
    out = model(input_ids=tokens, pixel_values=pixels,
                image_grid_thw=grids if rows else None, labels=labels, mm_token_type_ids=kinds,
                **extra)
    return out.loss


def _load(path: str) -> Any:
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model.model.visual.set_attn_implementation("eager")
    return model


QWEN_FAMILY = HFFamily(_load, qwen_hf_name, qwen_hf_loss)
QWEN_VIDEO_FAMILY = HFFamily(_load, qwen_hf_name, partial(qwen_hf_loss, given_positions=True))
"""A Qwen-VL folder in :func:`tests.hf_vlm.hf_reference_run`."""


def write_qwen_config(root: Path, folder: Path, max_pixels: int, iters: int) -> Path:
    """``root/qwen.toml``: ``folder`` trained on mock native-resolution samples (fp32, a
    real learning rate, batches of 8 in micro-batches of 4, images up to ``max_pixels``)."""
    path = root / "qwen.toml"
    path.write_text(f"""
hf_path = "{folder}"

[modules.vision]
max_pixels = {max_pixels}

[data]
dataset = "mock"
seq_length = 40
mock_num_samples = 96

{parity_tables(iters, seed=3, lr=3e-3)}
[log]
dir = "{root / 'run'}"
""")
    return path


def write_llava_config(root: Path, folder: Path, data: Path, name: str, *, max_pixels: int,
                       media: str = "img", seq_length: int = 128, max_images: int = 1,
                       packing: bool = False, train_iters: int = 0) -> Path:
    """``root/<name>.toml``: ``folder`` on the LLaVA file ``data`` (media under
    ``root/<media>``), images up to ``max_pixels``, batches of 2 in micro-batches of 1.
    ``train_iters`` > 0: a training run of that many iterations (3/4 of the samples for
    training, seed 1, learning rate 3e-3, no evaluation)."""
    path = root / f"{name}.toml"
    path.write_text(f"""
hf_path = "{folder}"

[modules.vision]
max_pixels = {max_pixels}

[data]
dataset = "llava"
path = "{data}"
root = "{root / media}"
seq_length = {seq_length}
max_images_per_sample = {max_images}
packing = {str(packing).lower()}
index_dir = "{root / name / 'index'}"
train_fraction = 0.5

[train]
global_batch_size = 2
micro_batch_size = 1
precision = "fp32"

[log]
dir = "{root / name}"
""")
    if train_iters:
        path.write_text(path.read_text()
                        .replace("train_fraction = 0.5", "train_fraction = 0.75")
                        .replace("[train]", f"[train]\niters = {train_iters}\nseed = 1")
                        + "\n[optimizer]\nlr = 3e-3\n\n[eval]\ninterval = 1000\n")
    return path
