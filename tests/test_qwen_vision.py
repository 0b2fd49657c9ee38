"""Qwen2.5-VL and Qwen3-VL vision towers loaded from Hugging Face folders equal transformers.

Tiny random ``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration``
models (eager attention, fp32) are saved with ``save_pretrained`` (transformers 5.25 writes
Qwen2.5-VL's tower as ``visual.*``, Qwen3-VL's as ``model.visual.*``) and our towers
loaded from the folder with :func:`load_hf_weights` and the tower's weight map.
One batch holds three images of different sizes (one square, two not), made by
transformers' own Qwen2-VL image processor (its PIL version: torchvision is not
installed), and one video of two temporal patches (four frames). The video processors
need torchvision, so the video's patches are random rows of the right shape
(``[2 * h * w, C * T * P * P]``). The merged tokens (and Qwen3-VL's DeepStack features),
the gradient of every parameter and of the pixels must agree within 1e-5 relative.
Qwen2.5-VL runs four layers, two of them windowed with several windows per frame (one
image's merge grid is a multiple of the window, the edge case where transformers pads an
empty window), two full; Qwen3-VL three layers with two DeepStack layers listed out of
order. Also: each folder rewritten in the other layout loads the same, a split into two pipeline
stages gives the same result, no operator of a forward and backward over 2048 patches
makes a tensor of ``S * S / 16`` elements, the config readers' defaults and refusals,
and the token count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mimotron.config.qwen_vl_vision import media_tokens, qwen3_vision_args, qwen25_vision_args
from mimotron.models.hf.qwen3_vision import Qwen3VisionTower
from mimotron.models.hf.qwen25_vision import Qwen25VisionTower, window_order
from mimotron.models.hf.weights import load_hf_weights
from tests.saved_bytes import LargestOutputs

transformers = pytest.importorskip("transformers")

PATCH, MERGE, TEMPORAL = 4, 2, 2
COMMON = {"hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 40,
          "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL}
QWEN25 = {**COMMON, "depth": 4, "window_size": 16, "fullatt_block_indexes": [1, 3]}
QWEN3 = {**COMMON, "depth": 3, "num_position_embeddings": 16,
         "deepstack_visual_indexes": [2, 0]}
TEXT = {"hidden_size": 40, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 64, "vocab_size": 100}
IMAGE_SIZES = ((24, 40), (32, 32), (16, 48))  # pixels (h, w): grids 6x10, 8x8, 4x12
VIDEO_GRID = (2, 8, 12)
REL = 1e-5


def _hf_model(family: str) -> nn.Module:
    """The tiny random model of ``family`` (seeded), eager attention, fp32."""
    torch.manual_seed(0)
    if family == "qwen25":
        config = transformers.Qwen2_5_VLConfig(
            vision_config=QWEN25, text_config={**TEXT, "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 5]}})
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        config = transformers.Qwen3VLConfig(vision_config=QWEN3,
                                            text_config={**TEXT, "head_dim": 20})
        model = transformers.Qwen3VLForConditionalGeneration(config)
    model.model.visual.set_attn_implementation("eager")
    return model.float().eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[nn.Module, Path]]:
    """family -> (transformers model, its save_pretrained folder)."""
    root = tmp_path_factory.mktemp("qwen_vl")
    out = {}
    for family in ("qwen25", "qwen3"):
        model = _hf_model(family)
        model.save_pretrained(root / family)
        out[family] = (model, root / family)
    return out


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, grid_thw)``: three processed images and one random-patch video."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SIZES]
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE,
                                         temporal_patch_size=TEMPORAL, min_pixels=64,
                                         max_pixels=64 * 64)
    processed = processor(images=images, return_tensors="pt")
    pixels, grid = processed["pixel_values"].float(), processed["image_grid_thw"]
    assert grid.tolist() == [[1, h // PATCH, w // PATCH] for h, w in IMAGE_SIZES]
    t, h, w = VIDEO_GRID
    torch.manual_seed(1)
    video = torch.randn(t * h * w, pixels.shape[1])
    return torch.cat([pixels, video]), torch.cat([grid, torch.tensor([VIDEO_GRID])])


def _tower(family: str, folder: Path, **kwargs: Any) -> nn.Module:
    cls = Qwen25VisionTower if family == "qwen25" else Qwen3VisionTower
    config = json.loads((folder / "config.json").read_text())
    tower = cls(**cls.from_hf_config(config), **kwargs)
    load_hf_weights(tower, folder, cls.weight_map)
    return tower


def _outputs(family: str, result: Any) -> list[torch.Tensor]:
    """Merged tokens, then the DeepStack features (Qwen3-VL)."""
    if family == "qwen25":
        return [result]
    merged, features = result
    return [merged, *features]


def _hf_outputs(family: str, hf: nn.Module, pixels: torch.Tensor, grid: torch.Tensor
                ) -> list[torch.Tensor]:
    out = hf.model.visual(pixels, grid_thw=grid)
    return [out.pooler_output, *(out.deepstack_features if family == "qwen3" else [])]


def _loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    """A fixed random weighting of every output element (one seed: equal on both sides)."""
    gen = torch.Generator().manual_seed(7)
    return sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outputs)


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.detach(), theirs.detach()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_outputs_and_every_gradient_equal_transformers(
        family: str, saved: dict[str, tuple[nn.Module, Path]],
        batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    hf, folder = saved[family]
    pixels, grid = batch
    tower = _tower(family, folder)
    ours_in, hf_in = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
    ours, theirs = _outputs(family, tower(ours_in, grid)), _hf_outputs(family, hf, hf_in, grid)
    tokens = sum(media_tokens(g, MERGE) for g in grid.tolist())
    assert len(ours) == len(theirs) == (1 if family == "qwen25" else 3)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape == (tokens, COMMON["out_hidden_size"])
        assert _relative(a, b) < REL
    hf.zero_grad()
    _loss(ours).backward()
    _loss(theirs).backward()
    assert _relative(ours_in.grad, hf_in.grad) < REL
    hf_params = dict(hf.model.visual.named_parameters())
    checked = set()
    for name, param in tower.named_parameters():
        hf_name = tower.weight_map.to_hf(name)
        assert param.grad is not None and hf_params[hf_name].grad is not None, name
        assert _relative(param.grad, hf_params[hf_name].grad) < REL, name
        checked.add(hf_name)
    assert checked == set(hf_params)  # every transformers parameter has its twin


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_hub_layout_and_two_pipeline_stages(
        family: str, saved: dict[str, tuple[nn.Module, Path]],
        batch: tuple[torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    """The other checkpoint layout loads the same weights; stages [0, 1] + [2, ...]
    chained give the whole tower's outputs.

    transformers 5.25's ``save_pretrained`` writes Qwen2.5-VL's tower as ``visual.*`` (the
    hub layout, its conversion reversed) and Qwen3-VL's as ``model.visual.*``; each
    folder is rewritten in the other layout (tower tensors only renamed).
    """
    _, folder = saved[family]
    tensors = load_file(folder / "model.safetensors")
    saved_as = "visual." if family == "qwen25" else "model.visual."
    other = "model.visual." if family == "qwen25" else "visual."
    assert any(n.startswith(saved_as) for n in tensors)
    renamed = {other + n.removeprefix(saved_as) if n.startswith(saved_as) else n: t
               for n, t in tensors.items()}
    assert not any(n.startswith(saved_as) for n in renamed)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(renamed, tmp_path / "model.safetensors")
    whole, other_layout = _tower(family, folder), _tower(family, tmp_path)
    for (name, a), (_, b) in zip(whole.state_dict().items(),
                                 other_layout.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    pixels, grid = batch
    depth = whole.num_layers
    first = _tower(family, folder, layer_ids=[0, 1], post_process=False)
    last = _tower(family, folder, layer_ids=list(range(2, depth)), pre_process=False)
    with torch.no_grad():
        expected = _outputs(family, whole(pixels, grid))
        if family == "qwen25":
            got = _outputs(family, last(first(pixels, grid), grid))
        else:
            hidden, features = first(pixels, grid)
            got = _outputs(family, last(hidden, grid, deepstack=features))
    for a, b in zip(got, expected, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen25", "qwen3"])
def test_no_tensor_of_s_by_s(family: str) -> None:
    """Eight 16 x 16-patch images (S = 2048): nothing of S * S / 16 elements, forward or
    backward (a frame's own scores, 256**2 per head, stay below it)."""
    torch.manual_seed(0)
    cls, args = ((Qwen25VisionTower, QWEN25) if family == "qwen25"
                 else (Qwen3VisionTower, QWEN3))
    tower = cls(**args)
    grid = torch.tensor([[1, 16, 16]] * 8)
    seq = int(grid.prod(-1).sum())
    pixels = torch.randn(seq, 3 * TEMPORAL * PATCH * PATCH, requires_grad=True)
    watch = LargestOutputs()
    with watch:
        _loss(_outputs(family, tower(pixels, grid))).backward()
    assert watch.largest[0] < seq * seq // 16, watch.largest
    with watch:  # the watcher sees one when there is one
        torch.zeros(seq, seq)
    assert watch.largest[0] >= seq * seq // 16


def test_windows_tile_each_frame_as_transformers_does(
        batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Our window order and lengths equal transformers' ``get_vision_window_index``."""
    from transformers.vision_utils import get_vision_window_index

    _, grid = batch
    order, lengths = window_order(grid.tolist(), MERGE, QWEN25["window_size"] // 8,
                                  torch.device("cpu"))
    index, cu = get_vision_window_index(grid, MERGE, QWEN25["window_size"], PATCH)
    assert torch.equal(order, index)
    assert [0, *np.cumsum(lengths).tolist()] == cu.tolist()
    assert len(lengths) > 2 * len(grid)  # several windows per frame


def test_config_readers_fill_transformers_defaults() -> None:
    """A bare vision config gets the defaults transformers' config classes have."""
    for reader, cls, model_type in (
            (qwen25_vision_args, transformers.Qwen2_5_VLVisionConfig, "qwen2_5_vl_vision"),
            (qwen3_vision_args, transformers.Qwen3VLVisionConfig, "qwen3_vl_vision")):
        args = reader({"model_type": model_type})
        reference = cls().to_dict()
        for key, value in args.items():
            expected = reference["rope_parameters"]["rope_theta"] if key == "rope_theta" \
                else reference[key]
            assert value == (list(expected) if isinstance(expected, tuple) else expected), key


@pytest.mark.parametrize(("change", "key"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ({"fullatt_block_indexes": [1, 9]}, "fullatt_block_indexes"),
    ({"window_size": 4}, "window_size"),
    ({"num_heads": 16}, "num_heads"),  # heads of width 2: no room for 2-D RoPE
])
def test_qwen25_reader_refuses_what_the_tower_lacks(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key) as info:
        qwen25_vision_args({"model_type": "qwen2_5_vl", "vision_config": {**QWEN25, **change}})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("change", "key"), [
    ({"num_position_embeddings": 15}, "num_position_embeddings"),
    ({"deepstack_visual_indexes": [0, 0]}, "deepstack_visual_indexes"),
    ({"hidden_act": "relu6"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
])
def test_qwen3_reader_refuses_what_the_tower_lacks(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key) as info:
        qwen3_vision_args({"model_type": "qwen3_vl", "vision_config": {**QWEN3, **change}})
    assert "\n" not in str(info.value)


def test_token_count_matches_the_towers_output(
        saved: dict[str, tuple[nn.Module, Path]],
        batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``media_tokens`` of each medium is the row count transformers' tower gives it."""
    pixels, grid = batch
    hf, _ = saved["qwen25"]
    start = 0
    with torch.no_grad():
        for row in grid.tolist():
            patches = row[0] * row[1] * row[2]
            out = hf.model.visual(pixels[start:start + patches], grid_thw=torch.tensor([row]))
            assert out.pooler_output.shape[0] == media_tokens(row, MERGE)
            start += patches
    assert [media_tokens(g, MERGE) for g in grid.tolist()] == [15, 16, 12, 48]
    with pytest.raises(ValueError, match="grid_thw"):
        media_tokens((1, 3, 4), MERGE)
