"""A Qwen2.5-VL / Qwen3-VL folder trained by the engine, against transformers' own model.

One folder in (``hf_path`` at the top of the config): a ``vision`` module (the tower and
its merger, at native resolution: every image its own token count) and a ``language``
module (M-RoPE; Qwen3-VL's first layers add the DeepStack features). The data are random
native-resolution samples (``data.dataset = "mock"``: images of random grids, text-only
samples between them), so a micro-batch mixes images of different sizes.

* One process: ``MimoModel``'s loss and every parameter's gradient equal transformers' on
  a batch of two samples holding three images of different sizes (fp32, 1e-5).
* Layouts: 10 iterations at a real learning rate, split (vision DP 2 | language TP 2;
  language CP 2; language PP 2, for Qwen3-VL with both DeepStack layers on the first
  stage; spread over stages: ``test_deepstack_stages``) and colocated (vision DP 2 with
  language TP 2 with encoder batching and the tower recomputed, and for Qwen3-VL with
  the tower frozen but its mergers; with language CP 2; with language PP 2, the second
  stage holding Qwen3-VL's second DeepStack layer): losses, grad norms and final
  weights equal the plain loop on transformers' model
  (:func:`tests.hf_vlm.hf_reference_run`).
* Layouts the towers cannot run are one line before launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimotron.config import load_config
from mimotron.config.hf_folder import read_hf_config
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.data.native_batch import stack_native
from mimotron.models.build import build_mimo_model
from tests.hf_vlm import hf_reference_run, run_layouts
from tests.qwen_vl import (
    FAMILIES,
    MERGE,
    PATCH,
    QWEN_FAMILY,
    TEMPORAL,
    qwen_hf_name,
    save_qwen_folder,
    write_qwen_config,
)

transformers = pytest.importorskip("transformers")

IMAGE_ID = 3  # the character tokenizer's <image>: the folder's image_token_id
NUM_ITERS = 10
MAX_PIXELS = 256  # 16 token slots per image at patch 2, merge 2


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, object]:
    root = tmp_path_factory.mktemp(request.param)
    model = save_qwen_folder(root / "folder", request.param, IMAGE_ID)
    return {"family": request.param, "root": root, "folder": root / "folder",
            "model": model,
            "config": write_qwen_config(root, root / "folder", MAX_PIXELS, NUM_ITERS)}


def _batch(folder: Path, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], list]:
    """Two samples: three images of different sizes (two in the first), text around."""
    rows = (((1, 4, 6), (1, 2, 2)), ((1, 6, 4),))
    rule = MRopeRule.from_hf_config(read_hf_config(folder))
    width, samples, grids = 3 * TEMPORAL * PATCH**2, [], []
    for images in rows:
        ids, tokens, patches = [1], [], []
        for grid in images:
            count = grid[1] * grid[2] // MERGE**2
            ids += [IMAGE_ID] * count + torch.randint(5, 100, (3,), generator=gen).tolist()
            tokens.append(count)
            patches.append(torch.zeros(MAX_PIXELS // PATCH**2, width))
            patches[-1][:grid[1] * grid[2]] = torch.randn(grid[1] * grid[2], width,
                                                          generator=gen)
            grids.append(grid)
        row = torch.tensor(ids)
        samples.append({"tokens": row, "image": torch.stack(patches),
                        "image_grid": torch.tensor(images), "image_tokens": torch.tensor(tokens),
                        "position_ids": mrope_positions(row[None], rule, torch.tensor(
                            images))[0][:, 0]})
    seq = max(len(s["tokens"]) for s in samples)
    batch = stack_native(samples, seq)
    batch["tokens"] = torch.stack([torch.nn.functional.pad(s["tokens"], (0, seq - len(
        s["tokens"]))) for s in samples])
    batch["image"] = torch.stack([torch.nn.functional.pad(s["image"], (0, 0, 0, 0, 0, 2 - len(
        s["image"]))) for s in samples])
    batch["has_image"] = batch["image_tokens"] > 0
    batch["labels"] = torch.roll(batch["tokens"], -1, 1)
    batch["loss_mask"] = (batch["tokens"] != 0).float()
    batch["loss_mask"][:, -1] = 0
    return batch, grids


def test_loss_and_every_gradient_equal_transformers(qwen: dict) -> None:
    cfg = load_config(qwen["config"])
    model = build_mimo_model(cfg, 128, {"vision": IMAGE_ID})
    batch, grids = _batch(qwen["folder"], torch.Generator().manual_seed(0))
    assert batch["image_tokens"].tolist() == [[6, 1], [6, 0]]  # sizes differ per image
    loss_sum, num_tokens, _ = model(batch)
    (loss_sum / num_tokens).backward()
    reference = qwen["model"]
    reference.zero_grad()
    pixels = torch.cat([batch["image"][0, 0, :24], batch["image"][0, 1, :4],
                        batch["image"][1, 0, :24]])
    logits = reference(input_ids=batch["tokens"], pixel_values=pixels,
                       image_grid_thw=torch.tensor(grids),
                       mm_token_type_ids=(batch["tokens"] == IMAGE_ID).long()).logits
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                               reduction="none")
    want = (losses * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()
    want.backward()
    assert float(loss_sum / num_tokens) == pytest.approx(float(want), rel=1e-5)
    theirs = dict(reference.named_parameters())
    checked = set()
    for name, param in model.named_parameters():
        hf = qwen_hf_name(name, reference)
        grad = theirs[hf].grad
        err = float((param.grad.reshape(grad.shape) - grad).norm() / grad.norm())
        assert err <= 1e-5, f"{name}: relative error {err}"
        checked.add(hf)
    assert checked == set(theirs)


_LAYOUTS = {
    "vision DP 2 | language TP 2": (4, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
        "modules.language.parallel.rank_offset=2"]),
    "vision | language CP 2": (3, [
        "modules.language.parallel.context=2", "modules.language.parallel.rank_offset=1"]),
    # Colocated vision DP 2 with language TP 2 (without the two options: the frozen test).
    "colocated, encoder batching": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
        "train.encoder_batching=true", "modules.vision.recompute='full'"]),
    "colocated vision DP 2, language CP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.context=2"]),
    "vision | language PP 2": (3, [
        "modules.language.parallel.pipeline=2", "modules.language.parallel.rank_offset=1",
        "modules.language.parallel.layers_per_stage=[2, 1]"]),
    # Colocated with a pipelined language model: the tower on both ranks, then the stages.
    "colocated vision DP 2, language PP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.pipeline=2",
        "modules.language.parallel.layers_per_stage=[1, 2]"]),
}


def test_layouts_train_like_a_plain_loop_on_transformers(qwen: dict) -> None:
    """10 iterations at a real learning rate: losses, grad norms, final weights."""
    ref = hf_reference_run(qwen["config"], NUM_ITERS, family=QWEN_FAMILY)
    assert ref.losses[-1] < ref.losses[0] - 0.3, ref.losses
    runs = run_layouts(qwen["config"], ref, _LAYOUTS, NUM_ITERS, timeout_s=400)
    for layout, merged in runs.items():
        assert set(merged) == set(ref.weights), layout
    for name, want in ref.weights.items():
        assert not torch.equal(want, ref.initial[name]), name


# The language model's own options, with DeepStack (Qwen3-VL) in the first layers:
# sequence parallelism (the features added to sequence-sharded rows) and FSDP.
_LANGUAGE_OPTIONS = {
    "vision | language TP 2 with sequence parallelism": (3, [
        "modules.language.parallel.tensor=2", "modules.language.parallel.sequence_parallel=true",
        "modules.language.parallel.rank_offset=1"]),
    "colocated vision DP 2, language FSDP 2": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.data=2",
        "modules.language.parallel.fsdp=true"]),
}


@pytest.mark.parametrize("qwen", ["qwen3_vl"], indirect=True)
def test_language_options_train_like_a_plain_loop_on_transformers(qwen: dict) -> None:
    """10 iterations: losses, grad norms, final weights (as the layouts above)."""
    ref = hf_reference_run(qwen["config"], NUM_ITERS, family=QWEN_FAMILY)
    run_layouts(qwen["config"], ref, _LANGUAGE_OPTIONS, NUM_ITERS, timeout_s=400)


@pytest.mark.parametrize("qwen", ["qwen3_vl"], indirect=True)  # both kinds of merger
def test_a_frozen_tower_trains_its_mergers_like_the_plain_loop(qwen: dict) -> None:
    """``freeze = "encoder"``: the tower stops, its patch mergers (the projector: the
    final one and DeepStack's) train. Colocated vision DP 2 with language TP 2."""
    freeze = ("modules.vision.freeze='encoder'",)
    ref = hf_reference_run(qwen["config"], NUM_ITERS, freeze, family=QWEN_FAMILY)
    over = ["modules.vision.parallel.data=2", "modules.language.parallel.tensor=2", *freeze]
    merged = run_layouts(qwen["config"], ref, {"frozen tower": (2, over)}, NUM_ITERS
                         )["frozen tower"]
    trained = {n for n in ref.weights if ".vision." in n}
    assert trained and all("merger" in n for n in trained), sorted(trained)
    frozen = set(merged) - set(ref.weights)
    assert frozen and all(".vision.encoder." in n and "merger" not in n for n in frozen)
    loaded = dict(qwen["model"].named_parameters())
    for name in frozen:  # as loaded from the folder
        want = loaded[qwen_hf_name(name, qwen["model"])]
        assert torch.equal(merged[name].reshape(want.shape), want), name


@pytest.mark.parametrize(("override", "message"), [
    ("modules.vision.parallel.tensor=2", r"modules.vision.parallel.tensor=2 is not supported"),
    ("modules.vision.parallel.pipeline=2", r"modules.vision.parallel.pipeline=2 is not "),
    ("modules.vision.max_pixels=8", r"modules.vision.max_pixels=8 is invalid"),
])
def test_a_layout_the_tower_cannot_run_is_one_line(qwen: dict, override: str, message: str
                                                   ) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(qwen["config"], [override])


def test_the_slots_follow_max_pixels(qwen: dict) -> None:
    vision = load_config(qwen["config"]).modules["vision"]
    assert vision.num_output_tokens == MAX_PIXELS // (PATCH * MERGE) ** 2 == 16
    assert vision.hf_native.max_patches == 64 and vision.hf_native.patch_dim == 24
    assert load_config(qwen["config"], ["modules.vision.max_pixels=0", "data.seq_length=264"]
                       ).modules[
        "vision"].num_output_tokens == 4096 // 16  # the folder's processor bound


def test_max_pixels_without_a_qwen_folder_is_refused() -> None:
    with pytest.raises(ValueError, match=r"modules.vision.max_pixels=64 applies to a "
                                         r"Qwen2.5-VL / Qwen3-VL vision module only"):
        load_config(Path(__file__).resolve().parents[1] / "configs" / "digits.toml",
                    ["modules.vision.max_pixels=64"])


def test_stack_native_pads_items_and_positions() -> None:
    """The native keys the reference and the engine both read, stacked by hand."""
    one = {"image_grid": torch.tensor([1, 2, 4]), "image_tokens": torch.tensor(2),
           "position_ids": torch.arange(6).expand(3, 6)}
    none = {"image_grid": torch.zeros(3, dtype=torch.long), "image_tokens": torch.tensor(0),
            "position_ids": torch.zeros(3, 4, dtype=torch.long)}
    batch = stack_native([one, none], 8)
    assert batch["image_grid"].tolist() == [[1, 2, 4], [0, 0, 0]]
    assert batch["image_tokens"].tolist() == [2, 0]
    assert batch["position_ids"].shape == (2, 3, 8)
    assert batch["position_ids"][0, 1].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    two = {"image_grid": torch.tensor([[1, 2, 2], [1, 4, 2]]), "image_tokens": torch.tensor(
        [1, 2]), "position_ids": torch.zeros(3, 2, dtype=torch.long)}
    multi = stack_native([two, one], 8)  # several images per sample: [B, K, ...]
    assert multi["image_grid"].tolist() == [[[1, 2, 2], [1, 4, 2]], [[1, 2, 4], [0, 0, 0]]]
    assert multi["image_tokens"].tolist() == [[1, 2], [2, 0]]
    assert stack_native([{"tokens": torch.ones(2), "position_ids": torch.arange(2)}], 8) == {}
    with pytest.raises(ValueError, match=r"position_ids of shape \(3, 9\)"):
        stack_native([{**one, "position_ids": torch.zeros(3, 9)}], 8)


def test_an_empty_block_has_the_dtype_of_a_full_one(qwen: dict) -> None:
    """Under bf16 autocast a rank without images sends what the others send: the language
    side joins replicas' blocks, and one fp32 block would turn the gradient fp32."""
    cfg = load_config(qwen["config"])
    vision = build_mimo_model(cfg, 128, {"vision": IMAGE_ID}).modality_submodules["vision"]
    patches = torch.randn(1, 64, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = vision(patches, torch.tensor([[1, 2, 2]]))
        empty = vision(patches[:0], torch.zeros(0, 3, dtype=torch.long))
    assert full.dtype == empty.dtype == torch.bfloat16
    assert empty.shape == (0, *full.shape[1:]) and empty.requires_grad


# Images dealt to the tower's DP replicas by their cost (data.balance_encoders) and
# samples to the language replicas by their tokens (data.balance_tokens): who computes
# changes, the math does not; DeepStack features travel with the items (Qwen3-VL).
_BALANCED = {
    "vision DP 2 | language DP 2, balanced": (4, [
        "modules.vision.parallel.data=2", "modules.language.parallel.data=2",
        "modules.language.parallel.rank_offset=2", "data.balance_encoders=true",
        "data.balance_tokens=true"]),
    "colocated vision DP 2, language TP 2, balanced": (2, [
        "modules.vision.parallel.data=2", "modules.language.parallel.tensor=2",
        "data.balance_encoders=true"]),
}


def test_balanced_layouts_train_like_a_plain_loop_on_transformers(qwen: dict) -> None:
    """10 iterations with balancing on: losses, grad norms, final weights."""
    ref = hf_reference_run(qwen["config"], NUM_ITERS, family=QWEN_FAMILY)
    run_layouts(qwen["config"], ref, _BALANCED, NUM_ITERS, timeout_s=400)
