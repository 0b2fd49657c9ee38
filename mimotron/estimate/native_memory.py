"""Memory of a native-resolution vision module (Qwen2.5-VL, Qwen3-VL) and of its slots.

:mod:`mimotron.estimate.memory` counts a fixed-size encoder by its output tokens. A Qwen
tower runs on each image's real patches only (:mod:`mimotron.models.native_vision`), so
its saved tensors are a number of bytes per **patch row** times the rows a rank holds
(:func:`~mimotron.estimate.image_counts.held_images`), and the slots add bytes per
**image** and per **image slot**:

* the tower, per patch row (:func:`tower_bytes_per_patch`, checked against what autograd
  saves in ``tests/test_native_estimate.py``), with ``h`` its width, ``f`` its MLP
  width, ``c`` the compute dtype's bytes and ``r`` the residual stream's: the patch
  projection's input (``c x C*T*P*P``) and the 2-D RoPE tables (fp32 cos and sin); per
  layer both norms' inputs (``2 r h``) and their fp32 statistics, the
  linears' inputs (``2 c h``), the rotated q and k (``2 c h``), the fused ``qkv``
  output that v is a view of (``3 c h``), attention's output (``c h``; on the
  per-segment path of fp32 runs and CPUs, which concatenates the segments, once more)
  and log-sum-exp (fp32 per head), the MLP's (``4 c f`` SwiGLU, ``2 c f`` two-matrix);
  the merger's input (the last layer's output, ``r h``) and its ``3 c h`` (the
  concatenated rows, GELU's input, ``w2``'s input), each DeepStack merger's ``3 c h``.
  No term grows with the square of a segment: attention keeps ``O(rows)``;
* per present image, its output block ``[max_tokens, W]`` in the compute dtype
  (``W = out_hidden * (1 + DeepStack layers)``), held by the vision rank until its
  gradient comes back, and on a split layout's first language stage the received copy
  (:func:`block_bytes`; under context parallelism only the real rows of the rank's
  placeholders arrive). A colocated layout's language model reads the vision rank's
  blocks (or a re-sliced copy, not counted);
* per image slot of every micro-batch of the step, its patch rows as the batch carries
  them (``max_patches x patch_dim`` fp32, absent images too): a step's batches are on
  the device together (:func:`input_slot_bytes`).

A frozen tower saves nothing (its output blocks and inputs remain); a frozen tower with
training mergers (``freeze = "encoder"``) saves the mergers' tensors. Recomputed layers
keep their input (``full``) or the outputs of their matmuls and of attention
(``selective``).
"""

from __future__ import annotations

from typing import Any

from mimotron.config.hf_resolve import tower_kwargs
from mimotron.config.schema import MimoConfig
from mimotron.estimate.image_counts import (
    HeldImages,
    held_images,
    image_stats,
    native_encoders,
)
from mimotron.estimate.widths import BYTES, FP32, residual_bytes
from mimotron.models.blocks import _NORM_CHUNK_ELEMENTS
from mimotron.models.recompute import recomputed_layer_ids
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout

__all__ = ["block_bytes", "input_slot_bytes", "layer_bytes_per_patch", "native_activation_bytes",
           "native_count_lines", "native_workspace_bytes", "tower_bytes_per_patch",
           "uses_native_terms"]


def _kernel(cfg: MimoConfig) -> str:
    """The attention path a training accelerator runs a tower on: ``varlen`` in 16 bits
    (its output is ``wo``'s input), ``segments`` in fp32 (one SDPA per segment, then a
    concatenation: the output kept twice)."""
    return "varlen" if cfg.train.precision in ("bf16", "fp16") else "segments"


def _shape(cfg: MimoConfig, name: str) -> dict[str, Any]:
    """The tower's sizes: ``h``, ``f``, heads, depth, DeepStack layers, family flags."""
    args = tower_kwargs(cfg.modules[name])
    return {"h": int(args["hidden_size"]), "f": int(args["intermediate_size"]),
            "heads": int(args["num_heads"]), "depth": int(args["depth"]),
            "out": int(args["out_hidden_size"]), "unit": int(args["spatial_merge_size"]) ** 2,
            "deepstack": list(args.get("deepstack_visual_indexes") or []),
            "gated": "window_size" in args}  # Qwen2.5-VL: SwiGLU, RMSNorm, windows


def _norm_stats(gated: bool) -> int:
    """Per row, the fp32 statistics a norm keeps: RMSNorm one, LayerNorm two (mean and
    reciprocal deviation, fp32 for a 16-bit input too)."""
    return FP32 if gated else 2 * FP32


def layer_bytes_per_patch(cfg: MimoConfig, name: str, kernel: str | None = None) -> int:
    """Bytes one tower layer saves per patch row, without recompute (module docstring).

    Args:
        cfg: the run config.
        name: a native-resolution vision module.
        kernel: ``varlen`` or ``segments`` (``None``: the accelerator's for the precision).
    """
    s, c, r = _shape(cfg, name), BYTES[cfg.train.precision], residual_bytes(cfg)
    h, f = s["h"], s["f"]
    attention_out = 2 if (kernel or _kernel(cfg)) == "segments" else 1
    whole = 2 * r * h + 2 * c * h + 2 * c * h + 3 * c * h + attention_out * c * h
    mlp = (4 if s["gated"] else 2) * c * f
    return whole + mlp + FP32 * s["heads"] + 2 * _norm_stats(s["gated"])


def _kept_bytes_per_patch(cfg: MimoConfig, name: str) -> int:
    """What a recomputed tower layer keeps per patch row: its input (``full``), and
    under ``selective`` also the outputs of its matmuls (``qkv``, ``wo``, the MLP's
    inner and outer) and attention's output and log-sum-exp."""
    mod, s = cfg.modules[name], _shape(cfg, name)
    c, h, f = BYTES[cfg.train.precision], s["h"], s["f"]
    kept = residual_bytes(cfg) * h
    if mod.recompute == "selective":
        inner = (2 if s["gated"] else 1) * c * f
        kept += 3 * c * h + c * h + FP32 * s["heads"] + c * h + inner + c * h
    return kept


def _merger_bytes_per_patch(cfg: MimoConfig, name: str, final: bool) -> float:
    """A merger's saved tensors per patch row, its input left out: the concatenated
    rows, GELU's input and ``w2``'s input (``3 c h``), its norm's statistics; the final
    Qwen2.5-VL merger also keeps its tokens (``c x out`` per token: the reordering)."""
    s, c = _shape(cfg, name), BYTES[cfg.train.precision]
    stats = _norm_stats(s["gated"]) / (1 if final else s["unit"])
    reorder = (c * s["out"] + 8) / s["unit"] if final and s["gated"] else 0
    return 3 * c * s["h"] + stats + reorder


def tower_bytes_per_patch(cfg: MimoConfig, name: str, kernel: str | None = None) -> float:
    """Bytes a native tower's forward keeps for backward per real patch row.

    Args:
        cfg: the run config (precision, ``freeze``, ``recompute``).
        name: a native-resolution vision module.
        kernel: ``varlen`` or ``segments`` (``None``: the accelerator's for the precision).
    """
    mod, s = cfg.modules[name], _shape(cfg, name)
    r = residual_bytes(cfg)
    deepstack = s["deepstack"]
    mergers = (_merger_bytes_per_patch(cfg, name, True)
               + len(deepstack) * _merger_bytes_per_patch(cfg, name, False))
    if mod.fully_frozen:
        return 0.0
    if mod.tower_frozen:  # only the mergers train: each keeps its input layer's output
        inputs = len({s["depth"] - 1, *deepstack})
        return inputs * r * s["h"] + mergers
    c, v = BYTES[cfg.train.precision], mod.hf_native
    head_dim = s["h"] // s["heads"]
    front = c * v.patch_dim + (8 if s["gated"] else 0) + 2 * FP32 * head_dim // 2
    layer = layer_bytes_per_patch(cfg, name, kernel)
    recomputed = (len(recomputed_layer_ids([list(range(s["depth"]))], mod.recompute_num_layers))
                  if mod.recompute != "none" else 0)
    layers = s["depth"] * layer - recomputed * (layer - _kept_bytes_per_patch(cfg, name))
    return front + layers + r * s["h"] + mergers


def block_bytes(cfg: MimoConfig, name: str) -> int:
    """One image's output block: ``max_tokens`` slots of ``W`` values in the compute
    dtype, ``W = out_hidden * (1 + DeepStack layers)``."""
    s = _shape(cfg, name)
    width = s["out"] * (1 + len(s["deepstack"]))
    return cfg.modules[name].hf_native.max_tokens * width * BYTES[cfg.train.precision]


def input_slot_bytes(cfg: MimoConfig, name: str) -> int:
    """One image slot of a batch on the device: ``max_patches x patch_dim`` fp32."""
    vision = cfg.modules[name].hf_native
    return vision.max_patches * vision.patch_dim * FP32


def _received_bytes(cfg: MimoConfig) -> tuple[float, int]:
    """``(per patch row, per image)`` bytes a language model's first stage receives from
    the native modules: each image's block, or under context parallelism only the real
    rows of its placeholders (``1 / context`` of them per rank, on average)."""
    context = cfg.modules[LANGUAGE].parallel.context
    per_patch, per_image = 0.0, 0
    for name in native_encoders(cfg):
        if context == 1:
            per_image += block_bytes(cfg, name)
            continue
        s = _shape(cfg, name)
        row = s["out"] * (1 + len(s["deepstack"])) * BYTES[cfg.train.precision]
        per_patch += row / (s["unit"] * context)
    return per_patch, per_image


def uses_native_terms(cfg: MimoConfig, layout: Layout, name: str, stage: int) -> bool:
    """Whether a rank of ``(name, stage)`` is counted here: a native vision module, or
    the first stage of a language model that receives native blocks over a bridge."""
    native = native_encoders(cfg)
    if name in native:
        return True
    return bool(native) and name == LANGUAGE and stage == 0 and not layout.colocated


def native_activation_bytes(cfg: MimoConfig, layout: Layout, name: str, stage: int, dp: int,
                            steps: range | None = None,
                            memo: dict[tuple[object, ...], Any] | None = None
                            ) -> tuple[int, HeldImages]:
    """The native terms of one rank's activations, and the images they count.

    A native vision module: its tower's saved tensors for the held patch rows, its
    held output blocks and the step's input slots. The first stage of a language
    model on its own ranks: the blocks it received for its held forwards (counted on
    top of :func:`~mimotron.estimate.memory.activation_bytes`).

    Args:
        cfg: the run config.
        layout: its layout.
        name: the module (:func:`uses_native_terms`).
        stage: the rank's pipeline stage.
        dp: the rank's data-parallel replica.
        steps: the training steps whose samples are read (mock data; ``None``:
            :func:`~mimotron.estimate.image_counts.image_steps`).
        memo: a dict kept across calls.
    """
    if name == LANGUAGE:
        per_patch, per_image = _received_bytes(cfg)
        held = held_images(cfg, layout, name, stage, dp, per_patch, per_image, steps, memo)
        return int(per_patch * held.patches + per_image * held.images), held
    per_patch = tower_bytes_per_patch(cfg, name)
    per_image = block_bytes(cfg, name) + cfg.modules[name].hf_native.max_tokens  # + its mask
    held = held_images(cfg, layout, name, stage, dp, per_patch, per_image, steps, memo)
    total = (per_patch * held.patches + per_image * held.images
             + input_slot_bytes(cfg, name) * held.step_slots)
    return int(total), held


def native_workspace_bytes(cfg: MimoConfig, name: str, largest_patches: int) -> int:
    """The largest backward temporary of a native tower, for its largest micro-batch.

    As :func:`~mimotron.estimate.memory.backward_workspace_bytes` per patch row: the
    MLP's inner gradient (``c f``) or a norm's (``c h`` and three fp32 chunks); with
    recompute, one recomputed layer's dropped tensors on top; a frozen tower with
    training mergers, a merger's hidden gradient; a frozen one, none.
    """
    mod, s = cfg.modules[name], _shape(cfg, name)
    c, rows = BYTES[cfg.train.precision], largest_patches
    if mod.fully_frozen:
        return 0
    if mod.tower_frozen:
        return rows * c * s["h"]
    values = rows * s["h"]
    norm = c * values + 3 * FP32 * min(values, _NORM_CHUNK_ELEMENTS)
    recompute = 0
    if mod.recompute != "none":
        recompute = rows * (layer_bytes_per_patch(cfg, name) - _kept_bytes_per_patch(cfg, name))
    return max(rows * c * s["f"], norm) + recompute


def native_count_lines(cfg: MimoConfig, layout: Layout, steps: range | None = None,
                       memo: dict[tuple[object, ...], Any] | None = None) -> list[str]:
    """What ``mimotron plan`` says of the image counts behind its native estimates: per
    native module, where the memory counts come from and the patch rows / images each
    data-parallel replica holds at its peak (a range past 8 replicas), and the
    per-image count the FLOPs use."""
    lines, memo = [], {} if memo is None else memo  # one read of the samples
    for name in native_encoders(cfg):
        dp = layout.modules[name].parallel.data
        held = [native_activation_bytes(cfg, layout, name, 0, d, steps, memo)[1]
                for d in range(dp)]
        if dp <= 8:
            peaks = ", ".join(f"{h.patches}/{h.images}" for h in held)
        else:
            rows = [h.patches for h in held]
            peaks = f"{min(rows)} to {max(rows)} rows"
        stats = image_stats(cfg, name)
        lines += [f"native-resolution images ({name}): activations count {held[0].source};",
                  f"  patch rows/images held at the peak, per data-parallel replica: {peaks}",
                  f"  FLOPs count {stats.source}: {stats.patches:.0f} patch rows per image"]
    return lines
