"""CLIP, SigLIP and Whisper encoder towers loaded from Hugging Face folders equal transformers.

Small random ``transformers`` models are saved with ``save_pretrained`` and loaded through
:func:`mimotron.models.hf.weights.load_hf_weights`; the same inputs must give the same
hidden states (the LLaVA feature layer, picked in ``transformers`` with
``output_hidden_states=True``) within 1e-5 relative, in one process, split into two
pipeline stages, and under TP 2 (where each rank must hold half of the sharded bytes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mimotron.forked_ranks import run_ranks
from mimotron.models.encoders import ModalitySubmodule, Projector
from mimotron.models.hf.clip import ClipVisionTower, SiglipVisionTower
from mimotron.models.hf.weights import load_hf_weights, to_hf_tensors
from mimotron.models.hf.whisper import WhisperEncoderTower
from mimotron.models.init import init_parameters_

transformers = pytest.importorskip("transformers")

VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "image_size": 16, "patch_size": 4, "num_channels": 3}
WHISPER = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 1, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
           "num_mel_bins": 16, "max_source_positions": 12, "vocab_size": 100, "pad_token_id": 1,
           "bos_token_id": 2, "eos_token_id": 3, "decoder_start_token_id": 4}
LM_HIDDEN = 48
SEED = 5


def _save(model: nn.Module, folder: Path, **kwargs: Any) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF folders: CLIP vision tower, a full CLIPModel (sharded), SigLIP, full Whisper."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {"clip": _save(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION)),
                         root / "clip")}
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 99, "bos_token_id": 0, "eos_token_id": 1,
            "pad_token_id": 1}
    full = transformers.CLIPModel(transformers.CLIPConfig(vision_config=VISION, text_config=text))
    out["clip_full"] = _save(full, root / "clip_full", max_shard_size="40KB")
    assert (out["clip_full"] / "model.safetensors.index.json").is_file()  # sharded
    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        **VISION, hidden_act="gelu_pytorch_tanh"))
    out["siglip"] = _save(siglip, root / "siglip")
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER))
    out["whisper"] = _save(whisper, root / "whisper")
    return out


def _hf(folder: Path) -> nn.Module:
    config = json.loads((folder / "config.json").read_text())
    cls = {"CLIPVisionModel": transformers.CLIPVisionModel, "CLIPModel": transformers.CLIPModel,
           "SiglipVisionModel": transformers.SiglipVisionModel,
           "WhisperForConditionalGeneration": transformers.WhisperForConditionalGeneration,
           }[config["architectures"][0]]
    return cls.from_pretrained(folder).eval()


def _tower(cls: type, folder: Path, **kwargs: Any) -> nn.Module:
    """Build, initialise (as a submodule with a projector) and load one tower instance."""
    args = cls.from_hf_config(json.loads((folder / "config.json").read_text()))
    tower = cls(**args, **kwargs)
    init_parameters_(tower, SEED, prefix="modality_submodules.x.encoder.")
    load_hf_weights(tower, folder, cls.weight_map)
    return tower.eval()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max() / want.abs().max())


def _images(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _mels(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 16, 24, generator=torch.Generator().manual_seed(2))


# (tower class, folder key, tower kwargs, HF reference of the outputs)
def _clip_ref(hf: nn.Module, x: torch.Tensor) -> torch.Tensor:
    model = hf.vision_model if hasattr(hf, "vision_model") else hf
    return model(pixel_values=x, output_hidden_states=True).hidden_states[-2][:, 1:]


def _siglip_ref(hf: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return hf(pixel_values=x, output_hidden_states=True).hidden_states[-1]


def _whisper_ref(hf: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return hf.model.encoder(x).last_hidden_state


LLAVA = {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
CASES = {
    "clip": (ClipVisionTower, "clip", LLAVA, _clip_ref, _images),
    "clip_full": (ClipVisionTower, "clip_full", LLAVA, _clip_ref, _images),
    "siglip": (SiglipVisionTower, "siglip", {}, _siglip_ref, _images),
    "whisper": (WhisperEncoderTower, "whisper", {}, _whisper_ref, _mels),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tower_equals_transformers(folders: dict[str, Path], case: str) -> None:
    cls, key, kwargs, ref, inputs = CASES[case]
    x = inputs()
    with torch.no_grad():
        want = ref(_hf(folders[key]), x)
        got = _tower(cls, folders[key], **kwargs)(x)
    assert _rel(got, want) < 1e-5


def test_feature_layer_builds_only_the_layers_it_uses(folders: dict[str, Path]) -> None:
    tower = _tower(ClipVisionTower, folders["clip"], **LLAVA)
    assert tower.num_layers == 2 and sorted(tower.layers) == ["0", "1"]
    assert tower.num_tokens == 16  # 4x4 patches, class token dropped
    full = _tower(ClipVisionTower, folders["clip"], vision_feature_select_strategy="full")
    assert full.num_layers == 3 and full.num_tokens == 17


def test_siglip_post_layernorm_is_last_hidden_state(folders: dict[str, Path]) -> None:
    x = _images()
    with torch.no_grad():
        want = _hf(folders["siglip"])(pixel_values=x).last_hidden_state
        got = _tower(SiglipVisionTower, folders["siglip"], post_layernorm=True)(x)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("mode", ["avg", "stack"])
def test_whisper_downsampling(folders: dict[str, Path], mode: str) -> None:
    x = _mels()
    with torch.no_grad():
        hidden = _whisper_ref(_hf(folders["whisper"]), x)  # [2, 12, 32]
        tower = _tower(WhisperEncoderTower, folders["whisper"], downsample_factor=3,
                       downsample_mode=mode)
        got = tower(x)
    grouped = hidden.reshape(2, 4, 3, 32)
    want = grouped.mean(2) if mode == "avg" else grouped.reshape(2, 4, 96)
    assert tower.num_tokens == 4 and tower.output_size == want.shape[-1]
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("case", ["clip_full", "siglip", "whisper"])
def test_two_pipeline_stages_equal_transformers(folders: dict[str, Path], case: str) -> None:
    cls, key, kwargs, ref, inputs = CASES[case]
    x = inputs()
    with torch.no_grad():
        want = ref(_hf(folders[key]), x)
        first = _tower(cls, folders[key], **kwargs, layer_ids=[0], post_process=False)
        whole = _tower(cls, folders[key], **kwargs)
        rest = [i for i in range(whole.num_layers) if i != 0]
        last = _tower(cls, folders[key], **kwargs, layer_ids=rest, pre_process=False)
        got = last(first(x))
    read = load_hf_weights(last, folders[key], cls.weight_map)
    assert not any(".layers.0." in n or n.startswith("layers.0.") or "embed" in n or "conv" in n
                   for n in read)
    assert not any(n.startswith(("patch_embed", "conv1", "pos_embed")) for n, _ in
                   last.named_parameters())
    assert _rel(got, want) < 1e-5


def _tp_rank(rank: int, world: int, cls: type, folder: Path, kwargs: dict, x: torch.Tensor,
             want: torch.Tensor) -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from mimotron.parallel.tensor_parallel import apply_tensor_parallel

    args = cls.from_hf_config(json.loads((folder / "config.json").read_text()))

    def submodule() -> ModalitySubmodule:
        tower = cls(**args, **kwargs)
        sub = ModalitySubmodule(tower, Projector(tower.output_size, LM_HIDDEN))
        return init_parameters_(sub, SEED, prefix="modality_submodules.x.")

    reference = submodule()
    load_hf_weights(reference.encoder, folder, cls.weight_map)
    sharded = submodule()
    apply_tensor_parallel(sharded, DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu"),
                          is_language=False)
    load_hf_weights(sharded.encoder, folder, cls.weight_map)
    local = full = 0
    for p in sharded.encoder.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            local += p.to_local().nbytes
            full += p.numel() * p.element_size()
    with torch.no_grad():
        sharded.eval(), reference.eval()
        return {"encoder": _rel(sharded.encoder(x), want),
                "submodule": _rel(sharded(x), reference(x)),
                "local": float(local), "full": float(full)}


@pytest.mark.parametrize("case", ["clip_full", "whisper"])
def test_tensor_parallel_two_ranks_equal_transformers(folders: dict[str, Path], case: str
                                                      ) -> None:
    cls, key, kwargs, ref, inputs = CASES[case]
    x = inputs()
    with torch.no_grad():
        want = ref(_hf(folders[key]), x)
    results = run_ranks(2, _tp_rank, cls, folders[key], kwargs, x, want, timeout_s=180)
    for r in results:
        assert r["encoder"] < 1e-5 and r["submodule"] < 1e-5
        assert r["full"] > 0 and r["local"] * 2 == r["full"]


def test_weight_names_round_trip_bitwise(folders: dict[str, Path]) -> None:
    folder = folders["clip"]
    tower = _tower(ClipVisionTower, folder, vision_feature_select_strategy="full",
                   post_layernorm=True)
    exported = to_hf_tensors(tower, ClipVisionTower.weight_map)
    original = load_file(str(folder / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert ClipVisionTower.weight_map.to_hf(ClipVisionTower.weight_map.from_hf(name)) == name
        assert torch.equal(exported[name], tensor), name


# ---- bad inputs -----------------------------------------------------------------------


def _edited_copy(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    name = "encoder.layers.1.self_attn.q_proj.weight"
    folder = _edited_copy(folders["clip"], tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensors: {name}"):
        _tower(ClipVisionTower, folder, **LLAVA)


def test_unexpected_tensor_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    name = "encoder.layers.0.self_attn.rotary.weight"
    folder = _edited_copy(folders["clip"], tmp_path / "u",
                          lambda t: t.update({name: torch.zeros(2)}))
    with pytest.raises(ValueError, match=rf"unexpected tensors: {name}"):
        _tower(ClipVisionTower, folder, **LLAVA)


def test_misshaped_tensor_is_named(folders: dict[str, Path], tmp_path: Path) -> None:
    name = "layers.0.fc1.weight"
    folder = _edited_copy(folders["whisper"], tmp_path / "s",
                          lambda t: t.update({f"model.encoder.{name}": torch.zeros(64, 31)}))
    with pytest.raises(ValueError, match=rf"wrong shapes: model\.encoder\.{name} \[64, 31\] "
                                         r"\(expected \[64, 32\]\)"):
        _tower(WhisperEncoderTower, folder)


def test_missing_folder_is_an_error_not_a_download(tmp_path: Path) -> None:
    tower = WhisperEncoderTower(16, 12, 32, 1, 4, 64)
    with pytest.raises(ValueError, match="not an existing directory.*never downloads"):
        load_hf_weights(tower, tmp_path / "openai/whisper-tiny", WhisperEncoderTower.weight_map)


@pytest.mark.parametrize(("cls", "config", "key"), [
    (ClipVisionTower, {"model_type": "clip_vision_model", "attention_dropout": 0.1},
     "attention_dropout"),
    (SiglipVisionTower, {"model_type": "siglip_vision_model", "hidden_act": "relu"}, "hidden_act"),
    (WhisperEncoderTower, {"model_type": "whisper", "encoder_layerdrop": 0.1},
     "encoder_layerdrop"),
    (WhisperEncoderTower, {"model_type": "clip"}, "model_type"),
])
def test_unsupported_config_names_the_key(cls: type, config: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        cls.from_hf_config(config)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer"),
    ({"vision_feature_layer": -5}, "vision_feature_layer"),
    ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
    ({"vision_feature_layer": -2, "post_layernorm": True}, "post_layernorm"),
])
def test_bad_feature_options_name_the_key(folders: dict[str, Path], kwargs: dict, key: str
                                          ) -> None:
    args = ClipVisionTower.from_hf_config(json.loads((folders["clip"] / "config.json").read_text()))
    with pytest.raises(ValueError, match=key):
        ClipVisionTower(**args, **kwargs)


def test_tensor_parallel_plan_names_only_existing_projections(folders: dict[str, Path]) -> None:
    from mimotron.parallel.tensor_parallel import tensor_parallel_plan

    args = WhisperEncoderTower.from_hf_config(json.loads(
        (folders["whisper"] / "config.json").read_text()))
    sub = ModalitySubmodule(WhisperEncoderTower(**args), Projector(32, LM_HIDDEN))
    plan = tensor_parallel_plan(sub, is_language=False)
    modules = dict(sub.named_modules())
    assert all(name in modules for name in plan)
    kinds = {name.split("layers.0.")[-1]: type(style).__name__ for name, style in plan.items()
             if "layers.0." in name}
    assert kinds == {"attn.wq": "ColwiseParallel", "attn.wk": "ColwiseParallel",
                     "attn.wv": "ColwiseParallel", "attn.wo": "RowwiseParallel",
                     "mlp.w1": "ColwiseParallel", "mlp.w2": "RowwiseParallel"}
