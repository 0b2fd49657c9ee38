"""LoRA adapters against ``transformers`` + ``peft``, the independent reference.

A tiny LLaVA folder in LLaVA-1.5's stage-2 LoRA recipe: the tower frozen, the projector
trained in full, adapters on every linear layer of the language model (whose base
weights then stop). PEFT's LoRA layers on transformers' model hold the same adapter
values (:func:`tests.lora_reference.with_adapters`).

* One process: the loss and the gradient of every adapter and of the projector equal
  transformers + peft's (fp32, 1e-5), with nonzero ``lora_b`` so every adapter matrix
  has a gradient.
* Layouts: 10 iterations at a real learning rate, split (vision DP 2 | language TP 2,
  language TP 2 with sequence parallelism, PP 2, CP 2, DP 2 with ZeRO-1) and colocated
  (vision DP 2 + language TP 2; + language FSDP2 over DP 2; + language PP 2):
  losses, grad norms and final weights equal the plain loop on the PEFT model; the base
  weights end as loaded.
* Adapters on the vision tower and the projector too (a CLIP tower, row-major 2-D
  inputs), as one process against transformers + peft.
* What the config refuses, one line each.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimotron.checkpoint import read_full_model
from mimotron.config import load_config
from mimotron.forked_ranks import run_groups
from mimotron.models.build import build_mimo_model
from mimotron.models.lora import is_lora_parameter
from mimotron.parallel.layout import check_layout
from tests.common import BASE as BASE_DIGITS
from tests.common import DIGITS, SMALL_MODEL, noncolocated
from tests.hf_vlm import (
    LLAVA,
    HFFamily,
    check_layout_run,
    hf_name,
    hf_reference_run,
    save_llava_folder,
    write_config,
    write_image_data,
)
from tests.lora_reference import with_adapters

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

NUM_ITERS = 10
RANK, ALPHA = 4, 8.0
RECIPE = ("modules.vision.freeze='encoder'", f"modules.language.lora.rank={RANK}",
          f"modules.language.lora.alpha={ALPHA}", "optimizer.lr=2e-2")


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava_lora")
    folder = save_llava_folder(root)
    data = write_image_data(root / "data")
    return {"root": root, "folder": folder,
            "config": write_config(root, folder, data, iters=NUM_ITERS)}


def _check_against_peft(config: Path, overrides: list[str], family: HFFamily = LLAVA
                        ) -> dict[str, torch.Tensor]:
    """One process: mimotron's loss and the gradient of everything that trains equal
    transformers + peft's on a batch; ``lora_b`` nonzero so every adapter matrix has a
    gradient. Returns what trained."""
    from mimotron.data import build_datasets, collate
    from mimotron.data.run_data import build_tokenizer
    from mimotron.training.model_setup import freeze_modules

    cfg = load_config(config, overrides)
    tokenizer = build_tokenizer(cfg)
    task, _ = build_datasets(cfg, tokenizer)
    model = build_mimo_model(cfg, tokenizer.vocab_size,
                             {"vision": tokenizer.placeholder_id("image")})
    freeze_modules(model, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    reference, name_of = with_adapters(family.load(cfg.hf_path), model, RANK, ALPHA,
                                       family.name_of)
    theirs = dict(reference.named_parameters())
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for name in trained:  # PEFT froze all but its adapters; a projector may train too
        theirs[name_of(name, reference)].requires_grad_(True)
    batch = collate(task.stream(cfg.train.seed).samples(0, 8), task.seq_length,
                    pad_id=task.pad_id, image_shape=task.image_shape)
    assert int(batch["has_image"].sum()) >= 2
    loss_sum, num_tokens, _ = model(batch)
    (loss_sum / num_tokens).backward()
    want = family.loss(reference, batch)
    want.backward()
    assert float(loss_sum / num_tokens) == pytest.approx(float(want), rel=1e-5)
    for name, param in trained.items():
        grad = theirs[name_of(name, reference)].grad
        err = float((param.grad.reshape(grad.shape) - grad).norm() / grad.norm())
        assert err <= 1e-5, f"{name}: relative error {err}"
    return trained


def test_loss_and_adapter_gradients_equal_transformers_with_peft(llava: dict[str, Path]
                                                                 ) -> None:
    trained = _check_against_peft(llava["config"], list(RECIPE))
    assert {n for n in trained if n.startswith("language_model.")} == {
        n for n in trained if is_lora_parameter(n) and n.startswith("language_model.")}
    assert sum(is_lora_parameter(n) for n in trained) == 2 * 7 * 2  # 7 per layer, 2 layers
    assert any(".projector." in n for n in trained)


def test_adapters_on_the_tower_and_the_projector_equal_peft(llava: dict[str, Path]) -> None:
    """A CLIP tower's layers (2-D rows) and a projector layer adapted, both modules'
    bases frozen."""
    trained = _check_against_peft(llava["config"], [
        "modules.vision.lora.rank=4", "modules.vision.lora.alpha=8.0",
        "modules.vision.lora.targets=['attn.wq', 'attn.wv', 'mlp.w1', 'projector.fc1']",
        "modules.language.lora.rank=4", "modules.language.lora.alpha=8.0"])
    assert all(is_lora_parameter(n) for n in trained)
    vision = {n.rsplit(".", 1)[0] for n in trained if n.startswith("modality_submodules.")}
    assert "modality_submodules.vision.projector.fc1" in vision
    assert any(".encoder.layers.0.attn.wq" in n for n in vision)


_LAYOUTS = {
    "colocated vision DP 2 + language TP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2"]),
    "vision DP 2 | language TP 2": (4, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
        "modules.language.parallel.rank_offset=2"]),
    "vision | language TP 2 + SP": (3, [
        "modules.language.parallel.tensor=2", "modules.language.parallel.sequence_parallel=true",
        "modules.language.parallel.rank_offset=1"]),
    "vision | language PP 2": (3, [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.rank_offset=1"]),
    "vision | language CP 2": (3, [
        "modules.language.parallel.context=2", "modules.language.parallel.rank_offset=1"]),
    "colocated vision DP 2 + language FSDP2 over DP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.data=2",
        "modules.language.parallel.fsdp=true"]),
    "vision | language DP 2 with ZeRO-1": (3, [
        "modules.language.parallel.data=2", "modules.language.parallel.shard_optimizer=true",
        "modules.language.parallel.rank_offset=1"]),
    "colocated vision DP 2 + language PP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.pipeline=2"]),
}


def test_layouts_train_like_a_plain_loop_on_transformers_with_peft(llava: dict[str, Path]
                                                                   ) -> None:
    """10 iterations: losses, grad norms, final weights; the base as loaded."""
    from tests.common import engine_run

    ref = hf_reference_run(llava["config"], NUM_ITERS, RECIPE)
    assert ref.losses[-1] < ref.losses[0] - 0.2, ref.losses
    groups = run_groups([(world, engine_run, ([*over, *RECIPE], NUM_ITERS, llava["config"]), {})
                         for world, over in _LAYOUTS.values()], timeout_s=300)
    loaded = dict(LLAVA.load(str(llava["folder"])).named_parameters())
    for layout, results in zip(_LAYOUTS, groups, strict=True):
        merged = check_layout_run(layout, results, ref)
        for name, want in ref.weights.items():
            err = float((merged[name].reshape(want.shape) - want).norm() / want.norm())
            assert err <= 1e-4, f"{layout}: {name}: relative error {err}"
            assert not torch.equal(want, ref.initial[name]), name
        base = [n for n in merged if n.startswith("language_model.") and not is_lora_parameter(n)]
        assert base, layout
        for name in base:  # the frozen base as loaded
            want = loaded[hf_name(name)]
            assert torch.equal(merged[name].reshape(want.shape), want), (layout, name)


def test_tower_adapters_under_tensor_parallelism_train_like_the_plain_loop(
        llava: dict[str, Path]) -> None:
    """Adapters on the CLIP tower (TP 2: its 2-D rows) and the language model (TP 2),
    colocated: 10 iterations against the plain loop on the PEFT model."""
    from tests.common import engine_run

    both = ["modules.vision.lora.rank=4", "modules.vision.lora.alpha=8.0",
            "modules.vision.lora.targets=['attn.wq', 'attn.wo', 'mlp.w1', 'mlp.w2']",
            "modules.language.lora.rank=4", "modules.language.lora.alpha=8.0",
            "optimizer.lr=2e-2"]
    ref = hf_reference_run(llava["config"], NUM_ITERS, tuple(both))
    over = ["modules.vision.parallel.tensor=2", "modules.language.parallel.tensor=2", *both]
    (results,) = run_groups([(2, engine_run, (over, NUM_ITERS, llava["config"]), {})],
                            timeout_s=300)
    merged = check_layout_run("colocated vision TP 2 + language TP 2", results, ref)
    tower = [n for n in ref.weights if ".vision.encoder." in n]
    assert tower and all(is_lora_parameter(n) for n in tower)
    for name, want in ref.weights.items():
        err = float((merged[name].reshape(want.shape) - want).norm() / want.norm())
        assert err <= 1e-4, f"{name}: relative error {err}"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_folder_with_adapters_equals_peft(family: str, tmp_path: Path) -> None:
    """Adapters on a Qwen-VL language model (M-RoPE; Qwen3-VL's DeepStack added between
    adapted layers), images of several sizes, the tower's patch merger trained."""
    from tests.qwen_vl import QWEN_FAMILY, save_qwen_folder, write_qwen_config

    save_qwen_folder(tmp_path / "folder", family, 3)
    config = write_qwen_config(tmp_path, tmp_path / "folder", 256, 10)
    trained = _check_against_peft(config, list(RECIPE), QWEN_FAMILY)
    assert any(".merger." in n for n in trained)
    assert sum(is_lora_parameter(n) for n in trained) == 2 * 7 * 3  # 3 language layers


@pytest.mark.parametrize(("overrides", "message"), [
    (["modules.language.lora.rank=-1"], r"modules.language.lora.rank=-1 is invalid"),
    (["modules.language.lora.rank=4", "modules.language.lora.alpha=0"],
     r"modules.language.lora.alpha=0"),
    (["modules.language.lora.rank=4", "modules.language.lora.dropout=1.0"],
     r"modules.language.lora.dropout=1.0 is invalid"),
    (["modules.language.lora.rank=4", "modules.language.freeze=true"],
     r"set freeze = false"),
    (["modules.language.lora.rank=4", "modules.language.lora.dropout=0.1",
      "modules.language.parallel.tensor=2", "modules.language.parallel.rank_offset=1"],
     r"tensor-parallel ranks would drop different inputs"),
    (["modules.language.lora.rank=4", "modules.language.parallel.tensor=2",
      "modules.language.parallel.data=2", "modules.language.parallel.fsdp=true",
      "modules.language.parallel.rank_offset=1"],
     r"not supported with modules.language.parallel.fsdp = true and parallel.tensor > 1"),
    (["modules.language.lora.rank=4", "modules.language.lora.targets=['attn.wqq']"],
     r"modules.language.lora.targets \['attn.wqq'\] match no linear layer"),
])
def test_a_table_that_cannot_run_is_one_line(llava: dict[str, Path], overrides: list[str],
                                             message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        check_layout(load_config(llava["config"], overrides))
    assert "\n" not in str(err.value)


def test_adapters_on_a_tower_only_folder_are_refused(tmp_path: Path) -> None:
    """Its projector would start random and stay frozen (a CLIP folder per module)."""
    from tests.hf_models import hf_overrides, save_models

    over = [*BASE_DIGITS, *hf_overrides(save_models(tmp_path)), "modules.vision.lora.rank=2"]
    with pytest.raises(ValueError, match=r"modules.vision.lora.rank=2: modules.vision.hf_path="
                                         r".* holds the tower only"):
        load_config(DIGITS, over)
    load_config(DIGITS, [*over, "modules.vision.lora.rank=0", "modules.language.lora.rank=2"])


def test_interleaving_is_refused_with_adapters() -> None:
    over = [*SMALL_MODEL, *noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2}),
            "modules.language.num_layers=4", "modules.language.lora.rank=2"]
    with pytest.raises(ValueError, match=r"not supported with modules.language.parallel."
                                         r"virtual_pipeline > 1"):
        load_config(DIGITS, over)


def test_a_layer_by_index_and_the_tower_defaults_are_targets(llava: dict[str, Path]) -> None:
    cfg = load_config(llava["config"], ["modules.language.lora.rank=2",
                                        "modules.language.lora.targets=['layers.1.attn.wq']",
                                        "modules.vision.lora.rank=2"])
    check_layout(cfg)  # the index names a layer; the tower has its own default names
    model = build_mimo_model(cfg, 300, {"vision": 1})
    adapted = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if is_lora_parameter(n)}
    assert {n for n in adapted if n.startswith("language_model.")} == {
        "language_model.layers.1.attn.wq"}
    assert "modality_submodules.vision.encoder.layers.0.mlp.w2" in adapted


def test_a_tied_head_stays_tied_when_the_embedding_stays_fp32() -> None:
    from torch import nn

    from mimotron.models.lora import hold_base_in

    embed, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    part = nn.ModuleDict({"embed": embed, "head": head, "mlp": nn.Linear(4, 4)})
    part.requires_grad_(False)
    assert hold_base_in(part, torch.bfloat16, embedding=False) == 2  # the MLP's weight, bias
    assert part["head"].weight is part["embed"].weight
    assert part["embed"].weight.dtype == torch.float32
    assert part["mlp"].weight.dtype == torch.bfloat16


def test_one_tp_rank_holds_the_split_matrix_of_each_adapter_and_the_other_whole(
        llava: dict[str, Path]) -> None:
    from mimotron.models.lora import adapter_parameter_count

    cfg = load_config(llava["config"], ["modules.language.lora.rank=2",
                                        "modules.language.lora.targets=['attn.wq', 'mlp.w2']"])
    part = build_mimo_model(cfg, 300, {"vision": 1}).language_model
    wq, w2 = part.layers["0"].attn.wq, part.layers["0"].mlp.w2
    layers = cfg.modules["language"].num_layers
    # wq column-parallel: A [2, in] whole, B [out/2, 2]; w2 row-parallel: A [2, in/2], B whole.
    want = layers * 2 * (wq.in_features + wq.out_features // 2
                         + w2.in_features // 2 + w2.out_features)
    assert adapter_parameter_count(part, cfg.modules["language"].lora, tensor=2) == want


def test_targets_choose_the_layers(llava: dict[str, Path]) -> None:
    cfg = load_config(llava["config"], ["modules.language.lora.rank=2",
                                        "modules.language.lora.targets=['attn.wq', 'mlp.w2']"])
    model = build_mimo_model(cfg, 300, {"vision": 1})
    adapted = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if is_lora_parameter(n)}
    layers = cfg.modules["language"].num_layers
    assert adapted == {f"language_model.layers.{i}.{t}" for i in range(layers)
                       for t in ("attn.wq", "mlp.w2")}
    a = model.language_model.layers["0"].attn.wq.lora_a
    assert a.shape == (2, cfg.modules["language"].hidden_size)
    assert float(a.abs().max()) <= 1 / a.shape[1] ** 0.5  # PEFT's Kaiming-uniform bound
    assert not model.language_model.layers["0"].attn.wq.lora_b.any()  # starts at the base


@pytest.fixture(scope="module")
def trained(llava: dict[str, Path]) -> dict[str, Path]:
    """``mimotron train`` (5 iterations of the recipe) then ``export --format peft`` and
    ``--format hf`` (merged), by the CLI."""
    import os
    import subprocess
    import sys

    from mimotron.cli.main import main as cli_main

    root = llava["root"] / "round_trip"
    root.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(llava["config"]),
                           *RECIPE, "train.iters=5", "checkpoint.interval=5",
                           f"log.dir='{root / 'run'}'"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checkpoint = root / "run" / "checkpoints"
    out = {"checkpoint": checkpoint, "peft": root / "peft", "merged": root / "merged"}
    assert cli_main(["export", "--format", "peft", str(checkpoint), str(out["peft"])]) == 0
    assert cli_main(["export", "--format", "hf", str(checkpoint), str(out["merged"])]) == 0
    return out


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    kinds = batch["has_image"].bool()
    with torch.no_grad():
        return model(input_ids=batch["tokens"], pixel_values=batch["image"][kinds]).logits


def test_peft_and_the_merged_export_give_mimotrons_logits(trained: dict[str, Path],
                                                          llava: dict[str, Path]) -> None:
    import peft

    from mimotron.data import build_datasets, collate
    from mimotron.generate import Generator

    generator = Generator.from_path(trained["checkpoint"], device="cpu")
    model, cfg = generator.loaded.model, generator.loaded.cfg
    adapted = [n for n, _ in model.named_parameters() if is_lora_parameter(n)]
    assert adapted and all(float(p.abs().max()) > 0 for n, p in model.named_parameters()
                           if n.endswith("lora_b"))  # trained: B moved from zero
    task, _ = build_datasets(cfg, generator.loaded.tokenizer)
    batch = collate(task.stream(cfg.train.seed).samples(0, 4), task.seq_length,
                    pad_id=task.pad_id, image_shape=task.image_shape)
    base = LLAVA.load(str(llava["folder"]))
    with_adapter = peft.PeftModel.from_pretrained(base, str(trained["peft"]))
    theirs = _logits(with_adapter, batch)
    merged = _logits(transformers.LlavaForConditionalGeneration.from_pretrained(
        trained["merged"], dtype=torch.float32), batch)
    vocab = theirs.shape[-1]
    ours = _mimotron_logits(model, batch)[..., :vocab]
    for name, got in (("peft", theirs), ("merged", merged)):
        err = float((ours - got).abs().max() / got.abs().max())
        assert err <= 1e-5, (name, err)
    untrained = _logits(LLAVA.load(str(llava["folder"])), batch)
    assert float((ours - untrained).abs().max()) > 1e-3  # the adapters changed something


def _mimotron_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """mimotron's logits of a batch: the encoders, the merge, the language model."""
    from mimotron.training.language_step import language_inputs

    with torch.no_grad():
        embeds = {n: model.encode(n, batch) for n in model.modality_submodules}
        hidden, visual = language_inputs(model, batch, embeds)
        return model.language_model(hidden, **visual)


def test_a_qwen_vl_peft_export_carries_the_trained_mergers(tmp_path: Path) -> None:
    """Qwen3-VL with its tower frozen and its patch mergers (the projector) training:
    3 iterations, ``export --format peft``, PEFT on transformers' model gives mimotron's
    loss; the mergers are in ``modules_to_save``."""
    import json

    import peft

    from mimotron.cli.main import main as cli_main
    from mimotron.data import build_datasets, collate
    from mimotron.data.run_data import build_tokenizer
    from mimotron.forked_ranks import run_ranks
    from tests.parity import train
    from tests.qwen_vl import QWEN_FAMILY, save_qwen_folder, write_qwen_config

    save_qwen_folder(tmp_path / "folder", "qwen3_vl", 3)
    config = write_qwen_config(tmp_path, tmp_path / "folder", 256, 3)
    over = [*RECIPE, "checkpoint.interval=3", f"checkpoint.dir='{tmp_path / 'ckpt'}'"]
    run_ranks(1, train, over, timeout_s=240, config=config)
    assert cli_main(["export", "--format", "peft", str(tmp_path / "ckpt"),
                     str(tmp_path / "peft")]) == 0
    saved = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert any("visual.merger" in m for m in saved["modules_to_save"]), saved
    assert any("deepstack_merger_list" in m for m in saved["modules_to_save"]), saved
    cfg = load_config(config, over)
    tokenizer = build_tokenizer(cfg)
    model = build_mimo_model(cfg, tokenizer.vocab_size,
                             {"vision": tokenizer.placeholder_id("image")})
    tensors, _ = read_full_model(tmp_path / "ckpt")
    model.load_state_dict(tensors, strict=True)
    task, _ = build_datasets(cfg, tokenizer)
    batch = collate(task.stream(cfg.train.seed).samples(24, 8), task.seq_length,
                    pad_id=task.pad_id, image_shape=task.image_shape)
    theirs = peft.PeftModel.from_pretrained(QWEN_FAMILY.load(cfg.hf_path), str(tmp_path / "peft"))
    with torch.no_grad():
        loss_sum, num_tokens, _ = model(batch)
        want = QWEN_FAMILY.loss(theirs, batch)
        untrained = QWEN_FAMILY.loss(QWEN_FAMILY.load(cfg.hf_path), batch)
    assert float(loss_sum / num_tokens) == pytest.approx(float(want), rel=1e-5)
    assert abs(float(want) - float(untrained)) > 1e-4  # what trained is in the export
