"""LLaVA-format data: a JSON list, JSONL file or tar shards of conversations with media.

Each sample is ``{"id": ..., "image": path | [path, ...], "audio": path | [path],
"conversations": [{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}``,
or in the layout LLaMA-Factory and ms-swift keep ``{"messages": [{"role": "user" |
"assistant" | "system", "content": ...}], "images": [...], "audios": [...]}``
(:mod:`mimotron.data.sample_keys`), with paths relative to a root folder; in tar shards
(WebDataset layout, :mod:`~mimotron.data.webdataset`) the media are the sample's
members instead. One ``<image>`` (``<audio>``) per file stands in the human turns where
the encoder's output goes; it is expanded to the encoder's token count
(:mod:`mimotron.data.chat`). With several images (up to ``max_images``,
``data.max_images_per_sample``) the k-th ``<image>`` of the conversation takes the k-th
image of the list.

**Checked up front, once.** Every sample is checked before training starts, so before
any collective (rules in :mod:`~mimotron.data.llava_check`): valid JSON, known roles, an
assistant turn, no key the loader does not read (unless in ``ignore_keys``), as many
placeholders as files, media paths inside the root (unless ``allow_outside_root``),
media that decode in full by the load's decoder, images within the processor's resize
bound, a modality the model has an encoder for, at most ``max_images`` images and one audio
clip, and a token count within ``seq_length``; a line that is not UTF-8 is bad too
(:mod:`mimotron.data.llava_file`).
The result is an index (:mod:`~mimotron.data.sample_index`): each kept sample's byte
address, token count and media flags, plus the bad samples with their reasons. With
``index_dir`` it is kept there under a key of the data file's identity and the check's
settings, built once per run (by the launcher, or by rank 0 while the others wait) and
reused by later runs over the same data. The first bad sample is a one-line
``ValueError`` naming the file, the line (JSONL, from 1), item (JSON list, from 0) or
shard and key, the sample id and the reason; with ``skip_bad_samples=True`` bad samples
are left out and counted instead (:attr:`LlavaDataset.num_skipped`,
:attr:`LlavaDataset.bad_samples`). The kept samples and their indices are the same on
every rank: the global sample order stays layout-independent. A file that changes or
breaks after the check is skipped when loaded with ``skip_bad_samples`` (zero media, no
loss; :meth:`LlavaDataset.load`) and an error naming the sample otherwise.

**No rank holds the file.** A load reads its sample's bytes alone, at the address the
index gives (a JSON list is read through the JSONL copy the index keeps); the index
itself is memory-mapped, a few dozen bytes per sample.

**Samples** are pure functions of their index (no augmentation): the
:mod:`~mimotron.data.collate` format with ``image`` Float[3, H, W] (the tower's
preprocessing), ``audio`` Float[mel bins, frames] (Whisper's log-mel), explicit
``has_image`` / ``has_audio`` flags, ``answer`` (the last assistant reply) and
``sample_id``. With ``max_images > 1`` a sample's images are ``image`` Float[n, 3, H, W]
(its ``n`` images in order; ``None`` for none or not loaded) and ``has_image`` Bool[K]
(``K = max_images``, the first ``n`` True), the collate format of several items per row;
``n`` comes from the sample's JSON, which every rank reads.
:meth:`LlavaDataset.restrict_loading` makes a rank load only the parts its modules use
(the training loop does, from the layout).

**Native resolution** (a Qwen2.5-VL / Qwen3-VL vision module, ``native``:
:mod:`~mimotron.data.native_llava`): each ``<image>`` becomes the model's
``<|vision_start|>``, the image's own count of ``<|image_pad|>`` (its grid's merged
tokens, read from the file's header at the check and at every load), ``<|vision_end|>``;
a sample whose images alone need more than ``seq_length`` tokens is bad. Samples carry
``image`` Float[max_patches, patch_dim] (the processor's patch rows, zeros after;
``[n, ...]`` with ``max_images > 1``), ``image_grid``, ``image_tokens`` and
``position_ids`` (:mod:`~mimotron.data.native_batch`). Such a run also reads videos
(``video`` / ``videos``, :mod:`~mimotron.data.native_video`): each ``<video>`` becomes
the family's video text, and a sample's items are its images and videos in placeholder
order (``max_images`` counts them); a video's frames and grid come from its header at the
check and at every load, its frames are decoded by the ranks that load images.

**Lengths.** The check tokenises every conversation, so the index records each kept
sample's token count, placeholders expanded (:attr:`LlavaDataset.lengths`,
:meth:`LlavaTask.length_of`; a loaded sample carries it as ``length`` whatever parts
are loaded). Every rank thus knows the length of every sample without loading it: what
sequence packing (``data.packing``) decides its rows from, the same on every rank, on
an encoder rank that never tokenises too.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mimotron.data.collate import Sample
from mimotron.data.digits import SPLITS, SampleStream, split_ids
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava_check import BadSample, LlavaRecord, RawItem, SampleChecker, load_media
from mimotron.data.llava_file import SampleError
from mimotron.data.llava_source import ROW_DTYPE, ShardSource, file_identity, open_source
from mimotron.data.media import MAX_RESIZE_FACTOR, AudioFeatures, ImageProcessor
from mimotron.data.native_llava import NativeLlava
from mimotron.data.sample_index import (
    ChunkResult,
    Progress,
    SampleIndex,
    index_key,
    map_chunks,
    merge_chunks,
    obtain_index,
)

__all__ = ["BadSample", "LlavaDataset", "LlavaRecord", "LlavaTask", "llava_tasks"]

# Batch shape of a modality the model has no encoder for (collate fills it with zeros).
_ABSENT_SHAPE: tuple[int, ...] = (1, 1, 1)
# A sample's (image, audio) tensors; None: absent or not loaded on this rank.
_Media = tuple[torch.Tensor | None, torch.Tensor | None]


class LlavaDataset:
    """Every sample of a LLaVA data set, checked once (rules in the module docstring).

    Args:
        path: the JSON / JSONL file, or the tar shards (``data.path``).
        root: folder the media paths are relative to (``data.root``).
        tokenizer: the run's tokenizer (with its chat template).
        seq_length: the most tokens a sample may have, placeholders expanded.
        num_tokens: modality -> the encoder's output tokens per item, for the modalities
            the model has an encoder for (e.g. ``{"image": 576}``).
        image_processor: the vision tower's preprocessing (needed with ``"image"``).
        audio_features: the Whisper feature extraction (needed with ``"audio"``).
        skip_bad_samples: leave bad samples out (counted) instead of raising; a sample
            that fails when loaded is then skipped too (:meth:`load`).
        system_prompt: a system message put first in conversations that have none.
        num_workers: threads that check the samples of a chunk (0: in its process).
        allow_outside_root: accept media paths that resolve outside ``root`` (``..``,
            absolute paths, symlinks out of it); otherwise such a sample is bad.
        index_dir: where the index is kept and looked up (``data.index_dir``), shared
            by the ranks of a run; ``None``: a private temporary folder, checked by
            this process alone.
        num_check_processes: processes that check chunks in parallel (1: this one).
        wait_timeout_s: how long a rank waiting for rank 0's check accepts no progress.
        ignore_keys: sample or turn keys the loader does not read that are accepted
            (``data.ignore_keys``); any other unread key makes the sample bad.
        max_images: the most images a sample may hold (``data.max_images_per_sample``);
            above 1 samples carry their images as several items (module docstring).
        native: a native-resolution vision module's image text and processor
            (:class:`~mimotron.data.native_llava.NativeLlava`, which replaces
            ``image_processor``): each image has its own token count, and samples carry
            the native-resolution keys (module docstring).

    Raises:
        ValueError: the first bad sample (without ``skip_bad_samples``), a modality
            without its preprocessing, no usable sample at all, or (on every rank of a
            run) rank 0's error doing so.
    """

    def __init__(
        self,
        path: str | Path,
        root: str | Path,
        tokenizer: HFTokenizer,
        seq_length: int,
        num_tokens: Mapping[str, int],
        image_processor: ImageProcessor | None = None,
        audio_features: AudioFeatures | None = None,
        skip_bad_samples: bool = False,
        system_prompt: str | None = None,
        num_workers: int = 0,
        allow_outside_root: bool = False,
        index_dir: str | Path | None = None,
        num_check_processes: int = 1,
        wait_timeout_s: float = 300.0,
        ignore_keys: Sequence[str] = (),
        max_images: int = 1,
        native: NativeLlava | None = None,
    ) -> None:
        if max_images < 1:
            raise ValueError(f"max_images={max_images!r} is invalid: expected an integer >= 1")
        self.path, self.root = Path(path), Path(root)
        self.max_images = max_images
        self.skip_bad_samples = skip_bad_samples
        # Samples that failed when loaded (skip_bad_samples); appended by loader threads.
        self.load_failures: list[BadSample] = []
        self._failures_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.num_tokens = {m: int(n) for m, n in num_tokens.items()}
        self.native = native
        self.image_processor: Any = native.processor if native is not None else image_processor
        self.audio_features = audio_features
        self.system_prompt = system_prompt
        self.num_workers = num_workers
        self.num_check_processes = num_check_processes
        self._check_modalities()
        self.modalities = tuple(m for m in tokenizer.modalities if m in self.num_tokens)
        self.pad_id = tokenizer.pad_id
        self.image_shape = (self.image_processor.output_shape if self.image_processor
                            else _ABSENT_SHAPE)
        self.audio_shape = audio_features.output_shape if audio_features else _ABSENT_SHAPE
        self.load_parts: frozenset[str] = frozenset(("text", *self.modalities))
        self.checker = SampleChecker(self.root, tokenizer, seq_length, self.num_tokens,
                                     audio_features, system_prompt, allow_outside_root,
                                     image_processor, ignore_keys, max_images,
                                     native)  # fmt: skip
        self.source = open_source(path)
        # Without an index_dir the index lives as long as the dataset (a JSON list's
        # converted lines are read from it).
        self._private = None if index_dir is not None else tempfile.TemporaryDirectory(
            prefix="mimotron-index-")  # fmt: skip
        folder = Path(index_dir) if index_dir is not None else Path(self._private.name)
        self.index: SampleIndex = obtain_index(folder, index_key(self._identity()), self._build,
                                               self._validate, wait_timeout_s,
                                               share=index_dir is not None)  # fmt: skip
        self.source.attach(self.index.folder)
        self.bad_samples: list[BadSample] = list(self.index.bad)

    def _check_modalities(self) -> None:
        unknown = sorted(set(self.num_tokens) - set(self.tokenizer.modalities))
        if unknown:
            raise ValueError(f"num_tokens has modalities {unknown} the tokenizer has no "
                             f"placeholder for (have {self.tokenizer.modalities})")  # fmt: skip
        for modality, part, name in (("image", self.image_processor, "image_processor"),
                                     ("audio", self.audio_features, "audio_features")):  # fmt: skip
            if modality in self.num_tokens and part is None:
                raise ValueError(f"{name} is missing: the model has an {modality} encoder")
            if self.num_tokens.get(modality, 1) < 1:
                raise ValueError(f"num_tokens[{modality!r}]={self.num_tokens[modality]!r} is "
                                 "invalid: expected an integer >= 1")  # fmt: skip

    @property
    def num_skipped(self) -> int:
        """Bad samples left out (0 unless ``skip_bad_samples``): at the check and at load."""
        return len(self.bad_samples) + len(self.load_failures)

    def __len__(self) -> int:
        return len(self.index.rows)

    def __repr__(self) -> str:
        return (f"LlavaDataset({str(self.path)!r}, len={len(self)}, "
                f"skipped={self.num_skipped})")  # fmt: skip

    # ---- the index ----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        """What the check's result depends on (the index key; see sample_index)."""
        tok, image = self.tokenizer, self.image_processor
        template = hashlib.sha256(tok.chat_template.encode()).hexdigest()
        return {
            "source": self.source.identity(), "root": str(self.checker.real_root),
            "allow_outside_root": self.checker.allow_outside_root,
            "seq_length": self.seq_length, "num_tokens": self.num_tokens,
            "system_prompt": self.system_prompt,
            "tokenizer": {"path": str(tok.path.resolve()), "files": file_identity(tok.path),
                          "template": template, "vocab_size": tok.vocab_size,
                          "placeholders": {m: tok.placeholder_id(m) for m in tok.modalities}},
            "audio_rate": self.audio_features.sample_rate if self.audio_features else None,
            "ignore_keys": sorted(self.checker.ignore_keys),
            # The resize bound depends on these (ImageProcessor.check_size).
            "image_resize": None if image is None or self.native else [
                image.do_resize, image.size, image.crop_size, MAX_RESIZE_FACTOR],
            # Only with a native-resolution tower: lengths depend on its image sizes.
            **({"native": self.native.identity()} if self.native else {}),
            # Only when above 1: the default keeps the keys of indexes built before.
            **({"max_images": self.max_images} if self.max_images > 1 else {}),
        }  # fmt: skip

    def _build(self, folder: Path, progress: Progress | None) -> SampleIndex:
        """Check every sample (in parallel chunks) into an index in ``folder``."""
        self.source.prepare(folder, progress)
        chunks = self.source.chunks()
        results = map_chunks(self._check_chunk, chunks, self.num_check_processes, progress)
        return merge_chunks(folder, results, isinstance(self.source, ShardSource),
                            {"data": str(self.path), "identity": self._identity()})  # fmt: skip

    def _check_chunk(self, chunk: Any) -> ChunkResult:
        pairs = list(self.source.items(chunk))
        checked = self.checker.check_many([item for _, item in pairs], self.num_workers)
        kept = [(row, item.key or "", *result) for (row, item), result
                in zip(pairs, checked, strict=True) if not isinstance(result, BadSample)]
        out = np.zeros(len(kept), ROW_DTYPE)
        for k, (row, *_) in enumerate(kept):  # row by row: np.stack is slower per row
            out[k] = row
        out["length"] = [length for *_, length in kept]
        out["has_image"] = [bool(record.images or record.videos) for _, _, record, _ in kept]
        out["has_audio"] = [bool(record.audios) for _, _, record, _ in kept]
        bad = [result for result in checked if isinstance(result, BadSample)]
        return ChunkResult(out, [key for _, key, *_ in kept], bad, len(pairs))

    def _validate(self, index: SampleIndex) -> None:
        if index.bad and not self.skip_bad_samples:
            raise ValueError(index.bad[0].describe(self.path)
                             + " (data.skip_bad_samples=true skips bad samples)")  # fmt: skip
        if not len(index.rows):
            raise ValueError(f"data.path={str(self.path)!r} has no usable sample "
                             f"({len(index.bad)} bad, {index.num_total} in all)")  # fmt: skip

    @property
    def lengths(self) -> np.ndarray:
        """Token count of every kept sample (read-only, memory-mapped)."""
        return self.index.rows["length"]

    @property
    def has_image(self) -> np.ndarray:
        """Whether each kept sample holds an image (read-only)."""
        return self.index.rows["has_image"]

    @property
    def has_audio(self) -> np.ndarray:
        """Whether each kept sample holds an audio clip (read-only)."""
        return self.index.rows["has_audio"]

    def record(self, index: int) -> LlavaRecord:
        """Sample ``index``'s record, read from the data file (its bytes alone).

        Raises:
            SampleError: the sample no longer reads or parses (the file changed).
        """
        row = self.index.rows[index]
        key = self.index.key_of(index)
        try:
            item = self.source.read(row, key)
        except OSError as exc:
            item = RawItem(self.source.row_location(row, key), SampleError(str(exc)))
        return self.checker.parse(item, int(row["length"]))

    @property
    def records(self) -> Sequence[LlavaRecord]:
        """Every kept sample's record, each read from the data file when accessed (use
        :attr:`lengths`, :attr:`has_image`, :attr:`has_audio` to go over many)."""
        return _Records(self)

    # ---- loading ------------------------------------------------------------------------
    def restrict_loading(self, parts: Collection[str]) -> None:
        """From now on load only ``parts`` of each sample: ``"text"`` and/or modalities.

        A rank that holds the vision tower alone needs the images but not the tokens,
        nor the audio features; a language-model rank needs the tokens and which samples
        hold which media, not the media. What is left out: the tokens (``text``) become
        empty (``collate`` pads them), a media tensor becomes ``None`` with an explicit
        ``has_<modality>`` flag, so the batch's presence masks stay exact. Which samples
        exist, their order and everything that is loaded are unchanged.

        Raises:
            ValueError: a part that is neither ``"text"`` nor one of the dataset's
                modalities.
        """
        known = ("text", *self.modalities)
        unknown = sorted(set(parts) - set(known))
        if unknown:
            raise ValueError(f"parts {unknown} are invalid: expected some of {list(known)}")
        self.load_parts = frozenset(parts)

    def _encode(self, record: LlavaRecord, parts: frozenset[str],
                image_tokens: Sequence[int] = ()) -> dict[str, torch.Tensor]:  # fmt: skip
        if "text" not in parts:
            empty = torch.zeros(0, dtype=torch.long)
            return {"tokens": empty, "labels": empty, "loss_mask": empty.float()}
        return self.checker.tokenize(record.messages, image_tokens, record.video_plans)

    def _load_native(self, index: int, record: LlavaRecord, parts: frozenset[str]) -> Sample:
        """:meth:`load` with a native-resolution vision module (the keys of
        :mod:`~mimotron.data.native_llava`): every rank reads each image's grid and each
        video's plan from its header; a text rank expands its placeholders, an image rank
        decodes its items' patches (images and videos, in placeholder order). The ``tokens``
        and ``labels`` keep the true ids until the positions are computed, then every video
        placeholder is written as the image placeholder (what the engine merges at).

        A header that no longer reads, or a size that no longer gives the length the check
        recorded, fails as an unreadable sample (:meth:`_unreadable`); an item that no
        longer decodes keeps its grid and tokens, with zero patches and no loss.
        """
        native = self.native
        assert native is not None
        try:
            grids = native.header_grids(record.images)
            sample: dict[str, Any] = self._encode(record, parts, native.tokens_of(grids))
            length = int(self.index.rows[index]["length"])
            if "text" in parts and sample["tokens"].numel() != length:
                media = "image or video" if record.videos else "image"
                raise ValueError(f"its {media}s now give {sample['tokens'].numel()} tokens, "
                                 f"not the {length} the check counted: an {media} file "
                                 "changed")
        except ValueError as exc:
            return self._unreadable(index, SampleError(str(exc), record.sample_id), parts)
        try:
            image = None
            if (record.images or record.videos) and "image" in parts:
                image = native.load_items(record.images, grids, record.videos,
                                          record.video_plans, record.item_kinds)
                image = image if self.max_images > 1 else image[0]
            _, audio = load_media(record, parts - {"image"}, None,
                                  self.audio_features)  # fmt: skip
        except (OSError, ValueError) as exc:
            image, audio = self._skip_failed(record, exc, parts)
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
            sample["media_failed"] = True  # a second read's merge zeroes the first's mask
        # Positions of the true ids (video runs laid out as videos), then the ids the
        # engine reads: every item at an image placeholder.
        sample.update(native.sample_keys(sample["tokens"], grids, self.max_images,
                                         record.video_plans, record.item_kinds))
        for key in ("tokens", "labels"):
            sample[key] = native.image_placeholders(sample[key])
        answer = [m["content"] for m in record.messages if m["role"] == "assistant"][-1]
        return self._sample(sample, index, (image, audio), answer, record.sample_id,
                            len(record.images) + len(record.videos))  # fmt: skip

    def load(self, index: int, parts: Collection[str] | None = None) -> Sample:
        """Sample ``index`` (of the kept samples, in data order), with the parts
        :meth:`restrict_loading` left, or only those of them in ``parts``.

        A media file that fails to load although it passed the check (it changed on disk
        since) is skipped with ``skip_bad_samples``: the sample keeps its shape and
        presence flags, so batches and every rank's transfers stay the same, but its
        media are zeros and its loss mask is empty (nothing of it is trained); it is
        counted in :attr:`num_skipped` and :attr:`load_failures` and reported on stderr.
        A sample whose JSON no longer reads is skipped the same way (its tokens padding).

        Raises:
            ValueError: a bad index, or (without ``skip_bad_samples``) a file that can no
                longer be read: one line naming the data file, line, sample id and file.
        """
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        parts = self.load_parts if parts is None else self.load_parts & frozenset(parts)
        try:
            record = self.record(index)
        except SampleError as exc:
            return self._unreadable(index, exc, parts)
        if self.native is not None:
            return self._load_native(index, record, parts)
        sample: dict[str, Any] = self._encode(record, parts)  # checked when built
        try:
            image, audio = load_media(record, parts, self.image_processor,
                                      self.audio_features, self.max_images > 1)  # fmt: skip
        except (OSError, ValueError) as exc:
            image, audio = self._skip_failed(record, exc, parts)
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
            sample["media_failed"] = True  # a second read's merge zeroes the first's mask
        answer = [m["content"] for m in record.messages if m["role"] == "assistant"][-1]
        return self._sample(sample, index, (image, audio), answer, record.sample_id,
                            len(record.images))  # fmt: skip

    def _sample(self, sample: dict[str, Any], index: int, media: _Media, answer: str,
                sample_id: str | None, num_images: int) -> Sample:  # fmt: skip
        row = self.index.rows[index]
        has = (bool(row["has_image"]), bool(row["has_audio"]))
        kind = {(True, True): "both", (True, False): "image", (False, True): "audio",
                (False, False): "text"}[has]  # fmt: skip
        has_image: bool | torch.Tensor = has[0]
        if self.max_images > 1:  # Bool[K]: the collate format of several items per row
            has_image = torch.arange(self.max_images) < (num_images if has[0] else 0)
        sample.update(image=media[0], audio=media[1], has_image=has_image, has_audio=has[1],
                      answer=answer, index=index, kind=kind, length=int(row["length"]),
                      sample_id=sample_id)  # fmt: skip
        return sample

    def _zero_images(self, num_images: int) -> torch.Tensor:
        """Zeros standing in for ``num_images`` images that failed to load."""
        if self.max_images > 1:
            return torch.zeros((num_images, *self.image_shape))
        return torch.zeros(self.image_shape)

    def _skip_failed(self, record: LlavaRecord, exc: Exception, parts: frozenset[str]
                     ) -> _Media:
        """Zero media standing in for a sample that failed to load, or its one-line error."""
        self._failed(BadSample(record.location, record.sample_id, f"failed to load: {exc}"),
                     exc)  # fmt: skip
        image = audio = None
        if (record.images or record.videos) and "image" in parts:
            image = self._zero_images(len(record.images) + len(record.videos))
        if record.audios and "audio" in parts:
            audio = torch.zeros(self.audio_shape)
        return image, audio

    def _unreadable(self, index: int, exc: SampleError, parts: frozenset[str]) -> Sample:
        """A sample whose JSON no longer reads: padding and zero media, or its error."""
        row = self.index.rows[index]
        key = self.index.key_of(index)
        self._failed(BadSample(self.source.row_location(row, key), exc.sample_id or key,
                               f"failed to load: {exc.reason}"), exc)  # fmt: skip
        length = int(row["length"]) if "text" in parts else 0
        pad = torch.full((length,), self.pad_id, dtype=torch.long)
        sample: dict[str, Any] = {"tokens": pad, "labels": pad.clone(),
                                  "loss_mask": torch.zeros(length)}  # fmt: skip
        # The tokens are padding, with no placeholder: the sample holds no media either
        # (every rank reads the same JSON, so every rank agrees).
        out = self._sample(sample, index, (None, None), "", exc.sample_id or key, 0)
        out.update(has_image=torch.zeros(self.max_images, dtype=torch.bool)
                   if self.max_images > 1 else False, has_audio=False)
        if self.native is not None:  # no image: zero grids, text positions
            out.update(self.native.sample_keys(out["tokens"], [], self.max_images))
        return out

    def _failed(self, bad: BadSample, exc: Exception) -> None:
        """Count and report a load failure (``skip_bad_samples``), or raise its line."""
        bad = BadSample(bad.location, bad.sample_id, " ".join(bad.reason.split()))
        if not self.skip_bad_samples:
            raise ValueError(bad.describe(self.path)) from exc
        with self._failures_lock:
            self.load_failures.append(bad)
            count = len(self.load_failures)
        print(f"mimotron: skipped (data.skip_bad_samples, {count} at load so far): "
              f"{bad.describe(self.path)}", file=sys.stderr, flush=True)  # fmt: skip


class _Records(Sequence[LlavaRecord]):
    """:attr:`LlavaDataset.records`: a record read from the file on each access."""

    def __init__(self, dataset: LlavaDataset) -> None:
        self._dataset = dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._dataset.record(int(index))


class LlavaTask:
    """One split of a :class:`LlavaDataset`: what the training loop and streams read.

    Args:
        dataset: the checked samples.
        indices: the dataset indices in this split, in order.
        split: ``"train"`` or ``"validation"`` (for messages only: no augmentation).
    """

    def __init__(self, dataset: LlavaDataset, indices: Sequence[int], split: str = "train"
                 ) -> None:  # fmt: skip
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: expected one of {SPLITS}")
        self.dataset = dataset
        self.indices = np.asarray(indices, dtype=np.int64)
        self.split = split
        self.seq_length = dataset.seq_length
        self.pad_id = dataset.pad_id
        self.image_shape = dataset.image_shape
        self.max_images = dataset.max_images
        self.audio_shape = dataset.audio_shape
        self.modalities = dataset.modalities
        self.parts_at: Callable[[int], frozenset[str]] | None = None
        """Which parts a stream position's sample loads (:mod:`~mimotron.data.
        media_policy`, set by :func:`~mimotron.data.run_data.restrict_to_rank`: a rank
        decodes only the media it encodes); ``None``: every part the dataset loads."""

    @property
    def num_skipped(self) -> int:
        """Bad samples left out of the whole file (both splits)."""
        return self.dataset.num_skipped

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        return f"LlavaTask(split={self.split!r}, len={len(self)})"

    def stream(self, seed: int, shuffle: bool = True) -> SampleStream:
        """The endless, layout-independent order of this split's samples for ``seed``."""
        return SampleStream(self, seed, shuffle)

    def length_of(self, index: int) -> int:
        """Token count of sample ``index`` of this split (placeholders expanded), known on
        every rank without loading the sample (recorded when the dataset was checked)."""
        return int(self.dataset.lengths[int(self.indices[index])])

    def get(self, index: int, epoch: int = 0, parts: Collection[str] | None = None
            ) -> Sample:
        """Sample ``index`` of this split (``epoch`` is ignored: no augmentation), with
        only ``parts`` loaded where given (:meth:`LlavaDataset.load`)."""
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        position = int(self.indices[index])
        sample = (self.dataset.load(position) if parts is None
                  else self.dataset.load(position, parts))
        sample["index"] = index
        return sample

    def get_many(self, items: Sequence[tuple[int, int]],
                 parts: Sequence[Collection[str]] | None = None) -> list[Sample]:
        """Samples for several ``(index, epoch)`` pairs, in order (``parts``: per item)."""
        if parts is None:
            return [self.get(index, epoch) for index, epoch in items]
        return [self.get(index, epoch, p) for (index, epoch), p in zip(items, parts,
                                                                       strict=True)]


def llava_tasks(dataset: LlavaDataset, train_fraction: float) -> tuple[LlavaTask, LlavaTask]:
    """Train and validation splits of a dataset by the digits task's fixed hash shuffle.

    The split depends only on the number of kept samples and ``train_fraction``
    (:func:`~mimotron.data.digits.split_ids`), never on the seed or the layout.

    Raises:
        ValueError: a split would be empty.
    """
    return (LlavaTask(dataset, split_ids(len(dataset), train_fraction, "train"), "train"),
            LlavaTask(dataset, split_ids(len(dataset), train_fraction, "validation"),
                      "validation"))  # fmt: skip
