"""``mimotron plan``'s memory estimate, the FLOP count and the dry run of native-resolution
(Qwen2.5-VL / Qwen3-VL) runs.

A Qwen tower runs on each image's real patch rows, so what it saves and computes
follows the data's patch counts, not the ``max_tokens`` slots:

* what a tower keeps per patch row (:func:`~mimotron.estimate.native_memory.
  tower_bytes_per_patch`) equals what its forward leaves alive, for both families,
  without recompute, under ``full`` and ``selective`` recompute and frozen (whole or
  all but the mergers), on tiny towers (fp32 weights, bf16 autocast, real tensors);
* the tower's FLOP count (:func:`~mimotron.estimate.native_flops.tower_flops`) equals
  torch's own count of the matmuls a forward runs (``FlopCounterMode``), windows,
  frames and a two-frame medium included;
* the mock data's grids follow the law the estimates read (:func:`~mimotron.data.
  native_mock.grid_distribution`), and :meth:`~mimotron.data.native_mock.NativeMockTask.
  image_grid` is the grid of the sample :meth:`get` makes;
* at Qwen2.5-VL-7B's shape (its ``config.json``, 2 language and 2 tower layers, no
  weights) on 8 ranks with mock images of mixed sizes up to ``max_pixels = 1003520``,
  the estimate is within 0.85-1.15 of the peak the fake-device tracker measures
  (:func:`~mimotron.dryrun.memory_peak.measure_peak`) on the vision replicas holding
  the most and the fewest patch rows and on the language ranks they feed;
* the dry run runs a colocated Qwen3-VL layout (the bridge's gathers carry each rank's
  presence mask; DeepStack features ride in the block) and ``mimotron plan`` says which
  image counts it used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.recompute import kept_bytes
from mimotron.config import load_config
from mimotron.config.hf_resolve import tower_kwargs
from mimotron.data import build_datasets
from mimotron.data.native_mock import IMAGE_SHARE, grid_distribution
from mimotron.data.run_data import build_tokenizer
from mimotron.estimate.flops import model_flops_per_iteration
from mimotron.estimate.image_counts import grid_stats, held_images, image_stats, window_units
from mimotron.estimate.native_flops import tower_flops
from mimotron.estimate.native_memory import tower_bytes_per_patch
from mimotron.models.build import build_module
from mimotron.models.freeze import freeze_part
from mimotron.models.recompute import apply_recompute
from mimotron.parallel.layout import check_layout
from tests.qwen_vl import FAMILIES

transformers = pytest.importorskip("transformers")

BAND = (0.85, 1.15)


def _tiny_folder(root: Path, family: str, max_pixels: int = 1024) -> Path:
    """A config-only folder of ``family`` at tests/qwen_vl.py's toy sizes, and a run
    config of it on mock data (bf16)."""
    prefix, text, vision = FAMILIES[family]
    folder = root / family
    getattr(transformers, f"{prefix}Config")(
        text_config=dict(text), vision_config=dict(vision), image_token_id=3,
        video_token_id=121, vision_start_token_id=122, vision_end_token_id=123,
    ).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 16,
         "max_pixels": 4096}))
    (folder / "run.toml").write_text(f"""
hf_path = "{folder}"
[modules.vision]
max_pixels = {max_pixels}
[data]
dataset = "mock"
seq_length = {max_pixels // 16 + 24}
mock_num_samples = 64
[train]
iters = 2
global_batch_size = 8
micro_batch_size = 4
precision = "bf16"
[log]
dir = "{folder / 'runs'}"
""")
    return folder / "run.toml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen")
    return {family: _tiny_folder(root, family) for family in FAMILIES}


# ---- the mock data's grids ---------------------------------------------------------------


def test_mock_grids_follow_the_law_the_estimates_read(tiny: dict[str, Path]) -> None:
    cfg = load_config(tiny["qwen2_5_vl"])
    task, _ = build_datasets(cfg, build_tokenizer(cfg))
    vision = cfg.modules["vision"].hf_native
    grids, probs = grid_distribution(vision)
    assert probs.sum() == pytest.approx(1.0)
    assert (grids[:, 1] * grids[:, 2] // vision.merge_size**2 <= vision.max_tokens).all()
    for index in range(24):  # the grid of the sample get() makes, no pixels drawn
        sample = task.get(index, 1)
        grid = task.image_grid(index, 1)
        assert (grid is None) == (not sample["has_image"])
        if grid is not None:
            assert tuple(sample["image_grid"].tolist()) == grid
    drawn = [task.image_grid(i % len(task), i // len(task)) for i in range(6000)]
    images = [g for g in drawn if g is not None]
    share, n = len(images) / len(drawn), len(drawn)
    assert abs(share - IMAGE_SHARE) < 4 * (IMAGE_SHARE * (1 - IMAGE_SHARE) / n) ** 0.5
    patches = np.array([g[1] * g[2] for g in images], dtype=float)
    law = grids[:, 1] * grids[:, 2]
    mean = float(probs @ law)
    std = float(probs @ (law - mean) ** 2) ** 0.5
    assert abs(patches.mean() - mean) < 4 * std / len(images) ** 0.5, (patches.mean(), mean)


# ---- what a tower keeps per patch row -----------------------------------------------------

_MODES = {"none": [], "full": ["modules.vision.recompute='full'"],
          "selective": ["modules.vision.recompute='selective'"],
          "mergers train": ["modules.vision.freeze='encoder'"],
          "frozen": ["modules.vision.freeze=true"]}


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_tower_keeps_the_estimated_bytes_per_patch_row(tiny: dict[str, Path], family: str,
                                                         mode: str) -> None:
    """Alive after the forward: what it saved for backward and its output. Two batches of
    two images differing in patch rows only (same count of images and frames): the
    difference is the per-row bytes, weights' casts and per-image terms cancelling."""
    cfg = load_config(tiny[family], _MODES[mode])
    mod = cfg.modules["vision"]
    torch.manual_seed(0)
    part = build_module(cfg, "vision", 128, init=False)
    if mod.freeze:
        freeze_part(part, mod)
    apply_recompute(part, mod.recompute, mod.recompute_num_layers)

    def run(grid: list[tuple[int, int, int]]) -> object:
        x = torch.randn(sum(t * h * w for t, h, w in grid), mod.hf_native.patch_dim)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return part.encoder(x, grid)

    small, large = [(1, 8, 12), (1, 4, 4)], [(1, 16, 12), (1, 4, 8)]
    measured = (kept_bytes(lambda: run(large)) - kept_bytes(lambda: run(small))) / 112
    args = tower_kwargs(mod)
    outputs = 1 + len(args.get("deepstack_visual_indexes") or ())
    output = 2 * args["out_hidden_size"] * outputs / mod.hf_native.merge_size**2
    # The CPU runs attention segment by segment (the accelerator's bf16 path: varlen).
    estimate = tower_bytes_per_patch(cfg, "vision", kernel="segments") + output
    # Left out: Qwen3-VL's position-table taps (per row and column of a frame: 2.7 bytes
    # a row here) and the window boundaries a recomputed layer keeps (int32 per window).
    assert measured == pytest.approx(estimate, abs=3), (measured, estimate)
    if mode == "none":
        assert tower_bytes_per_patch(cfg, "vision") < tower_bytes_per_patch(
            cfg, "vision", kernel="segments")  # varlen keeps attention's output once


# ---- FLOPs --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tower_flops_equal_the_matmuls_a_forward_runs(tiny: dict[str, Path],
                                                      family: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_config(tiny[family])
    mod = cfg.modules["vision"]
    tower = build_module(cfg, "vision", 128, init=False).encoder
    # Windows cut at the frame's edges, a small image, a two-frame medium.
    grid = [(1, 8, 12), (1, 4, 4), (2, 6, 10)]
    x = torch.randn(sum(t * h * w for t, h, w in grid), mod.hf_native.patch_dim)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        tower(x, grid)
    stats = grid_stats(grid, mod.hf_native.merge_size, window_units(mod))
    assert tower_flops(mod, stats, len(grid)) == counter.get_total_flops()


def test_iteration_flops_count_the_data_images(tiny: dict[str, Path]) -> None:
    """The mock data's expected grid (a trained tower: x3); the caller's real grids
    replace it; without per-image counts the max_pixels bound is used."""
    cfg = load_config(tiny["qwen2_5_vl"])
    mod = cfg.modules["vision"]
    expected = image_stats(cfg, "vision")
    vision = mod.hf_native
    grids, probs = grid_distribution(vision)
    assert expected.patches == pytest.approx(float(probs @ (grids[:, 1] * grids[:, 2])))
    flops = model_flops_per_iteration(cfg, 128, {"vision": 5})
    assert flops["vision"] == pytest.approx(3 * tower_flops(mod, expected, 5))
    real = grid_stats([(1, 4, 8)], vision.merge_size, window_units(mod))
    given = model_flops_per_iteration(cfg, 128, {"vision": 5}, native_stats={"vision": real})
    assert given["vision"] == pytest.approx(3 * tower_flops(mod, real, 5))
    cfg.data.dataset = "llava"  # no per-image counts: every image at max_pixels
    bound = image_stats(cfg, "vision")
    assert bound.patches == vision.max_patches and bound.frame_square == vision.max_patches**2
    assert model_flops_per_iteration(cfg, 128, {"vision": 5})["vision"] > flops["vision"]


def test_held_images_are_the_samples_the_plan_holds(tiny: dict[str, Path]) -> None:
    """Vision DP 2 on its own ranks holds both micro-batches of a step at its peak: the
    patch rows of its half of each, read from the samples themselves."""
    cfg = load_config(tiny["qwen2_5_vl"], [
        "modules.vision.parallel.data=2", "modules.language.parallel.rank_offset=2"])
    layout = check_layout(cfg)
    task, _ = build_datasets(cfg, build_tokenizer(cfg))
    order = task.stream(cfg.train.seed).items(0, 16)
    for dp, (lo, hi) in enumerate([(0, 2), (2, 4)]):
        for step in (0, 1):
            samples = [task.get(*order[step * 8 + j * 4 + i]) for j in (0, 1)
                       for i in range(lo, hi)]
            held = held_images(cfg, layout, "vision", 0, dp, 1.0, 0.0, range(step, step + 1))
            assert held.patches == sum(int(s["image_grid"].prod()) for s in samples)
            assert held.images == sum(bool(s["has_image"]) for s in samples)
            assert held.step_slots == 4
    cfg.data.dataset = "llava"  # the bound: every slot full
    held = held_images(cfg, layout, "vision", 0, 0, 1.0, 0.0)
    assert (held.patches, held.images) == (4 * cfg.modules["vision"].hf_native.max_patches, 4)


# ---- the dry run and the plan --------------------------------------------------------------


def test_the_dry_run_runs_a_colocated_native_layout(tiny: dict[str, Path]) -> None:
    """Vision DP 2 and language TP 2 on the same 2 ranks: the bridge all-gathers each
    rank's presence mask, whose host values the tracker carries to the gathered copies
    (the row counts the bridge pads to)."""
    from mimotron.dryrun import dry_run

    cfg = load_config(tiny["qwen3_vl"], ["modules.vision.parallel.data=2",
                                     "modules.language.parallel.tensor=2",
                                     "modules.vision.max_pixels=256"])  # few windows
    reports = dry_run(cfg, evaluate=False, checkpoint=False)
    assert [r.modules for r in reports] == [["language", "vision"]] * 2


def test_plan_says_which_image_counts_it_used(tiny: dict[str, Path],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from mimotron.cli.plan import run_plan

    assert run_plan(str(tiny["qwen3_vl"]), ["modules.vision.parallel.data=2",
                                            "modules.language.parallel.rank_offset=2"]) == 0
    out = capsys.readouterr().out
    assert ("native-resolution images (vision): activations count the mock data's grids "
            "(steps 1-2, the largest held micro-batches)") in out
    assert "patch rows/images held at the peak, per data-parallel replica: " in out
    assert "FLOPs count the mock data's expected grid" in out


# ---- Qwen2.5-VL-7B on 8 ranks: the estimate against the tracker ---------------------------

QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
    "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 128000,
    "max_window_layers": 28, "model_type": "qwen2_5_vl", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
        "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
        "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
        "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
"""``config.json`` of Qwen/Qwen2.5-VL-7B-Instruct."""
QWEN25_VL_PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                       "temporal_patch_size": 2, "merge_size": 2,
                       "image_processor_type": "Qwen2VLImageProcessor"}

# Vision DP 4 | language DP 4 (each language replica fed by one vision replica), one
# sample per replica and micro-batch, 2 micro-batches: each vision rank holds both.
LAYOUT_7B = ["modules.vision.parallel.data=4", "modules.language.parallel.data=4",
             "modules.language.parallel.rank_offset=4"]


def _qwen25_vl_7b(root: Path) -> Path:
    """The 7B folder (config files only) cut to 2 language and 2 tower layers, both
    tower layers full-attention: a window layer saves what a full one does (the
    per-row test above), and the dry run's per-window attention would cost seconds."""
    folder = root / "qwen2_5_vl_7b"
    folder.mkdir()
    config = json.loads(json.dumps(QWEN25_VL_7B))
    config["num_hidden_layers"] = 2
    config["vision_config"].update(depth=2, fullatt_block_indexes=[0, 1])
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(QWEN25_VL_PROCESSOR))
    run = folder / "run.toml"
    run.write_text(f"""
hf_path = "{folder}"
[modules.vision]
max_pixels = 1003520
[data]
dataset = "mock"
seq_length = 2048
mock_num_samples = 64
[train]
iters = 2
global_batch_size = 8
micro_batch_size = 4
precision = "bf16"
[log]
dir = "{folder / 'runs'}"
""")
    return run


def test_qwen25_vl_7b_estimate_within_band_of_the_measured_peak(tmp_path: Path) -> None:
    from mimotron.config.vocab_size import padded_vocab_size
    from mimotron.dryrun.memory_peak import measure_peak
    from mimotron.estimate.memory import estimate_memory

    cfg = load_config(_qwen25_vl_7b(tmp_path), LAYOUT_7B)
    layout = check_layout(cfg)
    vocab = padded_vocab_size(build_tokenizer(cfg).vocab_size)
    # Mixed sizes: the vision replicas hold different patch rows, none all slots full.
    vision = cfg.modules["vision"].hf_native
    held = [held_images(cfg, layout, "vision", 0, d, 1.0, 0.0, range(1, 2)).patches
            for d in range(4)]
    assert len(set(held)) > 1 and max(held) < 2 * vision.max_patches, held
    # Measured: the replicas holding the most and the fewest rows, and the language ranks
    # they feed (the other replicas differ from these only in their images).
    extremes = [held.index(max(held)), held.index(min(held))]
    ranks = [*extremes, *(4 + d for d in extremes)]
    # The tracker reports the second step's peak: the estimate reads that step's images.
    estimate = estimate_memory(cfg, layout, vocab, ranks, image_steps=range(1, 2))
    peaks = measure_peak(cfg, ranks)
    ratios = {r: sum(e.total for e in estimate[r]) / peaks[r].peak for r in ranks}
    assert all(BAND[0] <= x <= BAND[1] for x in ratios.values()), (
        ratios, {r: p.format() for r, p in peaks.items()})
