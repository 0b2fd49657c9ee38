"""The vision towers of Qwen2.5-VL and Qwen3-VL: ``config.json`` to constructor arguments.

Model-free (no ``torch``): the config checks read a folder's ``config.json`` through these
functions before any model code is imported, and
:mod:`mimotron.models.hf.qwen25_vision` / :mod:`mimotron.models.hf.qwen3_vision` build
from what they return. A config is either a full ``qwen2_5_vl`` / ``qwen3_vl`` one (the
tower's settings are its ``vision_config``) or the bare vision config
(``qwen2_5_vl_vision`` / ``qwen3_vl_vision``). Keys a config.json omits take the
``transformers`` defaults (``Qwen2_5_VLVisionConfig``, ``Qwen3VLVisionConfig``); options
the towers do not implement are refused with a ``ValueError`` naming the key.

:func:`media_tokens` is the number of tokens one image or video leaves the tower with
(``t * h * w / spatial_merge_size**2`` for its patch grid ``(t, h, w)``), which is how
many placeholder tokens its place in the text needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mimotron.config.hf_folder import read_keys, reject_set, select_config
from mimotron.config.hf_specs import check_activation

__all__ = ["media_tokens", "qwen25_vision_args", "qwen3_vision_args"]

# transformers' defaults of the keys both towers read (Qwen2_5_VLVisionConfig /
# Qwen3VLVisionConfig); the family-specific ones follow.
_COMMON = {"in_channels": 3, "spatial_merge_size": 2, "temporal_patch_size": 2}
_QWEN25 = {**_COMMON, "depth": 32, "hidden_size": 3584, "intermediate_size": 3420,
           "num_heads": 16, "patch_size": 14, "window_size": 112, "out_hidden_size": 3584,
           "fullatt_block_indexes": [7, 15, 23, 31]}
_QWEN3 = {**_COMMON, "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh",
          "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
          "out_hidden_size": 3584, "num_position_embeddings": 2304,
          "deepstack_visual_indexes": [8, 16, 24]}
_DEFAULT_THETA = 10000.0  # transformers' default_theta of the axial vision RoPE
# Qwen2.5-VL's MLP is gated; its gate activation is SiLU in every released checkpoint,
# and it is the one the tower implements (blocks.SwiGLU).
_QWEN25_ACT = "silu"


def qwen25_vision_args(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of :class:`~mimotron.models.hf.qwen25_vision.Qwen25VisionTower`.

    Args:
        config: a ``qwen2_5_vl`` config.json dict, or its ``qwen2_5_vl_vision`` part.

    Returns:
        The tower's keyword arguments (sizes, patching, windows, full-attention layers,
        ``rope_theta``).

    Raises:
        ValueError: another model type, or an option the tower does not implement.
    """
    sub = select_config(config, ("qwen2_5_vl_vision",), ("qwen2_5_vl",), "vision_config")
    _refuse_common(sub)
    act = sub.get("hidden_act", _QWEN25_ACT)
    if act != _QWEN25_ACT:
        raise ValueError(f"config.json vision_config.hidden_act={act!r} is not supported; "
                         f"the Qwen2.5-VL tower's gated MLP implements {_QWEN25_ACT!r} only")
    args = read_keys(sub, _QWEN25)
    _check_sizes(args)
    unit = args["patch_size"] * args["spatial_merge_size"]
    if not _is_int(args["window_size"]) or args["window_size"] < unit:
        raise ValueError(f"config.json vision_config.window_size={args['window_size']!r} is "
                         f"invalid; expected an integer >= patch_size * spatial_merge_size "
                         f"= {unit}")
    args["fullatt_block_indexes"] = _layer_indexes(
        "fullatt_block_indexes", args["fullatt_block_indexes"], args["depth"])
    args["rope_theta"] = _rope_theta(sub)
    return args


def qwen3_vision_args(config: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments of :class:`~mimotron.models.hf.qwen3_vision.Qwen3VisionTower`.

    Args:
        config: a ``qwen3_vl`` config.json dict, or its ``qwen3_vl_vision`` part.

    Returns:
        The tower's keyword arguments (sizes, patching, activation, position table,
        DeepStack layers, ``rope_theta``).

    Raises:
        ValueError: another model type, or an option the tower does not implement.
    """
    sub = select_config(config, ("qwen3_vl_vision",), ("qwen3_vl",), "vision_config")
    _refuse_common(sub)
    args = read_keys(sub, _QWEN3)
    _check_sizes(args)
    check_activation("vision_config.hidden_act", args["hidden_act"])
    table = args["num_position_embeddings"]
    if not _is_int(table) or table < 1 or math.isqrt(table) ** 2 != table:
        raise ValueError(f"config.json vision_config.num_position_embeddings={table!r} is "
                         "invalid; expected a square number (a side x side table)")
    args["deepstack_visual_indexes"] = _layer_indexes(
        "deepstack_visual_indexes", args["deepstack_visual_indexes"], args["depth"])
    args["rope_theta"] = _rope_theta(sub)
    return args


def media_tokens(grid_thw: Sequence[int], spatial_merge_size: int) -> int:
    """Tokens one image or video leaves a Qwen vision tower with.

    Args:
        grid_thw: its patch grid ``(t, h, w)`` (the image processor's ``image_grid_thw``
            or ``video_grid_thw`` row).
        spatial_merge_size: the tower's ``spatial_merge_size``.

    Returns:
        ``t * h * w // spatial_merge_size**2``.

    Raises:
        ValueError: a grid that is not three positive integers with ``h`` and ``w``
            multiples of ``spatial_merge_size``.
    """
    grid = tuple(grid_thw)
    if (len(grid) != 3 or not all(_is_int(n) and n > 0 for n in grid)
            or grid[1] % spatial_merge_size or grid[2] % spatial_merge_size):
        raise ValueError(f"grid_thw={list(grid)} is invalid; expected three positive integers "
                         f"(t, h, w) with h and w multiples of spatial_merge_size="
                         f"{spatial_merge_size}")
    t, h, w = grid
    return t * h * w // spatial_merge_size**2


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refuse_common(sub: dict[str, Any]) -> None:
    """Options neither tower implements."""
    reject_set(sub, ("attention_dropout", "hidden_dropout"),
               "expected 0.0 (the towers have no dropout)")
    head_dim = sub.get("head_dim")
    if head_dim is not None and head_dim * sub.get("num_heads", 1) != sub.get("hidden_size"):
        raise ValueError(f"config.json vision_config.head_dim={head_dim!r} is not supported; "
                         "expected hidden_size / num_heads")


def _check_sizes(args: dict[str, Any]) -> None:
    """Positive integer sizes; heads that divide the width into a 2-D rotary head."""
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                "patch_size", "temporal_patch_size", "spatial_merge_size", "out_hidden_size"):
        if not _is_int(args[key]) or args[key] < 1:
            raise ValueError(f"config.json vision_config.{key}={args[key]!r} is not "
                             "supported; expected a positive integer")
    hidden, heads = args["hidden_size"], args["num_heads"]
    # The 2-D rotary embedding gives a quarter of each head to each of the four (h, w) x
    # (cos, sin) parts: the head width must divide by 4.
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"config.json vision_config.num_heads={heads} is invalid for "
                         f"hidden_size={hidden}; expected a divisor leaving heads whose "
                         "width is a multiple of 4")


def _layer_indexes(key: str, value: object, depth: int) -> list[int]:
    """Distinct layer indexes in ``[0, depth)``."""
    indexes = list(value) if isinstance(value, (list, tuple)) else None
    if (indexes is None or not all(_is_int(i) and 0 <= i < depth for i in indexes)
            or len(set(indexes)) != len(indexes)):
        raise ValueError(f"config.json vision_config.{key}={value!r} is invalid; expected "
                         f"distinct layer indexes in [0, {depth})")
    return indexes


def _rope_theta(sub: dict[str, Any]) -> float:
    """The axial RoPE base; other RoPE types are refused."""
    if sub.get("rope_scaling"):
        raise ValueError(f"config.json vision_config.rope_scaling={sub['rope_scaling']!r} is "
                         "not supported; the vision towers use plain axial RoPE")
    params = sub.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json vision_config.rope_parameters={params!r} is invalid; "
                         "expected a dict")
    # transformers reads an old checkpoint's "default" as the vision towers' "axial".
    rope_type = params.get("rope_type", "axial")
    if rope_type not in ("axial", "default"):
        raise ValueError(f"config.json vision_config.rope_parameters.rope_type={rope_type!r} "
                         "is not supported; expected 'axial'")
    theta = params.get("rope_theta", sub.get("rope_theta", _DEFAULT_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ValueError(f"config.json vision_config.rope_theta={theta!r} is invalid; "
                         "expected a positive number")
    return float(theta)
