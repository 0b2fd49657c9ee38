"""One LLaVA folder as a user has it: split into modules, equal to transformers' model, and
trained on per-module layouts like a plain loop on transformers' model.

The folder (:func:`tests.hf_vlm.save_llava_folder`) is made by ``transformers`` from its
config classes with random weights; the independent reference is its own
``LlavaForConditionalGeneration``, which shares no code with mimotron's modules.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.config.hf_vlm import LLAMA_TEXT_DEFAULTS, TEXT_DEFAULTS, vlm_module_options
from mimotron.data import build_datasets, collate
from mimotron.data.run_data import build_tokenizer
from mimotron.forked_ranks import run_groups
from mimotron.generate import Generator, Sampling
from mimotron.models.build import build_mimo_model
from tests.common import engine_run
from tests.hf_data import folder_tensors
from tests.hf_vlm import (
    IMAGE,
    IMAGE_TOKENS,
    check_layout_run,
    hf_llava_loss,
    hf_name,
    hf_reference_run,
    save_llava_folder,
    write_config,
    write_image_data,
)

transformers = pytest.importorskip("transformers")

NUM_ITERS = 10


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The folder (hub layout), image data and the one-folder config."""
    root = tmp_path_factory.mktemp("llava_folder")
    folder = save_llava_folder(root)
    data = write_image_data(root / "data")
    return {"root": root, "folder": folder, "data": data,
            "config": write_config(root, folder, data, iters=NUM_ITERS)}


def test_one_folder_becomes_a_vision_and_a_language_module(llava: dict[str, Path]) -> None:
    cfg = load_config(llava["config"])
    vision, language = cfg.modules["vision"], cfg.modules["language"]
    assert (vision.kind, language.kind) == ("vit", "language")
    assert vision.hf_path == language.hf_path == str(llava["folder"])
    # The tower's part of config.json: 4 layers, feature layer -3 -> 2 built.
    assert (vision.hidden_size, vision.num_layers, vision.num_output_tokens) == (
        32, 2, IMAGE_TOKENS)
    assert (vision.vision_feature_layer, vision.projector_hidden_size) == (-3, 32)
    assert (language.hidden_size, language.num_layers, language.num_heads) == (32, 2, 4)
    # The same folder named per module gives the same modules.
    per_module = load_config(None, [
        f"modules.vision.hf_path='{llava['folder']}'", "modules.vision.kind='vit'",
        f"modules.language.hf_path='{llava['folder']}'", "data.dataset='llava'",
        f"data.path='{llava['data']}'", "data.seq_length=128"])
    assert per_module.modules == cfg.modules


@pytest.mark.parametrize(("override", "message"), [
    ("modules.vision.vision_feature_layer=-2",
     "modules.vision.vision_feature_layer=-2 contradicts config.json"),
    ("modules.language.kind='vit'", "modules.language.kind='vit' contradicts the top-level"),
    ("modules.vision.hidden_size=64", "modules.vision.hidden_size=64 contradicts config.json"),
])
def test_a_key_contradicting_the_folder_is_one_line(llava: dict[str, Path], override: str,
                                                    message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[")) as info:
        load_config(llava["config"], [override])
    assert "\n" not in str(info.value)


def test_a_folder_that_is_not_a_supported_vlm_is_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "blip"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "blip-2"}))
    with pytest.raises(ValueError, match=r"model_type='blip-2'.*expected one of \['llava', "
                                         r"'qwen2_5_vl', 'qwen3_vl'\]"):
        load_config(None, [f"hf_path='{folder}'"])


@pytest.mark.parametrize(("key", "value"), [("projector_hidden_act", "relu"),
                                            ("multimodal_projector_bias", False),
                                            ("vision_feature_layer", [-2, -5])])
def test_a_projector_or_feature_selection_not_implemented_is_refused(key: str, value: object
                                                                     ) -> None:
    config = {"model_type": "llava", "text_config": {"hidden_size": 8}, key: value}
    with pytest.raises(ValueError, match=f"config.json {key}="):
        vlm_module_options(config)


@pytest.mark.parametrize("family", sorted(TEXT_DEFAULTS))
def test_text_defaults_are_transformers_defaults(family: str) -> None:
    # llava-1.5-7b-hf's text_config gives no sizes: transformers' LlamaConfig defaults apply.
    default = transformers.AutoConfig.for_model(family)
    for key, value in TEXT_DEFAULTS[family].items():
        assert getattr(default, key) == value, key
    assert TEXT_DEFAULTS["llama"] is LLAMA_TEXT_DEFAULTS


def _batch_and_model(config: Path) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    cfg = load_config(config)
    tokenizer = build_tokenizer(cfg)
    task, _ = build_datasets(cfg, tokenizer)
    batch = collate(task.stream(cfg.train.seed).samples(0, 8), task.seq_length,
                    pad_id=task.pad_id, image_shape=task.image_shape,
                    audio_shape=task.audio_shape)
    model = build_mimo_model(cfg, tokenizer.vocab_size,
                             {"vision": tokenizer.placeholder_id("image")})
    return batch, model


@pytest.mark.parametrize("layout", ["hub", "flat", "saved", "sharded-fp16"])
def test_loss_and_every_gradient_equal_transformers(tmp_path: Path, layout: str) -> None:
    """Every checkpoint layout loads into the modules transformers' model computes with."""
    folder = save_llava_folder(tmp_path, layout=layout)
    if layout == "sharded-fp16":
        assert len(list(folder.glob("model-*.safetensors"))) > 2
    config = write_config(tmp_path, folder, write_image_data(tmp_path / "data"))
    batch, model = _batch_and_model(config)
    assert int(batch["has_image"].sum()) >= 4 and int((~batch["has_image"].bool()).sum()) >= 1
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().reshape(theirs[hf_name(name)].shape),
                           theirs[hf_name(name)]), name
    loss_sum, num_tokens, _ = model(batch)
    (loss_sum / num_tokens).backward()
    want = hf_llava_loss(reference, batch)
    want.backward()
    assert float(loss_sum / num_tokens) == pytest.approx(float(want), rel=1e-5)
    for name, param in model.named_parameters():
        if name.endswith("attn.wk.bias"):
            # Zero in exact arithmetic (softmax ignores a per-query constant): round-off.
            assert float(param.grad.abs().max()) < 1e-9, name
            continue
        grad = theirs[hf_name(name)].grad
        err = float((param.grad.reshape(grad.shape) - grad).norm() / grad.norm())
        assert err <= 1e-5, f"{name}: relative error {err}"


_LAYOUTS = {
    # world, overrides
    "colocated vision DP 2 + language TP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2"]),
    "vision DP 2 | language TP 2": (4, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
        "modules.language.parallel.rank_offset=2"]),
    "vision | language PP 2": (3, [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.rank_offset=1"]),
    "vision | language CP 2": (3, [
        "modules.language.parallel.context=2", "modules.language.parallel.rank_offset=1"]),
}


STAGE_2 = ("modules.vision.freeze='encoder'",)  # LLaVA-1.5's stage 2: the tower frozen


@pytest.mark.parametrize("freeze", [(), STAGE_2], ids=["all", "stage_2"])
def test_layouts_train_like_a_plain_loop_on_transformers(llava: dict[str, Path],
                                                         freeze: tuple[str, ...]) -> None:
    """10 iterations at a real learning rate: losses, grad norms, final weights."""
    ref = hf_reference_run(llava["config"], NUM_ITERS, freeze)
    assert ref.losses[-1] < ref.losses[0] - 0.3, ref.losses
    layouts = _LAYOUTS if not freeze else {k: _LAYOUTS[k] for k in list(_LAYOUTS)[:2]}
    groups = run_groups([(world, engine_run, ([*over, *freeze], NUM_ITERS, llava["config"]),
                          {}) for world, over in layouts.values()], timeout_s=300)
    for layout, results in zip(layouts, groups, strict=True):
        merged = check_layout_run(layout, results, ref)
        frozen = set(merged) - set(ref.weights)
        assert frozen == ({n for n in merged if ".vision.encoder." in n} if freeze else set())
        for name in frozen:  # the tower as loaded
            want = _loaded(llava["folder"])[hf_name(name)]
            assert torch.equal(merged[name].reshape(want.shape), want), name
        for name, want in ref.weights.items():
            if name.endswith("attn.wk.bias"):
                continue  # Adam steps of a zero gradient's round-off (see above)
            got = merged[name].reshape(want.shape)
            err = float((got - want).norm() / want.norm())
            assert err <= 1e-4, f"{layout}: {name}: relative error {err}"
            assert not torch.equal(want, ref.initial[name]), name


@pytest.fixture(scope="module")
def exported(llava: dict[str, Path]) -> dict[str, Path]:
    """``mimotron train`` (5 iterations) then ``mimotron export --format hf``, by the CLI."""
    root = llava["root"] / "round_trip"
    root.mkdir()
    config = write_config(root, llava["folder"], llava["data"], iters=5)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(config),
                           "checkpoint.interval=5"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint, out = root / "run" / "checkpoints", root / "export"
    assert cli_main(["export", "--format", "hf", str(checkpoint), str(out)]) == 0
    return {"checkpoint": checkpoint, "out": out, "image": llava["data"].parent / "img0.png"}


def test_export_is_one_folder_transformers_loads_with_no_missing_keys(
        exported: dict[str, Path], llava: dict[str, Path]) -> None:
    out = exported["out"]
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    # Every tensor of the original is there under its name; the trained ones changed.
    original, written = folder_tensors(llava["folder"]), folder_tensors(out)
    assert set(written) == set(original)
    changed = {n for n in original if not torch.equal(original[n], written[n])}
    assert any(n.startswith("multi_modal_projector.") for n in changed)
    assert any(n.startswith("language_model.model.layers.") for n in changed)
    assert any(n.startswith("vision_tower.vision_model.encoder.layers.1.") for n in changed)
    # Layers past the feature layer (-3 of 4: layers 2 and 3) were never built: as they were.
    assert not any(".encoder.layers.3." in n or "post_layernorm" in n for n in changed)
    processor = transformers.AutoProcessor.from_pretrained(out)
    assert type(processor.image_processor).__name__.startswith("CLIPImageProcessor")


def test_hf_llava_format_of_a_one_folder_run_points_to_hf(exported: dict[str, Path],
                                                          tmp_path: Path, capsys) -> None:
    code = cli_main(["export", "--format", "hf-llava", str(exported["checkpoint"]),
                     str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "export the run with --format hf" in err and "\n" not in err, err


def test_exported_logits_and_greedy_tokens_equal_mimotron_generate(
        exported: dict[str, Path]) -> None:
    from PIL import Image

    generator = Generator.from_path(exported["checkpoint"], device="cpu")
    prompt = "what digit is in this picture"
    encoded, hidden = generator.encode(prompt, [exported["image"]])
    ours = generator.language_model(hidden)[0]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        exported["out"], dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(exported["out"])
    pixels = processor.image_processor(Image.open(exported["image"]).convert("RGB"),
                                       return_tensors="pt")["pixel_values"]
    ids = torch.tensor([encoded.tokens])
    with torch.no_grad():
        theirs = model(input_ids=ids, pixel_values=pixels).logits[0]
    vocab = theirs.shape[-1]
    err = float((ours[:, :vocab] - theirs).abs().max() / theirs.abs().max())
    assert err <= 1e-5, err
    reply = generator.generate(prompt, [exported["image"]], sampling=Sampling(max_new_tokens=8))
    banned = [generator.loaded.tokenizer.placeholder_id("image"),
              *range(generator.loaded.tokenizer.vocab_size, vocab)]
    with torch.no_grad():
        sequence = model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=8,
                                  do_sample=False, suppress_tokens=banned)[0, ids.shape[1]:]
    got, num = sequence.tolist(), len(reply.token_ids)
    assert got[:num] == reply.token_ids, (got, reply)
    assert reply.stop == "max_new_tokens" or got[num] in encoded.stop_ids, (got, reply)


# llava-hf/llava-1.5-7b-hf's config.json as published: its text_config names no size.
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100,
    "image_token_index": 32000, "model_type": "llava", "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5",
                    "architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                    "model_type": "llama", "rms_norm_eps": 1e-05, "torch_dtype": "float16",
                    "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.36.0.dev0",
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                      "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


def test_the_published_llava_1_5_7b_config_is_clip_l_336_and_llama_2_7b(tmp_path: Path
                                                                         ) -> None:
    from mimotron.models.build import count_parameters

    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15_7B))
    cfg = load_config(None, [f"hf_path='{tmp_path}'", "data.seq_length=2048"])
    vision, language = cfg.modules["vision"], cfg.modules["language"]
    # CLIP ViT-L/14-336 up to its second-to-last layer: 23 of 24 layers, 576 tokens.
    assert (vision.hidden_size, vision.num_layers, vision.num_heads) == (1024, 23, 16)
    assert (vision.num_output_tokens, vision.projector_hidden_size) == (576, 4096)
    # Vicuna-7B v1.5 = Llama-2-7B (transformers' LlamaConfig defaults), 32,064 rows.
    assert (language.hidden_size, language.num_layers, language.num_heads,
            language.ffn_hidden_size) == (4096, 32, 32, 11008)
    assert count_parameters(cfg, "language", 32064) == 6_738_939_904
    # The projector (1024 -> 4096 -> 4096 with biases) and, by hand, the tower's
    # embeddings (patch convolution, class token, 577 positions, pre-norm) and 23 layers;
    # with its 24th layer and final norm that is CLIP ViT-L/14-336's published 303.5 M.
    projector = 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    layer = 4 * (1024 * 1024 + 1024) + 2 * 2048 + (1024 * 4096 + 4096) + (4096 * 1024 + 1024)
    embeddings = 3 * 14 * 14 * 1024 + 1024 + 577 * 1024 + 2048
    tower = embeddings + 23 * layer
    assert count_parameters(cfg, "vision", 32064) - projector == tower
    assert round((tower + layer + 2048) / 1e6, 1) == 303.5


def _loss_equals_transformers(folder: Path, root: Path) -> None:
    config = write_config(root, folder, write_image_data(root / "data"))
    batch, model = _batch_and_model(config)
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32)
    with torch.no_grad():
        loss_sum, num_tokens, _ = model(batch)
        want = hf_llava_loss(reference, batch)
    assert float(loss_sum / num_tokens) == pytest.approx(float(want), rel=1e-5)


@pytest.mark.parametrize("layout", ["hub", "saved"])
def test_a_siglip_tower_with_its_pooling_head_loads(tmp_path: Path, layout: str) -> None:
    # transformers' SiglipVisionConfig has vision_use_head on: the folder holds a head
    # LLaVA never runs, which is not "unexpected".
    folder = save_llava_folder(tmp_path, layout=layout, siglip=True,
                               vision_feature_select_strategy="full")
    _loss_equals_transformers(folder, tmp_path)


def test_the_head_is_tied_when_the_top_level_config_ties_it(tmp_path: Path) -> None:
    folder = save_llava_folder(tmp_path, tie_word_embeddings=True)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = False  # only the top level says so
    (folder / "config.json").write_text(json.dumps(config))
    _loss_equals_transformers(folder, tmp_path)


def test_a_folder_whose_processor_transformers_5_saved_loads(tmp_path: Path) -> None:
    # LlavaProcessor.save_pretrained writes processor_config.json, the image settings inside.
    folder = save_llava_folder(tmp_path)
    (folder / "preprocessor_config.json").unlink()
    transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE}),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder), patch_size=8,
        vision_feature_select_strategy="default").save_pretrained(folder)
    assert not (folder / "preprocessor_config.json").exists()
    _loss_equals_transformers(folder, tmp_path)


def test_siglip_with_the_default_strategy_is_refused_at_load(tmp_path: Path) -> None:
    folder = save_llava_folder(tmp_path, siglip=True)  # LlavaConfig's default: "default"
    with pytest.raises(ValueError, match="^modules.vision: config.json "
                                         "vision_feature_select_strategy='default' with a SigLIP"):
        load_config(write_config(tmp_path, folder, write_image_data(tmp_path / "data")))


def test_a_projector_into_a_language_model_of_another_width_is_refused(
        tmp_path: Path, llava: dict[str, Path]) -> None:
    other = tmp_path / "llama64"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    ).save_pretrained(other)
    with pytest.raises(ValueError, match=r"brings a projector into a 32-wide language model .* "
                                         r"modules.language.hidden_size=64"):
        load_config(None, [f"modules.vision.hf_path='{llava['folder']}'",
                           "modules.vision.kind='vit'", f"modules.language.hf_path='{other}'",
                           "data.dataset='llava'", f"data.path='{llava['data']}'",
                           f"data.tokenizer='{llava['folder']}'", "data.seq_length=128"])


def test_export_takes_the_folder_with_other_modules_and_refuses_half_a_folder(
        llava: dict[str, Path], tmp_path: Path) -> None:
    from mimotron.checkpoint.vlm_export import vlm_folder

    folder = str(llava["folder"])
    run = {"modules": {"vision": {"kind": "vit", "hf_path": folder},
                       "language": {"kind": "language", "hf_path": folder},
                       "audio": {"kind": "audio"}}}
    assert vlm_folder(run) == (llava["folder"], "vision")
    clip = tmp_path / "clip"
    transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        image_size=IMAGE, patch_size=8)).save_pretrained(clip)
    run["modules"]["vision"]["hf_path"] = str(clip)
    with pytest.raises(ValueError, match=r"^export --format hf: modules.language.hf_path=.* is a "
                                         "part of a vision-language folder"):
        vlm_folder(run)


def test_the_folder_config_plans_as_the_two_folder_one() -> None:
    """configs/llava15_7b_folder.toml (llava-1.5-7b-hf's config.json) and
    configs/llava15_7b_8gpu.toml (CLIP-L/336 + Llama-2-7B folders) are one model: the
    vision ranks' estimates are equal; the language ranks' differ by the 64 vocabulary
    rows LLaVA-1.5 adds (32,064 vs 32,000)."""
    from mimotron.estimate.memory import estimate_memory
    from mimotron.parallel.layout import check_layout

    def estimates(name: str) -> list[tuple[str, int]]:
        cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / name)
        vocab = 32064 if "folder" in name else 32000
        return [(e.module, e.total) for per_rank in
                estimate_memory(cfg, check_layout(cfg), vocab).values() for e in per_rank]

    folder, two = estimates("llava15_7b_folder.toml"), estimates("llava15_7b_8gpu.toml")
    assert [m for m, _ in folder] == [m for m, _ in two]
    for (module, got), (_, want) in zip(folder, two, strict=True):
        if module == "vision":
            assert got == want
        else:
            assert 0 <= got - want <= 0.002 * want, (got, want)



@functools.cache
def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the folder as transformers loads it, by transformers' names."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder,
                                                                       dtype=torch.float32)
    return {n: p.detach() for n, p in model.named_parameters()}


def test_a_processor_the_tower_cannot_take_is_refused_before_launch(tmp_path: Path) -> None:
    from mimotron.data.run_data import check_data

    folder = save_llava_folder(tmp_path)
    transformers.CLIPImageProcessor(size={"shortest_edge": 24},
                                    crop_size={"height": 24, "width": 24}).save_pretrained(folder)
    cfg = load_config(write_config(tmp_path, folder, write_image_data(tmp_path / "data")))
    with pytest.raises(ValueError) as err:
        check_data(cfg)
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "modules.vision.hf_path" in message, message
    assert "(3, 24, 24)" in message, message
