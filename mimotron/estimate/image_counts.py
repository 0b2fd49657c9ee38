"""The images a native-resolution vision module runs and holds, as the estimates count them.

A Qwen2.5-VL / Qwen3-VL tower computes only each image's real patches, so its FLOPs and
its saved activations follow the patch counts of the data, not the slots
(:mod:`mimotron.config.native_vision`). Where those counts come from:

* ``data.dataset = "mock"`` (:class:`~mimotron.data.native_mock.NativeMockTask`): the
  law of a sample's grid is known exactly (:func:`~mimotron.data.native_mock.
  grid_distribution`, :data:`~mimotron.data.native_mock.IMAGE_SHARE`), and so is every
  sample's own grid (:meth:`~mimotron.data.native_mock.NativeMockTask.image_grid`, no
  pixels made). FLOPs take the law's expectation (:func:`image_stats`); memory counts
  the grids of the samples a rank really holds, at the peak of its plan, over the
  first steps of the run (:func:`held_images`, :func:`image_steps`): a peak is set by
  the largest micro-batches a rank meets, not by the average one.
* any other data (``llava``, packed rows): the bound, every image slot an image of
  ``max_pixels`` (``max_patches`` rows), until the sample index records per-image counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mimotron.config.hf_resolve import tower_kwargs
from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.data import build_datasets
from mimotron.data.native_mock import grid_distribution
from mimotron.data.run_data import build_tokenizer
from mimotron.estimate.widths import encoder_batching_factor
from mimotron.parallel.layout import Layout
from mimotron.pipeline.actions import BACKWARD, FORWARD
from mimotron.pipeline.edges import slice_range
from mimotron.pipeline.interleaved_actions import build_rank_actions

__all__ = ["HeldImages", "ImageStats", "bound_stats", "counts_source", "grid_stats", "held_images",
           "image_stats", "image_steps", "native_encoders", "window_units"]

MAX_COUNTED_SAMPLES = 8192
"""Samples whose grids :func:`image_steps` lets the memory estimate read (about 40 us
each): the first ``max(1, 8192 // global_batch_size)`` steps of the run."""


@dataclass(frozen=True)
class ImageStats:
    """What the FLOP count needs of one present image, on average.

    Attributes:
        patches: real patch rows (``t * h * w``).
        frame_square: the sum over its frames of ``(h * w)**2`` (full-attention
            segments: each query reads every key of its frame).
        window_square: the sum over its windows of ``rows**2`` (Qwen2.5-VL's window
            segments; 0 for a tower without windows).
        source: where the counts come from (one phrase, for ``mimotron plan``).
    """

    patches: float
    frame_square: float
    window_square: float
    source: str


@dataclass(frozen=True)
class HeldImages:
    """The images one rank of a module holds at the peak of its plan.

    Attributes:
        patches: real patch rows of the forwards held at the peak.
        images: present images of those forwards.
        step_slots: image slots of all the step's micro-batches (a step's batches are
            on the device together, each slot ``max_patches`` rows, absent images too).
        largest_patches: real patch rows of the largest micro-batch (one backward's
            temporaries).
        source: where the counts come from (one phrase).
    """

    patches: int
    images: int
    step_slots: int
    largest_patches: int
    source: str


def native_encoders(cfg: MimoConfig) -> list[str]:
    """The native-resolution vision modules of ``cfg`` (``hf_native`` set), in order."""
    return [n for n in cfg.encoder_names if cfg.modules[n].hf_native is not None]


def counts_source(cfg: MimoConfig) -> str:
    """``"mock"`` where each sample's grid is known (``data.dataset = "mock"`` without
    packing), else ``"bound"`` (every slot at ``max_pixels``)."""
    return "mock" if cfg.data.dataset == "mock" and not cfg.data.packing else "bound"


def window_units(mod: ModuleConfig) -> int:
    """A Qwen2.5-VL window's side in merge blocks; 0 for a tower without windows."""
    args = tower_kwargs(mod)
    if "window_size" not in args:
        return 0
    return int(args["window_size"]) // (int(args["patch_size"]) * int(args["spatial_merge_size"]))


def _square_sums(sides: np.ndarray, units: int) -> np.ndarray:
    """Per side length (in merge blocks), the sum of the squared lengths of its cuts
    into runs of ``units`` (the last one shorter)."""
    return (sides // units) * units**2 + (sides % units) ** 2


def grid_stats(grids: Sequence[Sequence[int]] | np.ndarray, merge_size: int,
               windows: int, weights: Sequence[float] | np.ndarray | None = None,
               source: str = "") -> ImageStats:
    """The :class:`ImageStats` of images of the given grids (their weighted mean).

    Args:
        grids: ``(t, h, w)`` per image, in patches (``h``, ``w`` multiples of
            ``merge_size``).
        merge_size: patches per merged token side.
        windows: a window's side in merge blocks (:func:`window_units`; 0: none).
        weights: each grid's probability (``None``: equal).
        source: the phrase :attr:`ImageStats.source` carries.
    """
    g = np.asarray(grids, dtype=np.float64).reshape(-1, 3)
    w = (np.full(len(g), 1.0 / max(len(g), 1)) if weights is None
         else np.asarray(weights, dtype=np.float64))
    t, h, wd = g[:, 0], g[:, 1], g[:, 2]
    frame = h * wd
    window = np.zeros_like(frame)
    if windows:
        unit = merge_size**2
        rows = _square_sums((h // merge_size).astype(np.int64), windows)
        cols = _square_sums((wd // merge_size).astype(np.int64), windows)
        window = t * rows * cols * unit**2
    return ImageStats(float(w @ (t * frame)), float(w @ (t * frame**2)), float(w @ window),
                      source)


def bound_stats(mod: ModuleConfig) -> ImageStats:
    """The bound of a native module's per-image counts: an image of ``max_patches`` rows
    in one frame, its windows full."""
    vision = mod.hf_native
    assert vision is not None, "bound_stats of a module that is not native-resolution"
    rows, windows = vision.max_patches, window_units(mod)
    window_rows = (windows * vision.merge_size) ** 2 if windows else 0
    return ImageStats(rows, float(rows) ** 2, float(rows) * min(rows, window_rows),
                      f"the max_pixels={vision.max_pixels} bound")


def image_stats(cfg: MimoConfig, name: str) -> ImageStats:
    """The per-image counts of native module ``name`` that the FLOP count uses:
    ``data.dataset = "mock"``, the expectation under the mock's grid law; otherwise
    :func:`bound_stats`."""
    mod = cfg.modules[name]
    if counts_source(cfg) != "mock":
        return bound_stats(mod)
    grids, probs = grid_distribution(mod.hf_native)
    return grid_stats(grids, mod.hf_native.merge_size, window_units(mod), probs,
                      "the mock data's expected grid")


def image_steps(cfg: MimoConfig) -> range:
    """The steps whose samples the memory estimate reads (mock data): the first
    ``train.iters``, at most :data:`MAX_COUNTED_SAMPLES` samples' worth (one step at least)."""
    return range(min(cfg.train.iters, max(1, MAX_COUNTED_SAMPLES // cfg.train.global_batch_size)))


def _sample_counts(cfg: MimoConfig, name: str, num_samples: int,
                   memo: dict[tuple[object, ...], Any] | None) -> tuple[np.ndarray, np.ndarray]:
    """Per stream position ``[0, num_samples)``: ``(patch rows, images)`` of the samples
    of native module ``name``'s modality (the run's training stream)."""
    data = cfg.data  # what the stream's grids depend on
    key = ("native-sample-counts", name, num_samples, cfg.train.seed, data.mock_num_samples,
           data.train_fraction, cfg.modules[name].hf_native)
    if memo is not None and key in memo:
        return memo[key]
    # The character tokenizer and a task that draws grids here, not pixels.
    task, _ = build_datasets(cfg, build_tokenizer(cfg))
    stream = task.stream(cfg.train.seed)
    patches = np.zeros(num_samples, dtype=np.int64)
    for p, (index, epoch) in enumerate(stream.items(0, num_samples)):
        grid = task.image_grid(index, epoch)
        patches[p] = 0 if grid is None else grid[0] * grid[1] * grid[2]
    out = (patches, (patches > 0).astype(np.int64))
    if memo is not None:
        memo[key] = out
    return out


def _held_sets(cfg: MimoConfig, layout: Layout, name: str, stage: int) -> list[frozenset[int]]:
    """The micro-batches whose forward (of model chunk 0) a stage holds, after each
    compute of its training plan."""
    m = cfg.num_microbatches
    if encoder_batching_factor(cfg, name, layout) > 1:
        return [frozenset(range(m))]  # the whole step's forwards before any backward
    plan = build_rank_actions(layout, name, stage, m, pipelined=cfg.train.schedule == "1f1b")
    held: set[int] = set()
    out = []
    for action in plan:
        if action.chunk != 0 or action.kind not in (FORWARD, BACKWARD):
            continue
        (held.add if action.kind == FORWARD else held.discard)(action.microbatch)
        out.append(frozenset(held))
    return out or [frozenset()]


def held_images(cfg: MimoConfig, layout: Layout, name: str, stage: int, dp: int,
                per_patch: float, per_image: float, steps: range | None = None,
                memo: dict[tuple[object, ...], Any] | None = None) -> HeldImages:
    """The native images one rank of module ``name`` holds at the peak of its plan.

    The rank is data-parallel replica ``dp`` of its module's pipeline ``stage``: it
    runs (or, for the language model, receives the features of) the images of its
    slice of each micro-batch. The peak is the held set of forwards (the plan
    replayed, :func:`~mimotron.pipeline.interleaved_actions.build_rank_actions`) whose
    ``per_patch * patches + per_image * images`` bytes are largest, over the steps
    ``steps`` (``None``: :func:`image_steps`); with the bound every slot is full.

    Args:
        cfg: the run config.
        layout: its layout.
        name: the module holding the images (a native vision module or the language
            model).
        stage: the rank's pipeline stage.
        dp: the rank's data-parallel replica.
        per_patch: bytes a held patch row costs.
        per_image: bytes a held present image costs.
        steps: the training steps to read (mock data).
        memo: a dict kept across calls (the per-sample counts of the stream).
    """
    native = native_encoders(cfg)
    assert native, "held_images of a config without a native-resolution module"
    vision = cfg.modules[native[0]].hf_native
    mbs, m = cfg.train.micro_batch_size, cfg.num_microbatches
    lo, hi = slice_range(mbs, layout.modules[name].parallel.data, dp)
    step_slots = m * (hi - lo) * cfg.data.max_images_per_sample
    held = _held_sets(cfg, layout, name, stage)
    if counts_source(cfg) == "bound":
        n = max(len(s) for s in held) * (hi - lo) * cfg.data.max_images_per_sample
        return HeldImages(n * vision.max_patches, n, step_slots,
                          (hi - lo) * cfg.data.max_images_per_sample * vision.max_patches,
                          f"the max_pixels={vision.max_pixels} bound (every image slot full)")
    steps = image_steps(cfg) if steps is None else steps
    g = cfg.train.global_batch_size
    patches, images = _sample_counts(cfg, native[0], steps.stop * g, memo)
    shape = (len(steps), m, mbs)
    mb_patches = patches[steps.start * g:steps.stop * g].reshape(shape)[:, :, lo:hi].sum(-1)
    mb_images = images[steps.start * g:steps.stop * g].reshape(shape)[:, :, lo:hi].sum(-1)
    best = (-1.0, 0, 0)
    for s in range(len(steps)):
        for group in held:
            ids = sorted(group)
            p, i = int(mb_patches[s, ids].sum()), int(mb_images[s, ids].sum())
            best = max(best, (per_patch * p + per_image * i, p, i))
    span = f"step {steps.start + 1}" if len(steps) == 1 else \
        f"steps {steps.start + 1}-{steps.stop}"
    return HeldImages(best[1], best[2], step_slots, int(mb_patches.max(initial=0)),
                      f"the mock data's grids ({span}, the largest held micro-batches)")
