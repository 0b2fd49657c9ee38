"""Random samples with native-resolution images, for the layout and parity tests.

:class:`~mimotron.data.mock.MockTask`'s samples carry images of one fixed shape;
a Qwen2.5-VL / Qwen3-VL vision module takes each image at its own size instead
(:mod:`mimotron.config.native_vision`). :class:`NativeMockTask` draws, per image
sample, a patch grid ``(1, h, w)`` (``h``, ``w`` multiples of the merge size, the area
within the run's ``max_pixels``), as many standard-normal patch rows, and puts
``h * w / merge**2`` image placeholders in the prompt, with the sample's 3-D rotary
positions (:func:`~mimotron.data.mrope_positions.mrope_positions`). So a micro-batch
mixes images of different token counts and text-only samples, as real data does, with
no files. Samples are a pure function of ``(seed, split, epoch, index)``.

Sample keys (the native-resolution batch format of :mod:`mimotron.data.collate`):
``image`` ``[max_patches, patch_dim]`` (zero rows after the image's own),
``image_grid`` ``[3]``, ``image_tokens`` ``[]`` and ``position_ids`` ``[3, L]``
besides the text keys.

The image sizes are known without drawing a sample: a sample is an image one with
probability :data:`IMAGE_SHARE`, its grid has the law :func:`grid_distribution`, and
:meth:`NativeMockTask.image_grid` is a sample's own grid (no pixels made), which the
memory and FLOP estimates count (:mod:`mimotron.estimate.image_counts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mimotron.config.native_vision import NativeVision
from mimotron.data.collate import Sample, build_text_sample
from mimotron.data.digits import SPLITS, SampleStream, sample_rng
from mimotron.data.mrope_positions import MRopeRule, mrope_positions

__all__ = ["IMAGE_SHARE", "NativeMockTask", "grid_distribution"]

_SALT = 0x6E6D6F63
_MAX_ANSWER_TOKENS = 6
_MAX_QUESTION_TOKENS = 8
_FIRST_ID = 5  # pad, bos, eos, <image>, <audio> (the character tokenizer's layout)
_KINDS = ("image", "text")  # drawn uniformly: the first draw of every sample
IMAGE_SHARE = 1 / len(_KINDS)
"""The probability that a sample holds an image (else it is text only)."""


def _draw_grid(vision: NativeVision, rng: np.random.Generator) -> tuple[int, int, int]:
    """A random ``(1, h, w)`` whose tokens fit the slots: ``h`` in merge blocks uniform
    on ``[1, max_tokens]``, then ``w`` uniform on ``[1, max_tokens // h]``."""
    merge, limit = vision.merge_size, vision.max_tokens
    h_units = int(rng.integers(1, limit + 1))
    w_units = int(rng.integers(1, limit // h_units + 1))
    return 1, h_units * merge, w_units * merge


def grid_distribution(vision: NativeVision) -> tuple[np.ndarray, np.ndarray]:
    """The exact law of an image sample's grid: every possible ``(1, h, w)`` and its
    probability.

    Args:
        vision: the vision module's patching and bound.

    Returns:
        ``(grids, probabilities)``: int64 ``[G, 3]`` and float64 ``[G]`` (summing to 1),
        the support of the draw :class:`NativeMockTask` makes for an image sample.
    """
    merge, limit = vision.merge_size, vision.max_tokens
    h_units = np.arange(1, limit + 1)
    widths = limit // h_units  # w is uniform on [1, widths[h - 1]] given h
    rows = np.repeat(h_units, widths)
    cols = np.concatenate([np.arange(1, n + 1) for n in widths])
    probs = np.repeat(1.0 / (limit * widths), widths)
    grids = np.stack([np.ones_like(rows), rows * merge, cols * merge], axis=1)
    return grids.astype(np.int64), probs


class NativeMockTask:
    """Random text and native-resolution images (see the module docstring).

    Args:
        vocab_size: ids are drawn below it (after the specials).
        image_id: the image placeholder id (the model's ``image_token_id``).
        vision: the vision module's patching and bound.
        rule: the family's position rule (its ``image_token_id`` is ``image_id``).
        seq_length: the most tokens a sample may have.
        seed: the run's seed.
        num_samples: samples in this split.
        split: ``"train"`` or ``"validation"`` (validation ignores ``epoch``).

    Raises:
        ValueError: ``seq_length`` too small for the largest image's placeholders, or
            a rule whose image id is not ``image_id``.
    """

    def __init__(self, vocab_size: int, image_id: int, vision: NativeVision, rule: MRopeRule,
                 seq_length: int, seed: int, num_samples: int, split: str = "train") -> None:
        if rule.image_token_id != image_id:
            raise ValueError(f"the position rule's image_token_id={rule.image_token_id} is not "
                             f"the placeholder id {image_id}")
        need = 1 + vision.max_tokens + 2  # <bos>, the largest image, an answer, <eos>
        if seq_length < need:
            raise ValueError(f"data.seq_length={seq_length} is too small: an image of "
                             f"max_pixels={vision.max_pixels} needs {need} tokens")
        self.vocab_size, self.image_id, self.vision, self.rule = vocab_size, image_id, vision, rule
        self.seq_length, self.seed, self.num_samples, self.split = (seq_length, seed,
                                                                      num_samples, split)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.kinds = _KINDS
        self.image_shape = (vision.max_patches, vision.patch_dim)
        self.audio_shape = (0,)  # no audio: collate stacks none

    def __len__(self) -> int:
        return self.num_samples

    def stream(self, seed: int, shuffle: bool = True) -> SampleStream:
        """The endless, layout-independent order of this task's samples for ``seed``."""
        return SampleStream(self, seed, shuffle)

    def _start(self, index: int, epoch: int
               ) -> tuple[np.random.Generator, str, tuple[int, int, int] | None]:
        """The sample's generator after its first draws: its kind and its grid."""
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        epoch = epoch if self.split == "train" else 0
        rng = sample_rng(self.seed, _SALT, SPLITS.index(self.split), epoch, index)
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        return rng, kind, _draw_grid(self.vision, rng) if kind == "image" else None

    def image_grid(self, index: int, epoch: int = 0) -> tuple[int, int, int] | None:
        """Sample ``index``'s image grid ``(1, h, w)`` (``None``: a text sample), drawn
        as :meth:`get` draws it, without the rest of the sample.

        Raises:
            ValueError: an index outside the split.
        """
        return self._start(index, epoch)[2]

    def get(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` of epoch ``epoch``.

        Raises:
            ValueError: an index outside the split.
        """
        rng, kind, grid = self._start(index, epoch)
        num_image = 0 if grid is None else grid[1] * grid[2] // self.vision.merge_size**2
        prompt = [self.bos_id] + [self.image_id] * num_image
        room = self.seq_length - len(prompt) - 1
        num_answer = int(rng.integers(1, min(_MAX_ANSWER_TOKENS, room) + 1))
        num_question = int(rng.integers(0, min(_MAX_QUESTION_TOKENS, room - num_answer) + 1))
        question = rng.integers(_FIRST_ID, self.vocab_size, size=num_question).tolist()
        answer = rng.integers(_FIRST_ID, self.vocab_size, size=num_answer).tolist()
        sample: dict[str, Any] = build_text_sample(prompt + question, answer, self.eos_id,
                                                   self.pad_id, self.seq_length)
        image = torch.zeros(self.image_shape)
        if grid is not None:
            rows = grid[0] * grid[1] * grid[2]
            image[:rows] = torch.from_numpy(
                rng.standard_normal((rows, self.vision.patch_dim), dtype="float32"))
        grids = None if grid is None else torch.tensor([grid])
        positions, _ = mrope_positions(sample["tokens"][None], self.rule, grids)
        sample.update(image=image if grid is not None else None, has_image=grid is not None,
                      audio=None,
                      image_grid=torch.tensor(grid or (0, 0, 0)),
                      image_tokens=torch.tensor(num_image), position_ids=positions[:, 0],
                      answer=" ".join(map(str, answer)), index=index, kind=kind)
        return sample

    def get_many(self, items: Sequence[tuple[int, int]]) -> list[Sample]:
        """Samples for several ``(index, epoch)`` pairs, in order."""
        return [self.get(index, epoch) for index, epoch in items]

