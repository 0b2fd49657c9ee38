"""Videos through a Qwen2.5-VL / Qwen3-VL folder, against transformers' own model.

A native vision module's items are a sample's images and videos in the order of their
placeholders (:mod:`mimotron.data.native_video`): a video is one item whose grid has
``t > 1`` temporal patches, its positions are the family's video positions (computed
from the true ids on the host), and the row the engine sees holds the image placeholder
at its positions. transformers' model gets what its processor gives: the video
placeholder ids, ``pixel_values_videos``, ``video_grid_thw`` (and for Qwen2.5-VL
``second_per_grid_ts``). Loss and every parameter's gradient agree (fp32, 1e-5), for a
batch mixing an image and videos of different sizes, and for Qwen3-VL's videos as
per-frame runs with text between them, as its processor writes them.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.config.hf_folder import read_hf_config
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.data.native_batch import stack_native
from mimotron.models.build import build_mimo_model
from tests.qwen_vl import (
    FAMILIES,
    MERGE,
    PATCH,
    TEMPORAL,
    VIDEO,
    qwen_hf_name,
    save_qwen_folder,
    write_qwen_config,
)

transformers = pytest.importorskip("transformers")

IMAGE_ID = 3
MAX_PIXELS = 256  # 64 patch rows per item: a (2, 4, 4) video holds 32
SECONDS = 0.5  # Qwen2.5-VL: seconds between a video's temporal patches


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, object]:
    root = tmp_path_factory.mktemp(request.param)
    model = save_qwen_folder(root / "folder", request.param, IMAGE_ID)
    return {"family": request.param, "folder": root / "folder", "model": model,
            "config": write_qwen_config(root, root / "folder", MAX_PIXELS, 10)}


def _runs(family: str, grid: tuple[int, int, int], kind: int, gen: torch.Generator
          ) -> list[int]:
    """The ids of one medium as the family's processor writes them (text around)."""
    t, h, w = grid
    frame = [kind] * (h * w // MERGE**2)
    text = torch.randint(5, 100, (2,), generator=gen).tolist()
    if kind == IMAGE_ID or family == "qwen2_5_vl":  # one run
        return frame * t + text
    return [x for _ in range(t) for x in (*text, *frame)] + text  # Qwen3-VL: per frame


def _batch(qwen: dict, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], dict]:
    """Sample 0: an image then a 2-step video; sample 1: a 3-step video of another size."""
    family, folder = qwen["family"], qwen["folder"]
    rows = (((1, 4, 6), IMAGE_ID), ((2, 4, 4), VIDEO)), (((3, 2, 4), VIDEO),)
    rule = MRopeRule.from_hf_config(read_hf_config(folder))
    width, samples = 3 * TEMPORAL * PATCH**2, []
    media = {IMAGE_ID: ([], []), VIDEO: ([], [])}
    for items in rows:
        ids, patches = [1], []
        for grid, kind in items:
            ids += _runs(family, grid, kind, gen)
            rows_of = torch.randn(grid[0] * grid[1] * grid[2], width, generator=gen)
            media[kind][0].append(rows_of)
            media[kind][1].append(grid)
            patches.append(torch.cat([rows_of, rows_of.new_zeros(
                MAX_PIXELS // PATCH**2 - len(rows_of), width)]))
        true = torch.tensor(ids)
        grids = {k: torch.tensor([g for g, kind in items if kind == k]).reshape(-1, 3)
                 for k in (IMAGE_ID, VIDEO)}
        videos = grids[VIDEO] if len(grids[VIDEO]) else None
        positions = mrope_positions(
            true[None], rule, grids[IMAGE_ID] if len(grids[IMAGE_ID]) else None, videos,
            second_per_grid_ts=None if videos is None else torch.full((len(videos),), SECONDS)
        )[0][:, 0]
        samples.append({"true": true, "tokens": torch.where(true == VIDEO, IMAGE_ID, true),
                        "image": torch.stack(patches),
                        "image_grid": torch.tensor([g for g, _ in items]),
                        "image_tokens": torch.tensor([g[0] * g[1] * g[2] // MERGE**2
                                                      for g, _ in items]),
                        "position_ids": positions})
    seq = max(len(s["tokens"]) for s in samples)
    batch = stack_native(samples, seq)
    pad = [torch.nn.functional.pad(s["true"], (0, seq - len(s["true"]))) for s in samples]
    batch["true"] = torch.stack(pad)
    batch["tokens"] = torch.where(batch["true"] == VIDEO, IMAGE_ID, batch["true"])
    batch["image"] = torch.stack([torch.nn.functional.pad(s["image"], (0, 0, 0, 0, 0, 2 - len(
        s["image"]))) for s in samples])
    batch["has_image"] = batch["image_tokens"] > 0
    batch["labels"] = torch.roll(batch["tokens"], -1, 1)
    batch["loss_mask"] = ((batch["tokens"] != 0) & (batch["tokens"] != IMAGE_ID)).float()
    batch["loss_mask"][:, -1] = 0
    return batch, media


def _transformers_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], media: dict
                       ) -> torch.Tensor:
    true = batch["true"]
    kinds = torch.where(true == IMAGE_ID, 1, torch.where(true == VIDEO, 2, 0))
    videos = torch.tensor(media[VIDEO][1])
    extra = ({"second_per_grid_ts": torch.full((len(videos),), SECONDS)}
             if model.config.model_type == "qwen2_5_vl" else {})
    logits = model(input_ids=true, pixel_values=torch.cat(media[IMAGE_ID][0]),
                   image_grid_thw=torch.tensor(media[IMAGE_ID][1]),
                   pixel_values_videos=torch.cat(media[VIDEO][0]), video_grid_thw=videos,
                   mm_token_type_ids=kinds, **extra).logits
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                               reduction="none")
    return (losses * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()


def test_video_loss_and_every_gradient_equal_transformers(qwen: dict) -> None:
    cfg = load_config(qwen["config"])
    model = build_mimo_model(cfg, 128, {"vision": IMAGE_ID})
    batch, media = _batch(qwen, torch.Generator().manual_seed(0))
    assert batch["image_tokens"].tolist() == [[6, 8], [6, 0]]
    assert (batch["true"] == VIDEO).sum() == 14 and not (batch["tokens"] == VIDEO).any()
    loss_sum, num_tokens, _ = model(batch)
    (loss_sum / num_tokens).backward()
    reference = qwen["model"]
    reference.zero_grad()
    want = _transformers_loss(reference, batch, media)
    want.backward()
    assert float(loss_sum.detach() / num_tokens) == pytest.approx(float(want), rel=1e-5)
    theirs = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        grad = theirs[qwen_hf_name(name, reference)].grad
        err = float((param.grad.reshape(grad.shape) - grad).norm() / grad.norm())
        assert err <= 1e-5, f"{name}: relative error {err}"


def test_video_positions_follow_the_family(qwen: dict) -> None:
    """What the check above relies on: Qwen2.5-VL places a video's temporal steps by
    seconds (not as an image's), Qwen3-VL places each frame as an image of one frame."""
    batch, _ = _batch(qwen, torch.Generator().manual_seed(0))
    rule = MRopeRule.from_hf_config(read_hf_config(qwen["folder"]))
    grids = batch["image_grid"][batch["has_image"].bool()]
    mask = {"attention_mask": batch["tokens"] != 0}  # pads: position 0, as batched
    if qwen["family"] == "qwen3_vl":
        frames = torch.cat([torch.tensor([[1, h, w]] * t) for t, h, w in grids.tolist()])
        as_images = mrope_positions(batch["tokens"], rule, frames, **mask)[0]
        assert torch.equal(as_images.transpose(0, 1), batch["position_ids"])
    else:
        as_images = mrope_positions(batch["tokens"], rule, grids, **mask)[0]
        assert not torch.equal(as_images.transpose(0, 1), batch["position_ids"])
