"""Videos at native resolution for a Qwen2.5-VL / Qwen3-VL tower: frames, sampling, patches, text.

A native vision module reads a sample's images **and videos** as its items, in the order
their placeholders appear in the text (one video = one item, in the same slots as an
image). This file holds what turns one video into such an item:

* **decoding**: a video is a file, decoded with PyAV (package ``av``), or a folder of frame
  images (its files sorted by name, read with PIL; its frame rate is the sampling rate,
  so all of its frames are kept, as if already sampled). :func:`video_metadata` reads the
  frame count, frame rate and size without decoding a frame (the stream header; a folder's
  file count and its first frame's header), so the data check and a rank that never
  decodes (the language model's) know every video's grid and tokens;
* **sampling** (:class:`FrameSampling`): ``transformers``' rule of the family's video
  processor, ``Qwen2VLVideoProcessor.sample_frames`` (Qwen2.5-VL: ``fps`` frames per
  second within ``[min_frames, max_frames]``, a multiple of ``temporal_patch_size``) or
  ``Qwen3VLVideoProcessor.sample_frames`` (Qwen3-VL: evenly spaced, the last frame
  repeated up to a multiple of ``temporal_patch_size``), with the values of the folder's
  video processor file when it has them (``processor_config.json``'s ``video_processor``,
  ``video_preprocessor_config.json``, else ``preprocessor_config.json``, as
  ``transformers`` looks them up), else the class defaults. Sampling is always on (the
  Qwen2.5-VL class leaves it off for backward compatibility; a file saying
  ``do_sample_frames: false`` keeps every frame), and where no ``fps`` is set (the
  Qwen2.5-VL class has none) 2 frames per second are sampled, the rate of the Qwen
  team's ``qwen-vl-utils``;
* **size**: the whole video fits one item's slots: ``t * h * w <= max_patches``. Each
  frame is resized with the family's ``smart_resize`` under the per-frame bound
  ``max_pixels * temporal_patch_size // num_frames`` (``num_frames``: the sampled frames,
  padded to a multiple of ``temporal_patch_size``), but never below ``min_pixels``; a
  video whose frames do not fit even at ``min_pixels`` is refused;
* **pixels**: nothing of the resize or the normalisation is ours. ``transformers``'
  image processor (:class:`~mimotron.data.native_images.NativeImageProcessor`) runs on
  each frame at the video's target size; each frame's own (first temporal copy) patch
  values are kept, and frames are grouped ``temporal_patch_size`` at a time into the video
  patch rows of the family's ``pixel_values_videos`` (``t * h * w`` rows, in
  ``transformers``' order: temporal step, then the image's row order; within a row channel,
  then frame, then the patch's pixels). The video processor itself needs ``torchvision``,
  which is not installed; it resizes with ``torchvision`` where the image processor uses
  PIL, so pixels may differ from it slightly (the grids do not);
* **text**: Qwen2.5-VL writes a video as ``<|vision_start|>``, one ``<|video_pad|>`` per
  merged token, ``<|vision_end|>``; Qwen3-VL writes each temporal step as its timestamp
  ``<{seconds:.1f} seconds>`` (the mean time of its first and last frame) then
  ``<|vision_start|>``, the step's ``<|video_pad|>`` tokens, ``<|vision_end|>``, as
  ``transformers``' processors do. :meth:`NativeVideoProcessor.text` gives it with one
  pad per run, :meth:`NativeVideoProcessor.runs` the count each run expands to.

``transformers`` and ``av`` are imported when used, never at import time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mimotron.config.hf_folder import PROCESSOR_FILE, read_preprocessor_config
from mimotron.data.native_images import Grid, NativeImageProcessor

__all__ = ["VIDEO_PROCESSOR_FILE", "FrameSampling", "NativeVideoProcessor", "VideoMeta",
           "VideoPlan", "decode_frames", "frame_files", "read_video_config", "video_metadata"]

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
# transformers' class defaults (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor) of the
# sampling keys a folder's file may leave out.
_SAMPLING_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {"fps": None, "num_frames": None, "min_frames": 4, "max_frames": 768},
    "qwen3_vl": {"fps": 2, "num_frames": None, "min_frames": 4, "max_frames": 768},
}
# qwen-vl-utils' sampling rate, used where neither the file nor the class sets one.
_FALLBACK_FPS = 2.0
# The video file's keys that must agree with the image processor, which does the work.
_SHARED_KEYS = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std",
                "patch_size", "merge_size", "temporal_patch_size")


@dataclass(frozen=True)
class VideoMeta:
    """What a video's header says: ``num_frames`` frames at ``fps``, ``width`` x ``height``."""

    num_frames: int
    fps: float
    width: int
    height: int


def frame_files(folder: Path) -> list[Path]:
    """A frame folder's images, sorted by name (hidden files and other files left out)."""
    from PIL import Image  # Deferred: only media-reading runs need PIL.

    known = Image.registered_extensions()
    return sorted(f for f in folder.iterdir()
                  if f.is_file() and not f.name.startswith(".") and f.suffix.lower() in known)


def video_metadata(path: Path, folder_fps: float) -> VideoMeta:
    """The frame count, rate and size of a video file or frame folder, no frame decoded.

    Args:
        path: a video file (PyAV's stream header) or a folder of frame images.
        folder_fps: a folder's frame rate (the sampling rate: its frames are all kept).

    Raises:
        ValueError: one line naming the file: unreadable, no video stream, no frames, no
            frame rate.
    """
    if path.is_dir():
        from PIL import Image

        files = frame_files(path)
        if not files:
            raise ValueError(f"video folder {str(path)!r} holds no frame images: expected "
                             "one image file per frame")
        try:
            with Image.open(files[0]) as image:
                width, height = image.size
        except Exception as exc:  # noqa: BLE001 - any decoding failure is an unreadable frame
            raise ValueError(f"video frame {str(files[0])!r} is unreadable: {exc}") from exc
        return VideoMeta(len(files), float(folder_fps), int(width), int(height))
    import av  # Deferred: only video runs need PyAV.

    try:
        container = av.open(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure to open is an unreadable video
        raise ValueError(f"video file {str(path)!r} is unreadable: "
                         f"{' '.join(str(exc).split())}") from exc
    with container:
        if not container.streams.video:
            raise ValueError(f"video file {str(path)!r} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        frames = int(stream.frames)
        if not frames and rate and container.duration:
            # Containers that keep no frame count (WebM, MKV): their duration at the rate.
            frames = round(container.duration / av.time_base * float(rate))
        width, height = stream.codec_context.width, stream.codec_context.height
    if frames < 1:
        raise ValueError(f"video file {str(path)!r} has no frames")
    if not rate:
        raise ValueError(f"video file {str(path)!r} has no frame rate in its header")
    return VideoMeta(frames, float(rate), int(width), int(height))


def decode_frames(path: Path, indices: Sequence[int]) -> list[Any]:
    """The RGB PIL images of frames ``indices`` (repeats allowed) of a video or folder.

    Raises:
        ValueError: a frame that does not decode, or fewer frames than an index needs.
    """
    wanted = set(indices)
    got: dict[int, Any] = {}
    if path.is_dir():
        from PIL import Image

        files = frame_files(path)
        for i in sorted(wanted):
            if i >= len(files):
                break
            try:
                with Image.open(files[i]) as image:
                    got[i] = image.convert("RGB")
            except Exception as exc:  # noqa: BLE001 - as in video_metadata
                raise ValueError(f"video frame {str(files[i])!r} is unreadable: {exc}") from exc
    else:
        import av

        try:
            with av.open(str(path)) as container:
                for i, frame in enumerate(container.decode(video=0)):
                    if i in wanted:
                        got[i] = frame.to_image()  # rgb24, as transformers' PyAV reader
                    if len(got) == len(wanted):
                        break
        except Exception as exc:  # noqa: BLE001 - any decoding failure: unreadable
            raise ValueError(f"video file {str(path)!r} is unreadable: "
                             f"{' '.join(str(exc).split())}") from exc
    missing = sorted(wanted - set(got))
    if missing:
        raise ValueError(f"video {str(path)!r} has no frame {missing[0]}: it decodes to fewer "
                         "frames than its header declares, or it changed")
    return [got[i] for i in indices]


@dataclass(frozen=True)
class FrameSampling:
    """A family's frame sampling rule and its values (module docstring).

    Attributes:
        family: ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        temporal_patch_size: frames per temporal patch.
        fps: frames to sample per second of video.
        min_frames: the fewest frames the rate may give.
        max_frames: the most frames sampled.
        num_frames: a fixed frame count instead of the rate (``None``: the rate).
        enabled: ``False``: every frame is kept (the file's ``do_sample_frames: false``).
    """

    family: str
    temporal_patch_size: int
    fps: float
    min_frames: int
    max_frames: int
    num_frames: int | None = None
    enabled: bool = True

    def indices(self, meta: VideoMeta) -> list[int]:
        """The sampled frame indices of a video (``transformers``' ``frames_indices``).

        Raises:
            ValueError: the rule cannot sample the video (fewer frames than it needs).
        """
        total = meta.num_frames
        if not self.enabled:
            return list(range(total))
        if self.family == "qwen3_vl":
            count = self.num_frames
            if count is None:
                count = int(total / meta.fps * self.fps)
                count = min(max(count, self.min_frames), self.max_frames, total)
            return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int)]
        tps = self.temporal_patch_size
        if self.num_frames is not None:
            count = round(self.num_frames / tps) * tps
        else:
            most = math.floor(min(self.max_frames, total) / tps) * tps
            count = min(max(total / meta.fps * self.fps, self.min_frames), most, total)
            count = math.floor(count / tps) * tps
        if count < 1 or count > total:
            raise ValueError(f"the video has {total} frame(s), from which Qwen2.5-VL's "
                             f"sampling takes {count}: expected a positive multiple of "
                             f"temporal_patch_size={tps}, at most the video's frames")
        # The float step sometimes gives one index more; kept, as transformers' does.
        return torch.arange(0, total, total / count).int().tolist()


@dataclass(frozen=True)
class VideoPlan:
    """One video as an item, decided from its header alone.

    Attributes:
        indices: the sampled frame indices (``transformers``' ``frames_indices``).
        num_frames: the video's frame count.
        fps: its frame rate (a folder's: the sampling rate).
        grid: the ``(t, h, w)`` patch grid of the item.
        max_frame_pixels: the area bound each frame was resized under.
        temporal_patch_size: frames per temporal step.
    """

    indices: tuple[int, ...]
    num_frames: int
    fps: float
    grid: Grid
    max_frame_pixels: int
    temporal_patch_size: int

    @property
    def padded_indices(self) -> list[int]:
        """The frames of the item: the sampled ones, the last repeated up to ``t`` steps."""
        return list(self.indices) + [self.indices[-1]] * (-len(self.indices)
                                                          % self.temporal_patch_size)

    @property
    def sampled_fps(self) -> float:
        """Frames per second after sampling (``transformers``' ``sampled_fps``)."""
        return len(self.indices) / self.num_frames * self.fps

    @property
    def seconds_per_step(self) -> float:
        """Seconds between temporal steps (Qwen2.5-VL's ``second_per_grid_ts``)."""
        return self.temporal_patch_size / self.sampled_fps

    @property
    def timestamps(self) -> list[float]:
        """Each temporal step's time in seconds: the mean of its first and last frame's."""
        times = [i / self.fps for i in self.padded_indices]
        step = self.temporal_patch_size
        return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


def read_video_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """A folder's video processor settings and the file they came from.

    ``processor_config.json``'s ``video_processor`` table, else
    ``video_preprocessor_config.json``, else the image processor's file (the order
    ``transformers`` looks them up in).

    Raises:
        ValueError: a file that is not a JSON object, or none of them.
    """
    folder = Path(path)
    for name, table in ((PROCESSOR_FILE, "video_processor"), (VIDEO_PROCESSOR_FILE, None)):
        file = folder / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text())
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{str(file)!r} is not a JSON object: {exc}") from exc
        if table is not None:
            config = config.get(table) if isinstance(config, dict) else None
            if config is None:
                continue
        if not isinstance(config, dict):
            raise ValueError(f"{str(file)!r} is not a JSON object")
        return config, str(file) + (f" ({table})" if table else "")
    return read_preprocessor_config(folder), str(folder / "preprocessor_config.json")


class NativeVideoProcessor:
    """A Qwen-VL family's videos as items of its image processor (module docstring).

    Args:
        images: the run's image processor (patching, bounds, normalisation).
        family: ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        config: the folder's video processor settings (:func:`read_video_config`).
        where: what messages call that file.

    Raises:
        ValueError: one line naming the key: a family without a video rule, a video file
            whose patching or normalisation differs from the image processor's, or bad
            sampling values.
    """

    def __init__(self, images: NativeImageProcessor, family: str, config: Mapping[str, Any],
                 where: str = VIDEO_PROCESSOR_FILE) -> None:
        if family not in _SAMPLING_DEFAULTS:
            raise ValueError(f"model_type={family!r} has no video rule; expected one of "
                             f"{sorted(_SAMPLING_DEFAULTS)}")
        image_config = json.loads(images.hf.to_json_string())
        for key in _SHARED_KEYS:
            if key in config and config[key] != image_config.get(key):
                raise ValueError(f"{where} has {key}={config[key]!r} but the image processor "
                                 f"has {image_config.get(key)!r}: videos are cut by the image "
                                 "processor, so both must agree")
        values = {k: config.get(k, v) for k, v in _SAMPLING_DEFAULTS[family].items()}
        fps = float(values["fps"]) if values["fps"] is not None else _FALLBACK_FPS
        num = values["num_frames"]
        if num is not None and values["fps"] is not None:
            raise ValueError(f"{where} sets num_frames={num!r} with fps={values['fps']!r} (the "
                             "file's or the class default): they are mutually exclusive, as "
                             "in transformers; set fps to null to sample a fixed count")
        if fps <= 0 or int(values["min_frames"]) < 1 or int(values["max_frames"]) < 1 or (
                num is not None and int(num) < 1):
            raise ValueError(f"{where} has fps={values['fps']!r}, min_frames="
                             f"{values['min_frames']!r}, max_frames={values['max_frames']!r}, "
                             f"num_frames={num!r}: expected positive values")
        self.images, self.family = images, family
        self.sampling = FrameSampling(family, images.temporal_patch_size, fps,
                                      int(values["min_frames"]), int(values["max_frames"]),
                                      None if num is None else int(num),
                                      bool(config.get("do_sample_frames", True)))

    @classmethod
    def from_folder(cls, path: str | Path, images: NativeImageProcessor, family: str
                    ) -> NativeVideoProcessor:
        """The video processor of a Qwen-VL folder (:func:`read_video_config`).

        Raises:
            ValueError: as :func:`read_video_config` and the constructor.
        """
        config, where = read_video_config(path)
        return cls(images, family, config, where)

    def identity(self) -> dict[str, Any]:
        """What a video's grid, text and patches depend on (part of a data index's key)."""
        return {"family": self.family, "sampling": asdict(self.sampling)}

    # ---- counts -------------------------------------------------------------------------
    def plan(self, meta: VideoMeta) -> VideoPlan:
        """The sampled frames, grid and frame bound of a video from its header.

        Raises:
            ValueError: no frames, a rule that cannot sample it, a frame size the
                processor refuses, or frames that do not fit the slots even at
                ``min_pixels``.
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if meta.num_frames < 1 or meta.width < 1 or meta.height < 1:
            raise ValueError(f"the video has {meta.num_frames} frame(s) of {meta.width} x "
                             f"{meta.height} pixels: expected frames of a positive size")
        images, tps = self.images, self.sampling.temporal_patch_size
        indices = tuple(self.sampling.indices(meta))
        steps = -(-len(indices) // tps)
        bound = max(images.max_pixels * tps // (steps * tps), images.min_pixels)
        try:
            height, width = smart_resize(meta.height, meta.width, images.unit,
                                         images.min_pixels, bound)
        except ValueError as exc:
            raise ValueError(f"its frames are {meta.width} x {meta.height} pixels (width x "
                             f"height), which the Qwen-VL image processor refuses: {exc}"
                             ) from None
        grid = (steps, height // images.patch_size, width // images.patch_size)
        if grid[0] * grid[1] * grid[2] > images.max_patches:
            raise ValueError(f"its {len(indices)} sampled frames need {steps} x {grid[1]} x "
                             f"{grid[2]} patches even at min_pixels={images.min_pixels}: more "
                             f"than max_pixels={images.max_pixels} holds ({images.max_patches} "
                             "patch rows); raise max_pixels, or sample fewer frames (fps, "
                             "max_frames of the folder's video processor file)")
        return VideoPlan(indices, meta.num_frames, meta.fps, grid, bound, tps)

    def plan_file(self, path: Path) -> VideoPlan:
        """:meth:`plan` of a video file or frame folder (its header only).

        Raises:
            ValueError: one line naming the file: as :func:`video_metadata` and :meth:`plan`.
        """
        meta = video_metadata(path, self.sampling.fps)
        try:
            return self.plan(meta)
        except ValueError as exc:
            raise ValueError(f"video {str(path)!r}: {exc}") from None

    def tokens(self, plan: VideoPlan) -> int:
        """Merged tokens of the video (its item's tokens)."""
        t, h, w = plan.grid
        return t * h * w // self.images.merge_size**2

    # ---- text ---------------------------------------------------------------------------
    def text(self, plan: VideoPlan, start: str, pad: str, end: str) -> str:
        """The model's text of the video, one ``pad`` per run (:meth:`runs` expands them).

        Args:
            plan: the video.
            start: ``<|vision_start|>``.
            pad: ``<|video_pad|>``.
            end: ``<|vision_end|>``.
        """
        if self.family == "qwen3_vl":
            return "".join(f"<{s:.1f} seconds>{start}{pad}{end}" for s in plan.timestamps)
        return f"{start}{pad}{end}"

    def runs(self, plan: VideoPlan) -> list[int]:
        """The pad count of each run of :meth:`text`: one run (Qwen2.5-VL) or one per step."""
        t, h, w = plan.grid
        per_step = h * w // self.images.merge_size**2
        return [per_step] * t if self.family == "qwen3_vl" else [t * per_step]

    # ---- pixels -------------------------------------------------------------------------
    def patches(self, frames: Sequence[Any], plan: VideoPlan) -> torch.Tensor:
        """Float32 ``[t * h * w, patch_dim]``: the video patch rows of ``frames``.

        Args:
            frames: the item's PIL frames (:attr:`VideoPlan.padded_indices`, in order).
            plan: the video's plan (its grid and frame bound).

        Raises:
            ValueError: frames of different sizes, or another count than the plan's.
        """
        images, tps = self.images, plan.temporal_patch_size
        t, h, w = plan.grid
        sizes = {tuple(f.size) for f in frames}
        if len(frames) != t * tps or len(sizes) != 1:
            raise ValueError(f"{len(frames)} frames of sizes {sorted(sizes)}: expected {t * tps} "
                             "frames of one size")
        size = {"shortest_edge": images.min_pixels, "longest_edge": plan.max_frame_pixels}
        out = images.hf(images=list(frames), size=size, return_tensors="np")
        grids = {tuple(int(v) for v in g) for g in out["image_grid_thw"]}
        assert grids == {(1, h, w)}, f"processor grids {grids} != the plan's {(1, h, w)}"
        channels, area = images.patch_dim // (tps * images.patch_size**2), images.patch_size**2
        rows = np.asarray(out["pixel_values"], dtype=np.float32)
        # [frame, row, channel, temporal copy, pixel]: each frame's own values are copy 0.
        own = rows.reshape(t * tps, h * w, channels, tps, area)[:, :, :, 0]
        # Frames grouped by temporal step: a row holds channel, then frame, then pixel.
        video = own.reshape(t, tps, h * w, channels, area).transpose(0, 2, 3, 1, 4)
        return torch.from_numpy(np.ascontiguousarray(video.reshape(t * h * w, -1)))

    def __call__(self, path: Path, plan: VideoPlan) -> torch.Tensor:
        """The patch rows of a video file or folder (:meth:`patches` of its decoded frames).

        Raises:
            ValueError: as :func:`decode_frames` and :meth:`patches`.
        """
        return self.patches(decode_frames(path, plan.padded_indices), plan)

    def __repr__(self) -> str:
        return f"NativeVideoProcessor({self.family}, {self.sampling})"
