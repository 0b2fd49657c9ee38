"""Sequence packing: several samples concatenated into one row of ``seq_length``.

**Which samples share a row.** The training stream is read in its global order
(:class:`~mimotron.data.digits.SampleStream`) and packed greedily: a row takes
consecutive samples while they fit in ``seq_length`` tokens. The packing is a pure
function of the sample sequence from the batch's first position, so every rank, in every
layout, builds the same rows; a global batch is ``global_batch_size`` rows and the next
one starts at the first sample not packed (the resume position, ``consumed_samples``).
The decision needs only each sample's token count (:func:`pack_lengths`): a task that
knows its samples' lengths without loading them (LLaVA data, whose ranks load only
their modules' parts) packs from those, and each rank then loads only its own rows.

**Batch format.** As :func:`~mimotron.data.collate.collate`, except that a row may hold
several media items of a modality: ``image`` is Float[B, K, ...] and ``has_image``
Bool[B, K] (``K`` = the most images a row of this batch holds; the row's images in
document order, zeros and False after them), likewise ``audio``. Boolean indexing with
the mask lists the present items row by row, document by document — the order of their
placeholders in the rows, so each document's embeddings land on its own placeholders. A
document with several images (``data.max_images_per_sample > 1``) adds them all, in its
order: ``K`` counts the images of all the row's documents.
Added: ``doc_ids`` Long[B, S] (the document of each position, 0, 1, ... within a row;
padding is -1) and ``position_ids`` Long[B, S] (the position inside the document: RoPE
restarts at 0 for every document). Labels never cross a document boundary: a sample's
last label is padding with loss mask 0, so the loss and its token count are the
unpacked ones.

**Native-resolution images** (samples with ``image_grid``, :mod:`~mimotron.data.
native_batch`): ``image_grid`` Long[B, K, 3] and ``image_tokens`` Long[B, K] follow the
row's images like ``image`` (zeros after them), and ``position_ids`` is Long[B, 3, S]:
each document's own 3-D positions (which restart at 0 per document, as
:func:`~mimotron.data.mrope_positions.mrope_positions` gives them with ``doc_ids``),
concatenated; 0 on padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mimotron.data.collate import Batch, Sample, collate, item_mask, items_of

# Keys whose presence in a sample decides a row's modalities.
_MEDIA = ("image", "audio")


def has_media(sample: Sample, key: str) -> bool:
    """Whether ``sample`` carries modality ``key`` (its ``has_<key>`` flag or Bool[K] mask,
    else the tensor)."""
    mask = item_mask(sample, key)
    if mask is not None:
        return bool(mask.any())
    return bool(sample.get(f"has_{key}", sample.get(key) is not None))


def sample_length(sample: Sample) -> int:
    """A sample's token count: its ``length`` when it has one, else its tokens'.

    A LLaVA sample carries ``length`` (placeholders expanded) even where its tokens are
    not loaded (an encoder rank), so every rank packs it the same way.
    """
    if "length" in sample:
        return int(sample["length"])
    return int(sample["tokens"].numel())


def fits(row: Sequence[Sample], sample: Sample, seq_length: int) -> bool:
    """Whether ``sample`` can join ``row`` (the row's tokens plus its fit ``seq_length``)."""
    used = sum(sample_length(s) for s in row)
    return used + sample_length(sample) <= seq_length


def pack_lengths(lengths: Callable[[int, int], Sequence[int]], start: int, num_rows: int,
                 seq_length: int, chunk: int = 64) -> tuple[list[list[int]], int]:
    """Greedily pack ``num_rows`` rows from stream position ``start``, from lengths alone.

    A row takes consecutive samples while their token counts sum to at most
    ``seq_length``; a row's first sample always joins it.

    Args:
        lengths: ``f(start, count) -> token counts`` of the samples at those positions.
        start: position of the first sample.
        num_rows: rows to fill.
        seq_length: tokens per row.
        chunk: lengths read per call (the result does not depend on it).

    Returns:
        ``(rows, next_start)``: each row as the token counts of its samples (row ``r``
        holds the positions that follow row ``r - 1``'s) and the position of the first
        sample not packed.

    Raises:
        ValueError: a length below 1 (a sample loaded without its tokens and no
            ``length``: the rows would never fill).
    """
    rows: list[list[int]] = []
    row: list[int] = []
    pos, buffer = start, []
    while True:
        if not buffer:
            buffer = [int(n) for n in lengths(pos, chunk)]
            if min(buffer) < 1:
                raise ValueError(f"sample at stream position {pos + buffer.index(min(buffer))} "
                                 f"has length {min(buffer)}: packing needs lengths >= 1")
        if row and sum(row) + buffer[0] > seq_length:
            rows.append(row)
            row = []
            if len(rows) == num_rows:
                return rows, pos
        row.append(buffer.pop(0))
        pos += 1


def pack_rows(read: Callable[[int, int], list[Sample]], start: int, num_rows: int,
              seq_length: int, chunk: int = 64) -> tuple[list[list[Sample]], int]:
    """Greedily pack ``num_rows`` rows from stream position ``start`` (:func:`pack_lengths`
    on the loaded samples' :func:`sample_length`).

    Args:
        read: ``f(start, count) -> samples`` over the global stream.
        start: position of the first sample.
        num_rows: rows to fill.
        seq_length: tokens per row.
        chunk: samples read per call (the result does not depend on it).

    Returns:
        ``(rows, next_start)``: the rows (lists of samples, in stream order) and the
        position of the first sample not packed.
    """
    loaded: dict[int, Sample] = {}

    def lengths(first: int, count: int) -> list[int]:
        samples = read(first, count)
        loaded.update(enumerate(samples, first))
        return [sample_length(s) for s in samples]

    counts, next_start = pack_lengths(lengths, start, num_rows, seq_length, chunk)
    rows, pos = [], start
    for row in counts:
        rows.append([loaded[p] for p in range(pos, pos + len(row))])
        pos += len(row)
    return rows, next_start


def _concat(row: Sequence[Sample]) -> Sample:
    """One text sample holding a row's documents back to back, with document ids and positions."""
    out: Sample = {key: torch.cat([s[key] for s in row]) for key in ("tokens", "labels",
                                                                      "loss_mask")}
    out["doc_ids"] = torch.cat([torch.full((s["tokens"].numel(),), d, dtype=torch.long)
                                for d, s in enumerate(row)])
    if _is_native(row):  # each document's own 3-D positions
        out["position_ids"] = torch.cat([s["position_ids"].long() for s in row], dim=1)
    else:
        out["position_ids"] = torch.cat([torch.arange(s["tokens"].numel()) for s in row])
    for key in _MEDIA:
        out[key], out[f"has_{key}"] = None, False  # stacked per row by _stack_media
    out["index"] = int(row[0]["index"])
    return out


def _is_native(row: Sequence[Sample]) -> bool:
    """Whether a row's samples carry native-resolution keys (all or none of them).

    Raises:
        ValueError: some do and some do not.
    """
    has = {"image_grid" in s for s in row}
    if len(has) > 1:
        raise ValueError(f"samples {[s.get('index') for s in row]} of one packed row disagree "
                         "on image_grid: expected it in all of them (a native-resolution "
                         "vision module) or none")
    return has == {True}


def _item_count(sample: Sample, key: str) -> int:
    """How many ``key`` items a sample holds (its Bool[K] mask, flag or tensor)."""
    mask = item_mask(sample, key)
    if mask is not None:
        return int(mask.sum())
    return int(has_media(sample, key))


def _stack_grids(rows: Sequence[Sequence[Sample]], num: int) -> Batch:
    """``image_grid`` ``[B, num, 3]`` and ``image_tokens`` ``[B, num]`` of each row's
    images in document order (the order of ``image``), zeros after them."""
    grids = torch.zeros((len(rows), num, 3), dtype=torch.long)
    tokens = torch.zeros((len(rows), num), dtype=torch.long)
    for i, row in enumerate(rows):
        j = 0
        for s in row:
            count = _item_count(s, "image")
            grids[i, j:j + count] = s["image_grid"].long().reshape(-1, 3)[:count]
            tokens[i, j:j + count] = s["image_tokens"].long().reshape(-1)[:count]
            j += count
    return {"image_grid": grids, "image_tokens": tokens}


def _padded(values: Sequence[torch.Tensor], seq_length: int, fill: int,
            shape: tuple[int, ...]) -> torch.Tensor:
    """``[B, *shape, seq_length]``: each value's last dim right-padded with ``fill``."""
    if not values:
        return torch.full((0, *shape, seq_length), fill, dtype=torch.long)
    return torch.stack([F.pad(v.long(), (0, seq_length - v.shape[-1]), value=fill)
                        for v in values])


def _stack_media(rows: Sequence[Sequence[Sample]], key: str, shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, K, *shape]`` media of each row in document order, and the ``[B, K]`` mask."""
    items = [[items_of(s, key, shape) for s in row] for row in rows]
    num = max([sum(count for count, _ in row) for row in items] + [1])
    stacked = torch.zeros((len(rows), num, *shape), dtype=torch.float32)
    present = torch.zeros((len(rows), num), dtype=torch.bool)
    for i, docs in enumerate(items):
        j = 0
        for count, media in docs:
            present[i, j:j + count] = True
            if media is not None:  # a rank that does not load the modality keeps zeros
                stacked[i, j:j + count] = media
            j += count
    return stacked, present


def collate_packed(rows: Sequence[Sequence[Sample]], seq_length: int, pad_id: int = 0,
                   image_shape: tuple[int, ...] = (1, 8, 8),
                   audio_shape: tuple[int, ...] = (129, 16)) -> Batch:
    """Collate packed rows (see the module docstring for the batch format).

    Args:
        rows: rows from :func:`pack_rows`.
        seq_length: tokens per row.
        pad_id: id used for padding ``tokens`` and ``labels``.
        image_shape: shape of one image.
        audio_shape: shape of one spectrogram.

    Returns:
        The batch: ``collate``'s keys (media per row ``[B, K, ...]``) plus ``doc_ids`` and
        ``position_ids`` (and the native-resolution keys, module docstring).

    Raises:
        ValueError: a row longer than ``seq_length``, or one whose samples disagree on
            the native-resolution keys.
    """
    merged = [_concat(row) for row in rows]
    batch = collate(merged, seq_length, pad_id, image_shape, audio_shape)
    for key, shape in (("image", image_shape), ("audio", audio_shape)):
        batch[key], batch[f"has_{key}"] = _stack_media(rows, key, tuple(shape))
    native = {_is_native(row) for row in rows}
    if len(native) > 1:
        raise ValueError("packed rows disagree on image_grid: expected it in every sample (a "
                         "native-resolution vision module) or in none")
    batch["doc_ids"] = _padded([s["doc_ids"] for s in merged], seq_length, -1, ())
    batch["position_ids"] = _padded([s["position_ids"] for s in merged], seq_length, 0,
                                    (3,) if native == {True} else ())
    if native == {True}:
        batch.update(_stack_grids(rows, batch["image"].shape[1]))
    return batch


def real_tokens(batch: Batch) -> torch.Tensor:
    """Non-padding positions of a training batch (a 0-dim long tensor, no sync).

    Packed rows count their documents' positions (``doc_ids >= 0``); an unpacked row
    counts up to its ``<eos>``, one past the last loss position (a training sample's
    loss ends by predicting ``<eos>``, see :func:`~mimotron.data.collate.build_text_sample`).
    """
    if "doc_ids" in batch:
        return (batch["doc_ids"] >= 0).sum()
    mask = batch["loss_mask"] != 0
    seq = mask.shape[-1]
    positions = torch.arange(1, seq + 1, device=mask.device)
    # Index of the last scored position + 1, then + 1 for the <eos> itself.
    last = (mask * positions).amax(dim=-1)
    return torch.where(last > 0, (last + 1).clamp(max=seq), 0).sum()
