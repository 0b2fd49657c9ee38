"""Image and audio files -> encoder inputs: a vision tower's and Whisper's preprocessing.

**Images** (:class:`ImageProcessor`) go through PIL exactly as the CLIP and SigLIP image
processors of ``transformers`` (their PIL backend) do: convert to RGB (transparent
pixels composited onto white), resize (``shortest_edge``: the short side to that length,
the long side ``int(length * long / short)``; or ``height``/``width``: a plain resize)
with the configured resampling filter, center-crop (zero-padded when the image is
smaller), rescale (``x * rescale_factor`` in float64, then float32) and normalise
(``(x - mean) / std`` per channel in float32). The settings come from a local
``preprocessor_config.json`` (:meth:`ImageProcessor.from_pretrained`) or from arguments.

**The resize bound.** Under ``shortest_edge`` the long side grows with the aspect ratio:
a 2 x 20 000 000 PNG of 58 KB resizes to 224 x 2 240 000 000 pixels, a ``MemoryError``.
An image whose resized size (the image before the center crop) would hold more than
:data:`MAX_RESIZE_FACTOR` times the pixels of the processed image is refused
(:meth:`ImageProcessor.check_size`): the data check reads the size from the file's
header, before decoding, and the processor checks it again before resizing. With
CLIP's 224-pixel shortest edge and crop that is a long side of at most 64 x 224 (an
aspect ratio of 64); a ``height``/``width`` resize has a fixed size and no bound.

**Audio** (:class:`AudioFeatures`) is a WAV file read with the standard library's
``wave`` module (8/16/24/32-bit PCM; channels averaged to mono; integer samples scaled to
[-1, 1) by their full range) and turned into Whisper's log-mel features by
``transformers``' ``WhisperFeatureExtractor`` (padded or cut to its ``chunk_length``,
so every clip has the same ``[feature_size, nb_max_frames]`` shape). A file at another
sample rate is refused, never silently resampled.
"""

from __future__ import annotations

import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from mimotron.config.hf_folder import read_preprocessor_config

# transformers' defaults for a CLIP image processor (OPENAI_CLIP_MEAN / _STD).
CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
MAX_RESIZE_FACTOR = 64
"""The resized image (before the center crop) may hold at most this many times the
pixels of the processed image (module docstring)."""
# What a preprocessor_config.json leaves out takes its family's class defaults in
# transformers (SigLIP: mean/std 0.5, a plain square resize, no crop).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224}, "do_center_crop": False,
        "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
    },
}  # fmt: skip


@dataclass(frozen=True)
class ImageProcessor:
    """A vision tower's preprocessing (defaults: CLIP ViT-L/14 at 224 pixels).

    Attributes:
        size: ``{"shortest_edge": n}`` or ``{"height": h, "width": w}``.
        crop_size: ``{"height": h, "width": w}`` of the center crop.
        do_resize: resize first.
        do_center_crop: crop after resizing (needed with ``shortest_edge``, whose
            output shape otherwise depends on the image).
        resample: PIL resampling filter id (3 = bicubic).
        do_rescale: multiply by ``rescale_factor``.
        rescale_factor: usually ``1 / 255``.
        do_normalize: subtract ``image_mean`` and divide by ``image_std``.
        image_mean: per-channel mean.
        image_std: per-channel standard deviation.
    """

    size: tuple[tuple[str, int], ...] = (("shortest_edge", 224),)
    crop_size: tuple[tuple[str, int], ...] = (("height", 224), ("width", 224))
    do_resize: bool = True
    do_center_crop: bool = True
    resample: int = _BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    def __post_init__(self) -> None:
        size = dict(self.size)
        if set(size) not in ({"shortest_edge"}, {"height", "width"}):
            raise ValueError(f"size={size!r} is invalid: expected {{'shortest_edge': n}} or "
                             "{'height': h, 'width': w}")  # fmt: skip
        if set(dict(self.crop_size)) != {"height", "width"}:
            raise ValueError(f"crop_size={dict(self.crop_size)!r} is invalid: expected "
                             "{'height': h, 'width': w}")  # fmt: skip
        if "shortest_edge" in size and self.do_resize and not self.do_center_crop:
            raise ValueError("size={'shortest_edge': ...} without do_center_crop gives images of "
                             "varying shape: expected do_center_crop=True or a height/width size")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean={self.image_mean!r}, image_std={self.image_std!r} are "
                             "invalid: expected 3 values each (RGB)")  # fmt: skip

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ImageProcessor:
        """Settings from a ``preprocessor_config.json`` dict.

        Missing keys take the defaults of the dict's ``image_processor_type`` family
        (SigLIP or, for any other type, CLIP). An int ``size`` or ``crop_size`` means a
        square.
        """
        def as_items(value: Any) -> tuple[tuple[str, int], ...]:
            value = {"height": value, "width": value} if isinstance(value, int) else value
            return tuple(sorted((str(k), int(v)) for k, v in dict(value).items()))

        family = str(config.get("image_processor_type", "")).removesuffix("Fast")
        config = _FAMILY_DEFAULTS.get(family.removesuffix("Pil"), {}) | dict(config)
        fields: dict[str, Any] = {}
        for key in ("size", "crop_size"):
            if key in config:
                fields[key] = as_items(config[key])
        for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize"):
            if key in config:
                fields[key] = bool(config[key])
        for key, kind in (("resample", int), ("rescale_factor", float)):
            if key in config:
                fields[key] = kind(config[key])
        for key in ("image_mean", "image_std"):
            if key in config:
                fields[key] = tuple(float(v) for v in config[key])
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ImageProcessor:
        """Settings from ``<path>/preprocessor_config.json`` (a local folder only).

        Raises:
            ValueError: the file is missing or not JSON.
        """
        return cls.from_dict(read_preprocessor_config(path))

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """``(3, height, width)`` of every processed image."""
        if self.do_center_crop:
            crop = dict(self.crop_size)
            return (3, crop["height"], crop["width"])
        size = dict(self.size)
        return (3, size["height"], size["width"])

    def check_size(self, width: int, height: int) -> None:
        """Raise if an image of ``width`` x ``height`` would resize past the bound.

        The bound (module docstring): the resized image holds at most
        :data:`MAX_RESIZE_FACTOR` times the pixels of :attr:`output_shape`. Python ints:
        no overflow, whatever the header declares.

        Raises:
            ValueError: names both sizes, the bound and the fix.
        """
        if not self.do_resize or "shortest_edge" not in dict(self.size):
            return  # a fixed-size resize, or none: nothing grows with the aspect ratio
        if width < 1 or height < 1:
            raise ValueError(f"the image is {width} x {height} pixels: expected a positive size")
        _, out_h, out_w = self.output_shape
        limit = MAX_RESIZE_FACTOR * out_h * out_w
        new_w, new_h = self._resized_size(width, height)
        if new_w * new_h > limit:
            raise ValueError(
                f"the image is {width} x {height} pixels (width x height), which the image "
                f"processor (shortest_edge {dict(self.size)['shortest_edge']}) would resize "
                f"to {new_w} x {new_h} = {new_w * new_h} pixels, over the bound of {limit} "
                f"({MAX_RESIZE_FACTOR} x the {out_w} x {out_h} processed image): crop or pad "
                "the image nearer to its processed aspect ratio"
            )

    def _resized_size(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` after resizing (transformers' rule)."""
        size = dict(self.size)
        if "shortest_edge" not in size:
            return size["width"], size["height"]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)

    def __call__(self, image: Any) -> torch.Tensor:
        """Preprocess one PIL image.

        Args:
            image: a ``PIL.Image.Image`` (any mode).

        Returns:
            Float32 ``[3, H, W]`` pixel values (:attr:`output_shape`).
        """
        self.check_size(*image.size)  # before converting or resizing anything
        image = to_rgb(image)
        if self.do_resize:
            image = image.resize(self._resized_size(*image.size), resample=self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
        if self.do_center_crop:
            crop = dict(self.crop_size)
            pixels = center_crop(pixels, crop["height"], crop["width"])
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels.astype(np.float32, copy=False)
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32))


def to_rgb(image: Any) -> Any:
    """RGB PIL image; transparency is composited onto white (as transformers does)."""
    from PIL import Image  # Deferred: only media-reading runs need PIL.

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Center ``[C, H, W]`` crop; an image smaller than the crop is zero-padded around."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)  # ceil, as transformers
    padded[:, pad_top : pad_top + h, pad_left : pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    rows = slice(max(0, top), min(new_h, top + height))
    return padded[:, rows, max(0, left) : min(new_w, left + width)]


# ---- audio ------------------------------------------------------------------------------
WavSource = str | Path | BinaryIO
"""A WAV file's path, or its bytes as a seekable stream (a tar shard's member)."""


def _open_wav(source: WavSource) -> wave.Wave_read:
    if isinstance(source, str | Path):
        return wave.open(str(source), "rb")
    source.seek(0)
    return wave.open(source, "rb")


def _wav_name(source: WavSource) -> str:
    """What messages call ``source``: its path, or the stream's ``name``."""
    return str(source) if isinstance(source, str | Path) else str(getattr(source, "name", source))


@dataclass(frozen=True)
class WavInfo:
    """Header of a WAV file."""

    sample_rate: int
    channels: int
    sample_width: int
    num_frames: int


def wav_info(path: WavSource) -> WavInfo:
    """Read only the header of a PCM WAV file.

    Raises:
        ValueError: not a PCM WAV file, or a sample width other than 1-4 bytes.
    """
    try:
        with _open_wav(path) as f:
            info = WavInfo(f.getframerate(), f.getnchannels(), f.getsampwidth(), f.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"{_wav_name(path)!r} is not a readable PCM WAV file: {exc}") from exc
    if info.sample_width not in (1, 2, 3, 4):
        raise ValueError(f"{_wav_name(path)!r} has {info.sample_width}-byte samples: "
                         "expected 1-4")  # fmt: skip
    return info


def read_wav(path: WavSource) -> tuple[np.ndarray, int]:
    """Samples of a PCM WAV file as mono float32 in [-1, 1), and its sample rate.

    8-bit samples are unsigned (offset 128); wider ones are signed little-endian and
    scaled by ``2 ** (bits - 1)``. Channels are averaged.

    Raises:
        ValueError: not a readable PCM WAV file, or its data ends inside a frame.
    """
    info = wav_info(path)
    try:
        with _open_wav(path) as f:
            raw = f.readframes(info.num_frames)
    except (wave.Error, EOFError, OSError) as exc:
        raise ValueError(f"{_wav_name(path)!r} is not a readable PCM WAV file: {exc}") from exc
    width = info.sample_width
    frame = width * info.channels
    if len(raw) % frame:
        # A file cut inside a frame (odd byte count, a channel missing) has a valid header
        # but no sound for its last frame: refused, not silently trimmed.
        raise ValueError(f"{_wav_name(path)!r} is truncated: {len(raw)} bytes of samples, not a "
                         f"whole number of {frame}-byte frames")  # fmt: skip
    if width == 1:
        values = np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0
    elif width == 3:
        bytes3 = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        as_int = bytes3[:, 0] | (bytes3[:, 1] << 8) | (bytes3[:, 2] << 16)
        values = np.where(as_int >= 1 << 23, as_int - (1 << 24), as_int).astype(np.float64)
    else:
        values = np.frombuffer(raw, dtype=f"<i{width}").astype(np.float64)
    values = values / float(2 ** (8 * width - 1))
    mono = values.reshape(-1, info.channels).mean(axis=1)
    return mono.astype(np.float32), info.sample_rate


class AudioFeatures:
    """Whisper log-mel features of WAV files (``transformers``' ``WhisperFeatureExtractor``).

    Args:
        path: a local folder with Whisper's ``preprocessor_config.json``; ``None`` builds
            the extractor from ``kwargs``.
        **kwargs: ``WhisperFeatureExtractor`` arguments (``feature_size``,
            ``sampling_rate``, ``hop_length``, ``chunk_length``, ``n_fft``), used when
            ``path`` is ``None``.

    Raises:
        ValueError: a missing folder, or ``dither`` other than 0 (it would make a sample
            depend on more than its index).
    """

    def __init__(self, path: str | Path | None = None, **kwargs: Any) -> None:
        from transformers import WhisperFeatureExtractor  # Deferred: slow import.

        config = read_preprocessor_config(path) if path is not None else {}
        config = {k: v for k, v in config.items() if k not in ("feature_extractor_type",
                                                                "processor_class")}  # fmt: skip
        self.extractor = WhisperFeatureExtractor(**(config | kwargs))
        if float(getattr(self.extractor, "dither", 0.0)) != 0.0:
            raise ValueError(f"dither={self.extractor.dither!r} is invalid: expected 0.0 (random "
                             "dithering would make samples non-deterministic)")  # fmt: skip

    @property
    def sample_rate(self) -> int:
        """The sample rate WAV files must have."""
        return int(self.extractor.sampling_rate)

    @property
    def output_shape(self) -> tuple[int, int]:
        """``(feature_size, nb_max_frames)`` of every clip's features."""
        return (int(self.extractor.feature_size), int(self.extractor.nb_max_frames))

    def check(self, path: WavSource) -> WavInfo:
        """The header of ``path``, checked to be readable at :attr:`sample_rate`.

        Raises:
            ValueError: unreadable, or recorded at another sample rate.
        """
        info = wav_info(path)
        if info.sample_rate != self.sample_rate:
            raise ValueError(
                f"{_wav_name(path)!r} is sampled at {info.sample_rate} Hz: expected "
                f"{self.sample_rate} "
                "Hz (the audio encoder's rate; resample the file, it is not done on the fly)"
            )
        return info

    def decode(self, path: WavSource) -> np.ndarray:
        """Every sample of ``path`` (mono float32), read at :attr:`sample_rate`.

        The data check and the load both decode this way, so a file that passes the check
        loads (until it changes on disk).

        Raises:
            ValueError: unreadable, truncated inside a frame, or at another sample rate.
        """
        self.check(path)
        return read_wav(path)[0]

    def __call__(self, path: WavSource) -> torch.Tensor:
        """Float32 ``[feature_size, nb_max_frames]`` log-mel features of a WAV file."""
        return self.features(self.decode(path), self.sample_rate)

    def features(self, samples: np.ndarray | Sequence[float], sample_rate: int) -> torch.Tensor:
        """Log-mel features of mono samples in [-1, 1]."""
        out = self.extractor(np.asarray(samples, dtype=np.float32), sampling_rate=sample_rate,
                             return_tensors="np")  # fmt: skip
        return torch.from_numpy(np.ascontiguousarray(out["input_features"][0], dtype=np.float32))
