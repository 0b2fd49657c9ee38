"""A whole Qwen2.5-VL / Qwen3-VL model from its one folder equals transformers' own.

Tiny random ``Qwen2_5_VLForConditionalGeneration`` and ``Qwen3VLForConditionalGeneration``
(from transformers' config classes, eager attention, fp32, parameters moved off their
constant initial values) are saved with ``save_pretrained``; mimotron's
:class:`~mimotron.models.hf.qwen_vl.QwenVLModel` is built from that folder. One batch
holds, in row 0, two images of different sizes (one not square) and a video, and in
row 1 text, an image and a second video: multi-image, video, different sizes and 3-D
positions at once (Qwen3-VL: a timestamp token before each frame, DeepStack on two
layers). Loss and the gradient of every parameter must agree within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mimotron.models.hf.qwen_vl import QwenVLModel
from tests.qwen_vl import (
    FAMILIES,
    MERGE,
    PATCH,
    TEMPORAL,
    VEND,
    VIDEO,
    VSTART,
    decoder_name,
    save_qwen_folder,
)

transformers = pytest.importorskip("transformers")

IMAGE = 120
# Per row: text lengths and media (kind, (t, h, w) in patches).
ROWS = ((3, ("image", (1, 4, 6)), 2, ("image", (1, 2, 2)), 4, ("video", (2, 4, 4)), 2),
        (5, ("image", (1, 6, 4)), 3, ("video", (2, 2, 4)), 6))
SECONDS = torch.tensor([0.5, 1.0])  # Qwen2.5-VL: seconds per temporal patch, per video


def _save(path: Path, family: str) -> torch.nn.Module:
    return save_qwen_folder(path, family, IMAGE)


def _row(parts: tuple, family: str, gen: torch.Generator) -> tuple[list[int], list, list]:
    ids: list[int] = []
    images, videos = [], []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(1, 100, (part,), generator=gen).tolist()
            continue
        kind, (t, h, w) = part
        frame = h * w // MERGE**2
        if kind == "image":
            ids += [VSTART] + [IMAGE] * t * frame + [VEND]
            images.append((t, h, w))
        elif family == "qwen3_vl":  # a timestamp token before each frame
            for f in range(t):
                ids += [100 + f, VSTART] + [VIDEO] * frame + [VEND]
            videos.append((t, h, w))
        else:
            ids += [VSTART] + [VIDEO] * t * frame + [VEND]
            videos.append((t, h, w))
    return ids, images, videos


def _batch(family: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = [_row(parts, family, gen) for parts in ROWS]
    seq = max(len(ids) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    for r, (row, _, _) in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
    images = torch.tensor([g for _, imgs, _ in rows for g in imgs])
    videos = torch.tensor([g for _, _, vids in rows for g in vids])
    width = 3 * TEMPORAL * PATCH * PATCH
    batch = {"input_ids": ids, "image_grid_thw": images, "video_grid_thw": videos,
             "pixel_values": torch.randn(int(images.prod(-1).sum()), width, generator=gen),
             "pixel_values_videos": torch.randn(int(videos.prod(-1).sum()), width,
                                                generator=gen)}
    if family == "qwen2_5_vl":
        batch["second_per_grid_ts"] = SECONDS
    return batch


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_every_gradient_equal_transformers(tmp_path: Path, family: str) -> None:
    reference = _save(tmp_path / family, family)
    ours = QwenVLModel.from_folder(tmp_path / family)
    batch = _batch(family)
    assert len(batch["image_grid_thw"]) == 3 and len(batch["video_grid_thw"]) == 2
    loss = _loss(ours(**batch), batch["input_ids"])
    loss.backward()
    # The family's processor gives transformers each token's kind (text 0, image 1,
    # video 2): without it transformers falls back to 1-D positions.
    ids = batch["input_ids"]
    kinds = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    want = _loss(reference(**batch, mm_token_type_ids=kinds).logits, ids)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    theirs = dict(reference.named_parameters())
    checked = set()
    for name, param in ours.named_parameters():
        if name.startswith("visual."):
            hf = "model.visual." + ours.visual.weight_map.to_hf(name[len("visual."):])
        else:
            hf = decoder_name(name[len("language_model."):])
        grad = theirs[hf].grad
        assert param.grad is not None and grad is not None, name
        err = float((param.grad.reshape(grad.shape) - grad).norm() / grad.norm())
        assert err <= 1e-5, f"{name}: relative error {err}"
        checked.add(hf)
    assert checked == set(theirs)  # every transformers parameter has its twin


def test_a_folder_of_another_family_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2)).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"model_type='llama' is not a Qwen-VL model"):
        QwenVLModel.from_folder(folder)
