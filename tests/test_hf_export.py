"""``mimotron export --format hf``: checkpoint modules back to Hugging Face folders.

Small random ``transformers`` models are saved with ``save_pretrained``, loaded into our
modules with the family loaders, assembled into a ``MimoModel`` and written as a real
checkpoint by the project's writer (``dcp.save``, manifest, ``latest``; one gloo rank, or
two TP ranks). The export must give back the original tensors bit for bit (no training
in between), and after a simulated training step a folder that ``from_pretrained``
loads without missing or unexpected keys and whose forward equals ours (1e-5 relative).

The run config in the checkpoint is written by hand here: the training wiring of
``modules.<m>.hf_path`` lands separately; export reads only ``hf_path`` and
``data.tokenizer`` from it.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from mimotron.checkpoint.export import read_full_model
from mimotron.checkpoint.hf_export import (
    RUN_CONFIG_FILE,
    VOCAB_SIZE_UNPADDED,
    export_hf_checkpoint,
    export_hf_module,
)
from mimotron.checkpoint.save import _write_checkpoint
from mimotron.checkpoint.state import META, model_state
from mimotron.cli.main import main as cli_main
from mimotron.data.hf_tokenizer import HFTokenizer, resize_embedding_rows
from mimotron.forked_ranks import run_ranks
from mimotron.models.encoders import ModalitySubmodule, Projector
from mimotron.models.hf.clip import ClipVisionTower
from mimotron.models.hf.llama import LlamaFamilySpec, build_hf_language_model
from mimotron.models.hf.weights import load_hf_weights
from mimotron.models.hf.whisper import WhisperEncoderTower
from mimotron.models.language import LanguageModel
from mimotron.models.mimo import MimoModel
from tests.hf_data import WHISPER_KWARGS, folder_tensors, make_tokenizer

transformers = pytest.importorskip("transformers")

HIDDEN = 32
LM = {"hidden_size": HIDDEN, "intermediate_size": 48, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "image_size": 16, "patch_size": 4, "num_channels": 3}
LLAVA = {"vision_feature_layer": -2, "vision_feature_select_strategy": "default"}
WHISPER = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 1, "encoder_attention_heads": 4,
           "decoder_attention_heads": 4, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
           "num_mel_bins": 16, "max_source_positions": 50, "vocab_size": 100, "pad_token_id": 1,
           "bos_token_id": 2, "eos_token_id": 3, "decoder_start_token_id": 4}
ITERATION = 7


def _perturbed(model: nn.Module) -> nn.Module:
    """Biases and norm scales away from their constant init, so a mix-up shows."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """HF folders: Llama (untied), Qwen2 (tied, tokenizer-sized vocab), CLIP, Whisper."""
    root = tmp_path_factory.mktemp("hf")
    out = {"tokenizer": make_tokenizer(root / "tokenizer")}
    base_vocab = HFTokenizer(out["tokenizer"], modalities=()).vocab_size
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LM, vocab_size=96))
    qwen = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **LM, vocab_size=base_vocab, tie_word_embeddings=True))
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**VISION))
    whisper = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(**WHISPER))
    for name, model in (("llama", llama), ("qwen", qwen), ("clip", clip), ("whisper", whisper)):
        _perturbed(model).save_pretrained(root / name)
        out[name] = root / name
    transformers.WhisperFeatureExtractor(**WHISPER_KWARGS).save_pretrained(out["whisper"])
    return out


def _tower(cls: type, folder: Path, **kwargs: Any) -> nn.Module:
    tower = cls(**cls.from_hf_config(json.loads((folder / "config.json").read_text())), **kwargs)
    load_hf_weights(tower, folder, cls.weight_map)
    return tower.eval()


def _mimo(language: LanguageModel | None, towers: dict[str, nn.Module]) -> MimoModel:
    torch.manual_seed(1)
    subs = {n: ModalitySubmodule(t, Projector(t.output_size, HIDDEN)) for n, t in towers.items()}
    modality = {"vision": "image", "audio": "audio"}
    return MimoModel(subs, language, {n: i for i, n in enumerate(towers)},
                     {n: modality[n] for n in towers}).eval()


def _run_config(paths: dict[str, Path], tokenizer: Path | None = None) -> dict[str, Any]:
    # The kinds, as training records them (cfg.to_dict()); the placeholders follow them.
    kind = {"language": "language", "vision": "vit", "audio": "audio"}
    modules = {n: {"kind": kind[n], "hf_path": str(p)} for n, p in paths.items()}
    return {"modules": modules, "data": {"tokenizer": str(tokenizer) if tokenizer else None}}


def _save(rank: int, world: int, root: Path, model: nn.Module, meta: dict[str, Any]) -> None:
    """One rank's share of a checkpoint, through the project's writer (DCP + manifest)."""
    state: dict[str, Any] = model_state(model)
    state[META] = json.dumps({"iteration": ITERATION, **meta})
    _write_checkpoint(state, root, ITERATION, {"world_size": world}, None, False, None,
                      time.perf_counter())


def _checkpoint(root: Path, model: nn.Module, meta: dict[str, Any]) -> Path:
    run_ranks(1, _save, root, model, meta)
    return root


def _assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    different = [n for n in want if got[n].dtype != want[n].dtype
                 or not torch.equal(got[n], want[n])]
    assert not different, different


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()), err


@pytest.fixture(scope="module")
def round_trip(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of Llama + CLIP (LLaVA layer -2) + Whisper as loaded (no step)."""
    paths = {"language": folders["llama"], "vision": folders["clip"],
             "audio": folders["whisper"]}
    model = _mimo(build_hf_language_model(folders["llama"]).eval(),
                  {"vision": _tower(ClipVisionTower, folders["clip"], **LLAVA),
                   "audio": _tower(WhisperEncoderTower, folders["whisper"])})
    root = tmp_path_factory.mktemp("ckpt") / "ckpt"
    return _checkpoint(root, model, {"config": _run_config(paths)})


def test_round_trip_gives_the_original_tensors_bitwise(round_trip, folders, tmp_path):
    out = tmp_path / "out"
    written = export_hf_checkpoint(round_trip, out)
    for module, key in (("language", "llama"), ("vision", "clip"), ("audio", "whisper")):
        assert written[module] == out / module
        # Names, values and dtypes; CLIP's unbuilt last layer and Whisper's decoder and
        # fixed positions come from the original folder.
        _assert_bitwise(folder_tensors(out / module), folder_tensors(folders[key]))
        assert (out / module / "config.json").read_bytes() == \
            (folders[key] / "config.json").read_bytes()
    assert (out / "language" / "generation_config.json").is_file()
    assert (out / "audio" / "preprocessor_config.json").is_file()
    # The projectors keep the default export's form, under the module's names.
    tensors, _ = read_full_model(round_trip)
    for module in ("vision", "audio"):
        with safe_open(out / f"{module}.safetensors", framework="pt") as handle:
            got = {n: handle.get_tensor(n) for n in handle.keys()}  # noqa: SIM118
        prefix = f"modality_submodules.{module}."
        want = {n[len(prefix):]: t for n, t in tensors.items()
                if n.startswith(prefix + "projector.")}
        _assert_bitwise(got, want)
    assert json.loads((out / RUN_CONFIG_FILE).read_text())["modules"]["vision"]["hf_path"] == \
        str(folders["clip"])


def _save_tp(rank: int, world: int, root: Path, folder: Path, meta: dict[str, Any]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    language = build_hf_language_model(folder, tp_mesh=init_device_mesh("cpu", (world,)))
    _save(rank, world, root, MimoModel({}, language, {}, {}), meta)


def test_round_trip_from_a_tp2_checkpoint_with_tied_embeddings(folders, tmp_path):
    """Two TP ranks write their vocabulary / head shards; export writes no lm_head."""
    meta = {"config": _run_config({"language": folders["qwen"]})}
    run_ranks(2, _save_tp, tmp_path / "ckpt", folders["qwen"], meta)
    export_hf_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    got = folder_tensors(tmp_path / "out" / "language")
    assert "lm_head.weight" not in got
    _assert_bitwise(got, folder_tensors(folders["qwen"]))


def test_padding_rows_beyond_vocab_size_unpadded_are_dropped(folders, tmp_path):
    language = build_hf_language_model(folders["llama"])
    state = {n: t.detach().clone() for n, t in language.state_dict().items()}
    for name in ("embed.weight", "output.weight"):
        state[name] = torch.cat([state[name], torch.full((8, HIDDEN), 9.0)])
    export_hf_module(state, folders["llama"], tmp_path / "lm", module="language", vocab_size=96)
    _assert_bitwise(folder_tensors(tmp_path / "lm"), folder_tensors(folders["llama"]))
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["vocab_size"] == 96


def _resized(folder: Path, vocab: int, padded: int) -> LanguageModel:
    """The decoder with placeholder rows added (as training adds them) and padding."""
    loaded = build_hf_language_model(folder)
    spec = LlamaFamilySpec.from_hf_config(json.loads((folder / "config.json").read_text()))
    model = LanguageModel(**spec.replace(vocab_size=padded).model_kwargs())
    state = dict(loaded.state_dict())
    grown = resize_embedding_rows(state["embed.weight"], vocab, seed=3)
    state["embed.weight"] = torch.cat([grown, torch.zeros(padded - vocab, HIDDEN)])
    state["output.weight"] = state["embed.weight"]
    model.load_state_dict(state)
    return model


def test_trained_export_loads_in_transformers_with_the_same_forward(folders, tmp_path):
    """After a (simulated) training step, with <image>/<audio> added and vocab padding."""
    tokenizer = HFTokenizer(folders["tokenizer"], modalities=("image", "audio"))
    vocab = tokenizer.vocab_size
    torch.manual_seed(2)
    language = _perturbed(_resized(folders["qwen"], vocab, padded=-(-vocab // 8) * 8 + 8))
    towers = {"vision": _perturbed(_tower(ClipVisionTower, folders["clip"], **LLAVA)),
              "audio": _perturbed(_tower(WhisperEncoderTower, folders["whisper"]))}
    paths = {"language": folders["qwen"], "vision": folders["clip"], "audio": folders["whisper"]}
    meta = {"config": _run_config(paths, folders["tokenizer"])}
    _checkpoint(tmp_path / "ckpt", _mimo(language, towers), meta)
    out = tmp_path / "out"
    assert cli_main(["export", "--format", "hf", str(tmp_path / "ckpt"), str(out)]) == 0

    config = json.loads((out / "language" / "config.json").read_text())
    assert config["vocab_size"] == vocab  # placeholders in, padding out
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out / "language",
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.arange(2 * 12).view(2, 12) * 29 % vocab
    tokens[0, 3] = tokenizer.placeholder_id("image")
    with torch.no_grad():
        ours = language(language.embed_tokens(tokens))[..., :vocab]
        _assert_close(hf.eval()(tokens).logits, ours)
    exported = transformers.AutoTokenizer.from_pretrained(out / "language")
    assert len(exported) == vocab
    assert exported.encode("<image>", add_special_tokens=False) == \
        [tokenizer.placeholder_id("image")]

    clip, info = transformers.CLIPVisionModel.from_pretrained(out / "vision",
                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = clip.eval()(pixel_values=images, output_hidden_states=True).hidden_states[-2]
        _assert_close(towers["vision"](images), want[:, 1:])
    whisper, info = transformers.WhisperForConditionalGeneration.from_pretrained(
        out / "audio", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    mels = torch.randn(2, 16, 100, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        _assert_close(towers["audio"](mels), whisper.eval().model.encoder(mels).last_hidden_state)


def test_export_errors_are_one_line(round_trip, folders, tmp_path, capsys):
    """Unwritable output, a hf_path folder gone since training, no hf_path at all."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert cli_main(["export", "--format", "hf", str(round_trip), str(blocker / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(blocker) in err and "not a directory" in err, err

    gone = tmp_path / "clip_copy"
    shutil.copytree(folders["clip"], gone)
    model = _mimo(None, {"vision": _tower(ClipVisionTower, gone, **LLAVA)})
    ckpt = _checkpoint(tmp_path / "ckpt", model, {"config": _run_config({"vision": gone})})
    shutil.rmtree(gone)
    assert cli_main(["export", "--format", "hf", str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"mimotron export: modules.vision.hf_path={str(gone)!r} is not an "
                          "existing directory"), err
    assert not (tmp_path / "out" / "vision").exists()  # refused before any tensor is read

    meta = {"config": {"modules": {"vision": {"kind": "vit"}}, "data": {}}}
    plain = _checkpoint(tmp_path / "plain", _mimo(None, {"vision": _tower(
        ClipVisionTower, folders["clip"], **LLAVA)}), meta)
    assert cli_main(["export", "--format", "hf", str(plain), str(tmp_path / "out2")]) == 2
    assert "no module of this checkpoint has an hf_path" in capsys.readouterr().err
    # The default format is unchanged: <module>.safetensors and the run config.
    assert cli_main(["export", str(round_trip), str(tmp_path / "default")]) == 0
    names = sorted(p.name for p in (tmp_path / "default").iterdir())
    assert names == [".mimotron-export.json", "audio.safetensors", "config.json",
                     "language.safetensors", "vision.safetensors"]


def test_vocab_size_unpadded_in_the_meta_wins(folders, tmp_path):
    """The meta key written by training is the real vocabulary (no tokenizer needed)."""
    base = json.loads((folders["qwen"] / "config.json").read_text())["vocab_size"]
    language = _resized(folders["qwen"], base + 3, padded=base + 16)
    meta = {"config": _run_config({"language": folders["qwen"]}), VOCAB_SIZE_UNPADDED: base + 3}
    _checkpoint(tmp_path / "ckpt", MimoModel({}, language, {}, {}), meta)
    export_hf_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    got = folder_tensors(tmp_path / "out" / "language")
    assert torch.equal(got["model.embed_tokens.weight"], language.embed.weight[:base + 3])
    assert json.loads((tmp_path / "out" / "language" / "config.json").read_text())[
        "vocab_size"] == base + 3


# ---- MoE families: stacked experts back to per-expert tensors ----------------------------

MOE = {"vocab_size": 96, "hidden_size": HIDDEN, "intermediate_size": 48,
       "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "max_position_embeddings": 64}
MOE_FAMILIES = {
    # Gated shared expert, layer 1 dense; every second layer sparse, q/k norms.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"shared_expert_intermediate_size": 24, "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"head_dim": 8, "norm_topk_prob": True, "decoder_sparse_step": 2}),
}


def _moe_folder(root: Path, family: str) -> Path:
    config_cls, model_cls, extra = MOE_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**MOE, **extra)
    _perturbed(getattr(transformers, model_cls)(config)).save_pretrained(root / family)
    return root / family


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_round_trip_and_trained_export_load_in_transformers(family, tmp_path):
    """Qwen2-MoE / Qwen3-MoE: the stacked experts are written back as one tensor per
    expert, bit for bit; after a (simulated) step transformers loads the same forward."""
    folder = _moe_folder(tmp_path, family)
    language = build_hf_language_model(folder).eval()
    meta = {"config": _run_config({"language": folder})}
    _checkpoint(tmp_path / "ckpt", MimoModel({}, language, {}, {}), meta)
    export_hf_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    _assert_bitwise(folder_tensors(tmp_path / "out" / "language"), folder_tensors(folder))

    torch.manual_seed(2)
    _perturbed(language)
    _checkpoint(tmp_path / "trained", MimoModel({}, language, {}, {}), meta)
    export_hf_checkpoint(tmp_path / "trained", tmp_path / "out2")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out2" / "language",
                                                                 output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = torch.arange(2 * 12).view(2, 12) * 29 % MOE["vocab_size"]
    with torch.no_grad():
        _assert_close(hf.eval()(tokens).logits, language(language.embed_tokens(tokens)))
