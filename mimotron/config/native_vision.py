"""Native-resolution vision modules (Qwen2.5-VL, Qwen3-VL): the numbers the run fixes.

A Qwen-VL image keeps (about) its size: the family's processor resizes it so both sides
are multiples of ``patch_size * merge_size`` and its area lies in ``[min_pixels,
max_pixels]``, then cuts it into ``(t, h, w)`` patches, ``t * h * w / merge_size**2`` of
which leave the tower's merger as tokens. So the token count differs per image, from
tens to thousands.

The engine moves fixed shapes (a pipeline link, a bridge between layouts, a fake-device
dry run all know them in advance), so each image travels in **slots**: its patch rows
padded to :attr:`NativeVision.max_patches`, its tokens to :attr:`NativeVision.max_tokens`
(= ``max_pixels / (patch_size * merge_size)**2``, the most an image can have), with its
real counts beside them (the batch's ``<modality>_grid`` and ``<modality>_tokens``). The
tower runs on the real patches only, and the language model keeps the real tokens only;
the padding is bytes on the wire, which ``modules.<m>.max_pixels`` bounds.

Model-free: config validation resolves a module with this before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mimotron.config.hf_folder import preprocessor_file, read_preprocessor_config

__all__ = ["DEFAULT_MAX_PIXELS", "NativeVision", "deepstack_source", "native_vision"]

DEFAULT_MAX_PIXELS = 1003520
"""transformers' ``Qwen2VLImageProcessor`` default ``size["longest_edge"]``: the bound of a
folder whose processor file gives none."""
_DEFAULT_MIN_PIXELS = 3136


@dataclass(frozen=True)
class NativeVision:
    """A native-resolution tower's patching and the run's image bound.

    Attributes:
        model_type: the folder's family (``qwen2_5_vl`` or ``qwen3_vl``).
        patch_size: pixels per patch side.
        merge_size: patches per merged token side (``spatial_merge_size``).
        temporal_patch_size: frames per patch (an image is repeated to fill them).
        in_channels: image channels.
        min_pixels: the processor's lower area bound.
        max_pixels: the run's upper area bound (``modules.<m>.max_pixels`` or the
            processor's).
    """

    model_type: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    in_channels: int
    min_pixels: int
    max_pixels: int

    @property
    def unit(self) -> int:
        """Pixels per merged-token side: both resized sides are multiples of it."""
        return self.patch_size * self.merge_size

    @property
    def max_tokens(self) -> int:
        """Token slots per image: the most tokens an image of ``max_pixels`` leaves with."""
        return self.max_pixels // self.unit**2

    @property
    def max_patches(self) -> int:
        """Patch-row slots per image (``max_tokens`` merged tokens' worth)."""
        return self.max_tokens * self.merge_size**2

    @property
    def patch_dim(self) -> int:
        """Values per patch row: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _processor_bounds(path: str) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` of a folder's processor file (defaults without one)."""
    if preprocessor_file(path) is None:
        return _DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS
    config = read_preprocessor_config(path)
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    low = config.get("min_pixels") or size.get("shortest_edge") or _DEFAULT_MIN_PIXELS
    high = config.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
    return int(low), int(high)


def native_vision(model_type: str, tower_args: dict[str, Any], path: str, max_pixels: int,
                  where: str) -> NativeVision:
    """The :class:`NativeVision` of a Qwen-VL folder's vision module.

    Args:
        model_type: the folder's ``model_type``.
        tower_args: the tower's constructor arguments
            (:mod:`mimotron.config.qwen_vl_vision`).
        path: the folder (its processor file gives the default bounds).
        max_pixels: ``modules.<m>.max_pixels`` (0: the processor's).
        where: the module's key prefix, for messages.

    Raises:
        ValueError: a ``max_pixels`` too small for one merged token, or below the
            processor's ``min_pixels`` (one line naming the key).
    """
    low, high = _processor_bounds(path)
    bound = max_pixels or high
    vision = NativeVision(model_type, int(tower_args["patch_size"]),
                          int(tower_args["spatial_merge_size"]),
                          int(tower_args["temporal_patch_size"]),
                          int(tower_args["in_channels"]), low, bound)
    if max_pixels < 0 or vision.max_tokens < 1 or bound < low:
        raise ValueError(f"{where}.max_pixels={max_pixels} is invalid: expected 0 (the "
                         f"processor's {high}) or a pixel count >= the processor's min_pixels="
                         f"{low} and >= (patch_size x merge_size)^2 = {vision.unit**2}")
    return vision


def check_native_layout(cfg: Any) -> None:
    """Refuse the layouts a native-resolution vision module cannot run (before launch).

    Args:
        cfg: the run's ``MimoConfig`` (its modules resolved).

    Raises:
        ValueError: one line naming the key: a tower split by tensor or pipeline
            parallelism (the Qwen-VL towers have no tensor-parallel plan and run whole);
            a language model from another folder (its M-RoPE positions come from this
            folder's rule).
    """
    language = cfg.modules.get("language")
    for name, mod in cfg.modules.items():
        vision = mod.hf_native
        if vision is None and mod.max_pixels:
            raise ValueError(f"modules.{name}.max_pixels={mod.max_pixels} applies to a Qwen2.5-VL "
                             "/ Qwen3-VL vision module only (native resolution); remove it")
        if vision is None:
            continue
        par = mod.parallel
        for key in ("tensor", "pipeline"):
            if getattr(par, key) != 1:
                raise ValueError(f"modules.{name}.parallel.{key}={getattr(par, key)} is not "
                                 f"supported for a {vision.model_type} vision tower: expected 1 "
                                 "(it runs whole on each rank; scale it with data)")
        if language is None or language.hf_path != mod.hf_path:
            raise ValueError(f"modules.language.hf_path must be {mod.hf_path!r} like "
                             f"modules.{name}.hf_path: a {vision.model_type} tower feeds its "
                             "own language model (3-D rotary positions)")


def deepstack_source(cfg: Any) -> tuple[str, int] | None:
    """``(vision module, number of DeepStack layers)`` of a Qwen3-VL run, else ``None``.

    The language model's first that many layers add the module's DeepStack features
    (wherever its pipeline stages put them: :mod:`mimotron.pipeline.deepstack_link`).
    """
    for name, mod in cfg.modules.items():
        config = mod.hf_config[1] if mod.hf_native is not None and mod.hf_config else {}
        num = len(config.get("deepstack_visual_indexes") or ())
        if num:
            return name, num
    return None
