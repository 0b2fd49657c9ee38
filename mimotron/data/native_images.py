"""Images at their native resolution for a Qwen2.5-VL / Qwen3-VL tower: patches and grids.

A Qwen-VL image keeps (about) its size: the family's image processor resizes it so both
sides are multiples of ``patch_size * merge_size`` and its area lies within ``[min_pixels,
max_pixels]`` (``smart_resize``), then cuts it into a ``(t, h, w)`` grid of patches whose
rows (``channels * temporal_patch_size * patch_size**2`` values each) the tower reads.
Both families use the same processor (``transformers``' ``Qwen2VLImageProcessor``;
Qwen3-VL folders set ``patch_size`` 16).

:class:`NativeImageProcessor` is that processor, built by ``transformers`` from a folder's
``preprocessor_config.json`` (its PIL backend, ``Qwen2VLImageProcessorPil``), with the
run's pixel bounds (``modules.<m>.max_pixels``: :class:`~mimotron.config.native_vision.
NativeVision`). Nothing of the resize or the normalisation is ours: the patches and grid
of an image are the processor's own ``pixel_values`` and ``image_grid_thw``. What is ours:

* :meth:`~NativeImageProcessor.grid_for_size` and :meth:`~NativeImageProcessor.
  tokens_for_size` give an image's grid and token count from its header size alone
  (``transformers``' ``smart_resize``), so the data check and a rank that never decodes
  the image (the language model's) know every sample's length;
* :meth:`~NativeImageProcessor.padded` puts an image's patch rows in the fixed slots the
  engine moves (``max_patches`` rows, zeros after the image's own).

``transformers`` is imported when a processor is built, never at import time (the
synthetic datasets load none of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mimotron.config.hf_folder import read_preprocessor_config
from mimotron.config.native_vision import NativeVision

__all__ = ["NativeImageProcessor"]

Grid = tuple[int, int, int]
"""An image's ``(t, h, w)`` patch grid (``t`` is 1 for an image)."""

# The processor-file keys that name the pixel bounds (all replaced by the run's bounds).
_BOUND_KEYS = ("size", "min_pixels", "max_pixels")
# The patching keys that must agree with the model's config.json.
_PATCHING = ("patch_size", "merge_size", "temporal_patch_size")


class NativeImageProcessor:
    """A Qwen-VL image processor with the run's pixel bounds (see the module docstring).

    Args:
        config: the folder's ``preprocessor_config.json`` as a dict.
        patch_size: the model's ``vision_config.patch_size``.
        merge_size: the model's ``vision_config.spatial_merge_size``.
        temporal_patch_size: the model's ``vision_config.temporal_patch_size``.
        max_pixels: the upper area bound (0: the processor file's).
        min_pixels: the lower area bound (0: the processor file's).
        where: what messages call the processor file.

    Raises:
        ValueError: one line naming the key and both values: a processor file whose
            patching contradicts the model's, without a resize, or with bounds that
            hold no merged token (``max_pixels < (patch_size * merge_size)**2`` or
            ``min_pixels > max_pixels``).
    """

    def __init__(self, config: Mapping[str, Any], patch_size: int, merge_size: int,
                 temporal_patch_size: int, max_pixels: int = 0, min_pixels: int = 0,
                 where: str = "preprocessor_config.json") -> None:
        # Deferred: importing transformers takes seconds, and the synthetic data never does.
        from transformers import Qwen2VLImageProcessorPil

        folder = Qwen2VLImageProcessorPil.from_dict(dict(config))
        model = {"patch_size": patch_size, "merge_size": merge_size,
                 "temporal_patch_size": temporal_patch_size}
        for key in _PATCHING:
            if int(getattr(folder, key)) != model[key]:
                name = "spatial_merge_size" if key == "merge_size" else key
                raise ValueError(f"{where} has {key}={getattr(folder, key)} but the model's "
                                 f"config.json has vision_config.{name}={model[key]}: the "
                                 "processor must cut the patches the tower reads")
        if not folder.do_resize:
            raise ValueError(f"{where} has do_resize=false: expected true (images are resized "
                             "to multiples of patch_size x merge_size within max_pixels)")
        size = folder.size
        low = int(min_pixels or size.shortest_edge or size.min_pixels or 0)
        high = int(max_pixels or size.longest_edge or size.max_pixels or 0)
        self.patch_size, self.merge_size = patch_size, merge_size
        self.temporal_patch_size = temporal_patch_size
        self.min_pixels, self.max_pixels = low, high
        # The slot arithmetic is the config's (RGB: the processor converts every image).
        self.slots = NativeVision("", patch_size, merge_size, temporal_patch_size, 3, low, high)
        if high < self.unit**2 or low > high:
            raise ValueError(f"max_pixels={high}, min_pixels={low} are invalid for {where}: "
                             f"expected (patch_size x merge_size)^2 = {self.unit**2} <= "
                             "max_pixels and min_pixels <= max_pixels")
        kept = {k: v for k, v in config.items() if k not in _BOUND_KEYS}
        self.hf = Qwen2VLImageProcessorPil.from_dict(
            {**kept, "size": {"shortest_edge": low, "longest_edge": high}})

    @classmethod
    def from_pretrained(cls, path: str | Path, patch_size: int, merge_size: int,
                        temporal_patch_size: int, max_pixels: int = 0, min_pixels: int = 0
                        ) -> NativeImageProcessor:
        """The processor of a local folder's ``preprocessor_config.json``.

        Raises:
            ValueError: the file is missing or not JSON, or as the constructor.
        """
        config = read_preprocessor_config(path)
        return cls(config, patch_size, merge_size, temporal_patch_size, max_pixels,
                   min_pixels, where=f"{Path(path) / 'preprocessor_config.json'}")

    @classmethod
    def from_vision(cls, path: str | Path, vision: Any) -> NativeImageProcessor:
        """The processor of a vision module: its folder and resolved ``hf_native``
        (:class:`~mimotron.config.native_vision.NativeVision`: patching and bounds).

        Raises:
            ValueError: a tower that does not read RGB images, or as :meth:`from_pretrained`.
        """
        if vision.in_channels != 3:
            raise ValueError(f"the {vision.model_type} tower of {str(path)!r} reads "
                             f"in_channels={vision.in_channels}: expected 3 (its processor "
                             "gives RGB patches)")
        return cls.from_pretrained(path, vision.patch_size, vision.merge_size,
                                   vision.temporal_patch_size, vision.max_pixels,
                                   vision.min_pixels)

    # ---- sizes --------------------------------------------------------------------------
    @property
    def unit(self) -> int:
        """Pixels per merged-token side: both resized sides are multiples of it."""
        return self.slots.unit

    @property
    def max_tokens(self) -> int:
        """The most merged tokens an image can have (its token slots)."""
        return self.slots.max_tokens

    @property
    def max_patches(self) -> int:
        """The most patch rows an image can have (its patch-row slots)."""
        return self.slots.max_patches

    @property
    def patch_dim(self) -> int:
        """Values per patch row: ``3 * temporal_patch_size * patch_size**2``."""
        return self.slots.patch_dim

    @property
    def output_shape(self) -> tuple[int, int]:
        """``(max_patches, patch_dim)``: one image's slots in a batch."""
        return (self.max_patches, self.patch_dim)

    def identity(self) -> dict[str, Any]:
        """What an image's grid and patches depend on (part of a data index's key)."""
        return {"patching": [self.patch_size, self.merge_size, self.temporal_patch_size],
                "pixels": [self.min_pixels, self.max_pixels],
                "processor": self.hf.to_json_string()}

    def grid_for_size(self, width: int, height: int) -> Grid:
        """The ``(t, h, w)`` grid of an image of ``width`` x ``height`` pixels (its header).

        Raises:
            ValueError: a size the processor refuses (not positive, an aspect ratio of
                200 or more), or one whose grid would exceed the slots.
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if width < 1 or height < 1:
            raise ValueError(f"the image is {width} x {height} pixels: expected a positive size")
        try:
            new_h, new_w = smart_resize(height, width, self.unit, self.min_pixels,
                                        self.max_pixels)
        except ValueError as exc:
            raise ValueError(f"the image is {width} x {height} pixels (width x height), which "
                             f"the Qwen-VL image processor refuses: {exc}") from None
        grid = (1, new_h // self.patch_size, new_w // self.patch_size)
        if grid[1] * grid[2] > self.max_patches:
            # smart_resize rounds up to min_pixels: a bound pair that leaves no room.
            raise ValueError(f"the image is {width} x {height} pixels, resized to {new_w} x "
                             f"{new_h}: more than max_pixels={self.max_pixels} allows")
        return grid

    def tokens_for_size(self, width: int, height: int) -> int:
        """The merged tokens of an image of ``width`` x ``height`` pixels (its header).

        Raises:
            ValueError: as :meth:`grid_for_size`.
        """
        t, h, w = self.grid_for_size(width, height)
        return t * h * w // self.merge_size**2

    def check_size(self, width: int, height: int) -> None:
        """Raise if the processor cannot take an image of this size (the data check reads
        it from the header, before decoding); large images are resized, not refused.

        Raises:
            ValueError: as :meth:`grid_for_size`.
        """
        self.grid_for_size(width, height)

    # ---- pixels -------------------------------------------------------------------------
    def __call__(self, image: Any) -> tuple[torch.Tensor, Grid]:
        """The processor's patch rows and grid of one PIL image.

        Returns:
            ``(patches, grid)``: float32 ``[t * h * w, patch_dim]`` (``pixel_values``, in
            the processor's order) and ``(t, h, w)`` (``image_grid_thw``).

        Raises:
            ValueError: as :meth:`grid_for_size` (checked before any pixel is resized).
        """
        expected = self.grid_for_size(*image.size)
        out = self.hf(images=[image], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        assert grid == expected, f"processor grid {grid} != header grid {expected}"
        patches = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        return torch.from_numpy(patches), (grid[0], grid[1], grid[2])

    def padded(self, patches: torch.Tensor, max_patches: int | None = None) -> torch.Tensor:
        """``patches`` followed by zero rows up to ``max_patches`` (default: the slots).

        Raises:
            ValueError: more patch rows than ``max_patches``, or rows of another width.
        """
        num = self.max_patches if max_patches is None else max_patches
        if patches.dim() != 2 or patches.shape[0] > num or patches.shape[1] != self.patch_dim:
            raise ValueError(f"patches of shape {tuple(patches.shape)}: expected [n <= {num}, "
                             f"{self.patch_dim}]")
        out = torch.zeros((num, self.patch_dim), dtype=torch.float32)
        out[:patches.shape[0]] = patches
        return out

    def __repr__(self) -> str:
        return (f"NativeImageProcessor(patch={self.patch_size}, merge={self.merge_size}, "
                f"pixels=[{self.min_pixels}, {self.max_pixels}])")
