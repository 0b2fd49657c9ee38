"""Sample and batch formats: build one sample's token tensors, collate, slice.

A **sample** (what a task's ``get`` returns) is a dict:

=============  ===================  ==================================================
key            type                 meaning
=============  ===================  ==================================================
``tokens``     Long[L]              ``<bos>`` prompt (placeholders included), answer,
                                    ``<eos>``; unpadded, ``L <= seq_length``
``labels``     Long[L]              next-token targets: ``tokens[1:]`` then ``<pad>``
``loss_mask``  Float[L]             1 exactly where the label is an answer token or
                                    the final ``<eos>``
``image``      Float[1,8,8] | None  present iff the prompt holds ``<image>`` tokens
``audio``      Float[129,16] | None present iff the prompt holds ``<audio>`` tokens
``answer``     str                  the expected answer text (no ``<eos>``)
``index``      int                  the sample's index in its task
``kind``       str                  ``image`` / ``audio`` / ``both`` / ``text``
``has_image``  bool (optional)      presence when ``image`` is not loaded on this rank
``has_audio``  bool (optional)      likewise for ``audio``
=============  ===================  ==================================================

**Several items per sample** (LLaVA with ``data.max_images_per_sample = K > 1``): the
sample's ``has_<key>`` is a Bool[K] tensor, its first ``n`` entries True, and ``<key>``
holds its ``n`` items, Float[n, ...] in the order of their placeholders (``None`` when
``n`` is 0 or the modality is not loaded on this rank).

A **batch** (what :func:`collate` returns) holds only tensors, all with the batch on
dim 0, so any contiguous DP slice or micro-batch is a plain ``narrow``:
``tokens``/``labels`` Long[B,S] (right-padded with ``<pad>`` to exactly ``seq_length``),
``loss_mask`` Float[B,S] (0 on padding), ``image`` Float[B,1,8,8] and ``audio``
Float[B,129,16] (zeros where absent) with ``has_image``/``has_audio`` Bool[B], and
``index`` Long[B]. Samples with several items give ``image`` Float[B,K,1,8,8] and
``has_image`` Bool[B,K] instead: the packed rows' format (:mod:`~mimotron.data.packing`),
whose present items, row-major, are the placeholders' order.

**Native-resolution images** (a Qwen2.5-VL / Qwen3-VL vision module): samples carry
``image`` as patch rows in slots (Float[max_patches, patch_dim], the ``image_shape``)
and ``image_grid``, ``image_tokens``, ``position_ids`` besides, which the batch stacks as
``[B, 3]``, ``[B]``, ``[B, 3, S]`` (:func:`~mimotron.data.native_batch.stack_native`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from mimotron.data.native_batch import stack_native

Sample = dict[str, Any]
Batch = dict[str, torch.Tensor]


def build_text_sample(
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
    eos_id: int,
    pad_id: int,
    seq_length: int,
) -> dict[str, torch.Tensor]:
    """``tokens``, ``labels`` and ``loss_mask`` of one sample.

    The loss covers the predictions of the answer tokens and of the final ``<eos>``:
    position ``i`` predicts ``tokens[i + 1]``, so the mask starts at the prompt's last
    token and ends one before the last position (whose label is padding).

    Args:
        prompt_ids: ``<bos>``, placeholders and question text (at least one token).
        answer_ids: the answer's tokens without ``<eos>``.
        eos_id: id appended after the answer.
        pad_id: label of the last position.
        seq_length: the most tokens a sample may have.

    Returns:
        ``{"tokens": Long[L], "labels": Long[L], "loss_mask": Float[L]}``.

    Raises:
        ValueError: the sample needs more than ``seq_length`` tokens.
    """
    assert len(prompt_ids) >= 1, "a prompt holds at least <bos>"
    tokens = [*prompt_ids, *answer_ids, eos_id]
    if len(tokens) > seq_length:
        raise ValueError(
            f"data.seq_length={seq_length} is too small: this sample needs {len(tokens)} "
            f"tokens ({len(prompt_ids)} prompt + {len(answer_ids)} answer + <eos>)"
        )
    num_prompt, num_target = len(prompt_ids), len(answer_ids) + 1
    labels = tokens[1:] + [pad_id]
    loss_mask = [0.0] * (num_prompt - 1) + [1.0] * num_target + [0.0]
    return {
        "tokens": torch.tensor(tokens, dtype=torch.long),
        "labels": torch.tensor(labels, dtype=torch.long),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.float32),
    }


def item_mask(sample: Sample, key: str) -> torch.Tensor | None:
    """A sample's Bool[K] presence of several ``key`` items, or ``None`` (one item at most).

    Raises:
        ValueError: a mask that is not one-dimensional or whose True entries do not come
            first (items fill the slots in order).
    """
    mask = sample.get(f"has_{key}")
    if not isinstance(mask, torch.Tensor):
        return None
    count = int(mask.sum())
    if mask.dim() != 1 or not bool(mask[:count].all()):
        raise ValueError(f"sample index {sample.get('index')} has has_{key}={mask.tolist()}: "
                         "expected a Bool[K] mask whose True entries come first")
    return mask.bool()


def items_of(sample: Sample, key: str, shape: tuple[int, ...]) -> tuple[int, torch.Tensor | None]:
    """``(count, Float[count, *shape] or None)``: a sample's ``key`` items in order.

    One item at most (``has_<key>`` a flag) or several (a Bool[K] mask,
    :func:`item_mask`); ``None`` where the items are not loaded on this rank.

    Raises:
        ValueError: items of another shape or count than the mask says.
    """
    mask, item = item_mask(sample, key), sample.get(key)
    if mask is None:
        count = int(bool(sample.get(f"has_{key}", item is not None)))
        item = None if item is None or not count else item.unsqueeze(0)
    else:
        count = int(mask.sum())
    if item is not None and tuple(item.shape) != (count, *shape):
        raise ValueError(f"sample index {sample.get('index')} has {key} of shape "
                         f"{tuple(item.shape)}: expected {(count, *shape)} (its count of "
                         f"has_{key}, then the {key}_shape passed to collate)")
    return count, item


def _stack_items(samples: Sequence[Sample], shape: tuple[int, ...], key: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``[B, K, *shape]`` items (zeros after each sample's) and the ``[B, K]`` mask."""
    masks = [item_mask(s, key) for s in samples]
    sizes = {None if m is None else m.numel() for m in masks}
    if len(sizes) != 1:
        raise ValueError(f"samples disagree on how many {key} items they may hold: has_{key} "
                         f"lengths {sorted(sizes, key=str)} (None: a flag); expected one K")
    num = sizes.pop()
    assert num is not None
    stacked = torch.zeros((len(samples), num, *shape), dtype=torch.float32)
    for i, sample in enumerate(samples):
        count, items = items_of(sample, key, shape)
        if items is not None:
            stacked[i, :count] = items
    return stacked, torch.stack(masks)  # type: ignore[arg-type]


def _stack_optional(
    samples: Sequence[Sample], shape: tuple[int, ...], key: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack present tensors, zeros where absent; also the presence mask.

    A sample's ``has_<key>`` flag, where it has one, is the presence (a rank that does
    not load a modality still knows which samples hold it); otherwise presence is the
    tensor not being ``None``. Samples with a Bool[K] mask give ``[B, K, ...]`` items.
    """
    if any(item_mask(s, key) is not None for s in samples):
        return _stack_items(samples, shape, key)
    zeros = torch.zeros(shape)
    items: list[torch.Tensor | None] = [s[key] for s in samples]
    present = []
    for i, item in enumerate(items):
        if item is not None and tuple(item.shape) != tuple(shape):
            raise ValueError(
                f"sample {i} has {key} of shape {tuple(item.shape)}: expected {tuple(shape)} "
                f"(the {key}_shape passed to collate)"
            )
        present.append(bool(samples[i].get(f"has_{key}", item is not None)))
    stacked = torch.stack([zeros if item is None else item for item in items]) if items else (
        torch.zeros((0, *shape))
    )
    return stacked.to(torch.float32), torch.tensor(present, dtype=torch.bool)


def collate(
    samples: Sequence[Sample],
    seq_length: int,
    pad_id: int = 0,
    image_shape: tuple[int, ...] = (1, 8, 8),
    audio_shape: tuple[int, ...] = (129, 16),
) -> Batch:
    """Stack samples into a fixed-shape batch (see the module docstring for the format).

    Every batch has exactly ``seq_length`` columns, so shapes never vary between steps,
    micro-batches or ranks (pipeline stages can then agree on buffer shapes up front).

    Args:
        samples: sample dicts as returned by a task's ``get``.
        seq_length: padded length ``S``.
        pad_id: id used for padding ``tokens`` and ``labels``.
        image_shape: shape of one image (zeros are used where a sample has none).
        audio_shape: shape of one spectrogram.

    Returns:
        The batch dict of tensors.

    Raises:
        ValueError: a sample is longer than ``seq_length`` or has a wrongly shaped input.
    """
    if seq_length < 1:
        raise ValueError(f"seq_length={seq_length!r} is invalid: expected an integer >= 1")
    for i, sample in enumerate(samples):
        if sample["tokens"].numel() > seq_length:
            raise ValueError(
                f"sample {i} (index {sample.get('index')}) has {sample['tokens'].numel()} "
                f"tokens: expected at most seq_length={seq_length}"
            )
    batch: Batch = {}
    for key, value, dtype in (
        ("tokens", pad_id, torch.long),
        ("labels", pad_id, torch.long),
        ("loss_mask", 0.0, torch.float32),
    ):
        if samples:
            rows = pad_sequence([s[key] for s in samples], batch_first=True, padding_value=value)
            rows = F.pad(rows, (0, seq_length - rows.shape[1]), value=value)
        else:
            rows = torch.zeros(0, seq_length)
        batch[key] = rows.to(dtype)
    batch["image"], batch["has_image"] = _stack_optional(samples, tuple(image_shape), "image")
    batch["audio"], batch["has_audio"] = _stack_optional(samples, tuple(audio_shape), "audio")
    batch["index"] = torch.tensor([int(s["index"]) for s in samples], dtype=torch.long)
    batch.update(stack_native(samples, seq_length))  # native-resolution images only
    return batch


def batch_size(batch: Batch) -> int:
    """Number of samples in a batch (the common size of dim 0)."""
    sizes = {t.shape[0] for t in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"batch tensors disagree on dim 0: sizes {sorted(sizes)}")
    return sizes.pop()


def slice_batch(batch: Batch, start: int, end: int) -> Batch:
    """Samples ``[start, end)`` of a batch: every tensor narrowed along dim 0 (views).

    Args:
        batch: a collated batch.
        start: first sample.
        end: one past the last sample.

    Returns:
        A batch of ``end - start`` samples sharing storage with ``batch``.

    Raises:
        ValueError: ``not 0 <= start <= end <= batch size``.
    """
    size = batch_size(batch)
    if not 0 <= start <= end <= size:
        raise ValueError(
            f"slice [{start}, {end}) is invalid: expected 0 <= start <= end <= {size} "
            "(the batch size)"
        )
    return {key: t.narrow(0, start, end - start) for key, t in batch.items()}


def split_microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Cut a batch into consecutive micro-batches of ``micro_batch_size`` samples.

    Args:
        batch: a collated batch whose size is a multiple of ``micro_batch_size``.
        micro_batch_size: samples per micro-batch.

    Returns:
        ``batch size / micro_batch_size`` batches (views), in order.

    Raises:
        ValueError: ``micro_batch_size`` is not a positive divisor of the batch size.
    """
    size = batch_size(batch)
    if micro_batch_size < 1 or size % micro_batch_size != 0:
        raise ValueError(
            f"micro_batch_size={micro_batch_size!r} is invalid: expected a positive divisor "
            f"of the batch size {size}"
        )
    return [
        slice_batch(batch, start, start + micro_batch_size)
        for start in range(0, size, micro_batch_size)
    ]
