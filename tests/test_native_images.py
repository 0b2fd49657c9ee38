"""NativeImageProcessor against transformers' own Qwen-VL image processor.

The reference is ``transformers``' ``Qwen2VLImageProcessorPil`` loaded from the same
folder with the same pixel bounds: for images of several sizes (one within the bounds,
one larger than ``max_pixels``: resized, not refused; one non-square; one below
``min_pixels``: enlarged; an RGBA and a grey one), the grid read from the header alone,
the patch rows and the grid of the decoded image all equal its ``image_grid_thw`` and
``pixel_values``. A processor file whose patching contradicts the model is one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mimotron.data.native_images import NativeImageProcessor
from tests.hf_data import write_png

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

MIN_PIXELS, MAX_PIXELS = 64, 1024  # patch 2 x merge 2: at least 4 tokens, at most 64
# (width, height, mode): within the bounds; past max_pixels; non-square; below min_pixels;
# transparency and grey converted to RGB.
SIZES = [(20, 12, "RGB"), (90, 70, "RGB"), (37, 9, "RGB"), (3, 5, "RGB"), (14, 22, "RGBA"),
         (16, 16, "L")]
# Qwen2.5-VL's processor file (min/max as top-level keys, as the hub's folders have them)
# and Qwen3-VL's (patch 16, a size dict, mean and std 0.5).
FOLDERS = {
    "qwen2_5_vl": ({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 2,
                    "merge_size": 2, "temporal_patch_size": 2}, (2, 2, 2)),
    "qwen3_vl": ({"size": {"shortest_edge": 65536, "longest_edge": 16777216},
                  "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, (16, 2, 2)),
}


def _folder(root: Path, family: str) -> Path:
    """A folder whose processor file is the family's (saved by transformers)."""
    keys, _ = FOLDERS[family]
    folder = root / family
    transformers.Qwen2VLImageProcessorPil(**keys).save_pretrained(folder)
    return folder


def _reference(folder: Path, low: int, high: int) -> object:
    """transformers' processor of the folder with the run's bounds."""
    return transformers.Qwen2VLImageProcessorPil.from_pretrained(
        folder, size={"shortest_edge": low, "longest_edge": high})


@pytest.mark.parametrize("family", list(FOLDERS))
def test_patches_and_grids_equal_transformers(tmp_path: Path, family: str) -> None:
    folder = _folder(tmp_path, family)
    patch, merge, temporal = FOLDERS[family][1]
    scale = patch // 2  # the sizes above are for patch 2
    low, high = MIN_PIXELS * scale**2, MAX_PIXELS * scale**2
    ours = NativeImageProcessor.from_pretrained(folder, patch, merge, temporal, high, low)
    ref = _reference(folder, low, high)
    assert ours.max_patches == high // patch**2
    assert ours.patch_dim == 3 * temporal * patch**2
    seen = set()
    for k, (width, height, mode) in enumerate(SIZES):
        file = write_png(tmp_path / f"{k}.png", height * scale, width * scale, k, mode)
        with PIL.open(file) as image:
            header = image.size
            image.load()
            patches, grid = ours(image)
            want = ref(images=[image], return_tensors="pt")
        want_grid = tuple(int(v) for v in want["image_grid_thw"][0])
        assert grid == want_grid, (width, height)
        assert ours.grid_for_size(*header) == want_grid
        assert ours.tokens_for_size(*header) == int(want["image_grid_thw"][0].prod()) // merge**2
        torch.testing.assert_close(patches, want["pixel_values"], rtol=0, atol=0)
        assert grid[1] * grid[2] <= ours.max_patches
        assert patches.dtype == torch.float32
        slots = ours.padded(patches)
        assert slots.shape == (ours.max_patches, ours.patch_dim)
        assert torch.equal(slots[:patches.shape[0]], patches)
        assert not slots[patches.shape[0]:].any()
        seen.add(grid)
    # The sizes above do reach both bounds: the big image fills max_pixels, the tiny one
    # was enlarged to min_pixels.
    areas = [g[1] * g[2] * patch**2 for g in seen]
    assert max(areas) <= high and max(areas) > high // 2
    assert min(areas) >= low


def test_bounds_default_to_the_folder(tmp_path: Path) -> None:
    """Without an override the folder's own min/max bound the images."""
    transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2,
                                          min_pixels=32, max_pixels=512
                                          ).save_pretrained(tmp_path)
    ours = NativeImageProcessor.from_pretrained(tmp_path, 2, 2, 2)
    assert (ours.min_pixels, ours.max_pixels, ours.max_tokens) == (32, 512, 32)
    ref = transformers.Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    image = PIL.new("RGB", (300, 100))
    assert ours(image)[1] == tuple(int(v) for v in ref(images=[image])["image_grid_thw"][0])


@pytest.mark.parametrize(("key", "model", "folder"), [
    ("patch_size", (4, 2, 2), 2), ("merge_size", (2, 3, 2), 2),
    ("temporal_patch_size", (2, 2, 1), 2)])
def test_patching_must_match_the_model(tmp_path: Path, key: str, model: tuple, folder: int
                                       ) -> None:
    transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2
                                          ).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        NativeImageProcessor.from_pretrained(tmp_path, *model, max_pixels=1024)
    message = str(err.value)
    assert "\n" not in message
    wanted = dict(zip(("patch_size", "merge_size", "temporal_patch_size"), model,
                      strict=True))[key]
    assert f"{key}={folder}" in message and f"={wanted}" in message


def test_bad_sizes_are_one_line(tmp_path: Path) -> None:
    transformers.Qwen2VLImageProcessorPil(patch_size=2, merge_size=2, temporal_patch_size=2
                                          ).save_pretrained(tmp_path)
    ours = NativeImageProcessor.from_pretrained(tmp_path, 2, 2, 2, MAX_PIXELS, MIN_PIXELS)
    with pytest.raises(ValueError, match="aspect ratio"):
        ours.grid_for_size(4000, 10)
    with pytest.raises(ValueError, match="positive size"):
        ours.tokens_for_size(0, 10)
    with pytest.raises(ValueError, match="max_pixels=8"):
        NativeImageProcessor.from_pretrained(tmp_path, 2, 2, 2, max_pixels=8)
    with pytest.raises(ValueError, match=r"expected \[n <= 3"):
        ours.padded(torch.zeros(4, ours.patch_dim), 3)
