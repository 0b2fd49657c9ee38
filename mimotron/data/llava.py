"""LLaVA-format data: a JSON list or JSONL file of conversations with image/audio files.

Each sample is ``{"id": ..., "image": path | [path], "audio": path | [path],
"conversations": [{"from": "human" | "gpt" | "system", "value": "...<image>..."}]}``,
with paths relative to a root folder. One ``<image>`` (``<audio>``) per file stands in
the human turns where the encoder's output goes; it is expanded to the encoder's token
count (:mod:`mimotron.data.chat`).

**Checked up front.** :class:`LlavaDataset` reads the whole file and checks every sample
when it is built (before training starts, so before any collective): valid JSON, known
roles, an assistant turn, as many placeholders as files, media paths that resolve
inside the root (symlinks followed; unless ``allow_outside_root``), files that exist and
decode in full by the decoder the load uses (images decoded by PIL, WAV files read to
the last frame at the encoder's rate), a modality the model has an encoder for, at most
one file per modality (the batch format holds one image and one clip per sample), and a
token count within ``seq_length``; a line that is not UTF-8 is bad too
(:mod:`mimotron.data.llava_file`). The first bad sample is a one-line ``ValueError``
naming the file, the line (JSONL, from 1) or item (JSON list, from 0), the sample id and
the reason; with ``skip_bad_samples=True`` bad samples are left out and counted instead
(:attr:`LlavaDataset.num_skipped`, :attr:`LlavaDataset.bad_samples`). Since every rank
checks the same file the same way, the kept samples and their indices are the same on
every rank: the global sample order stays layout-independent. A file that changes or
breaks after the check is skipped when loaded with ``skip_bad_samples`` (zero media, no
loss; :meth:`LlavaDataset.load`) and an error naming the sample otherwise.

**Samples** are pure functions of their index (no augmentation): the
:mod:`~mimotron.data.collate` format with ``image`` Float[3, H, W] (the tower's
preprocessing), ``audio`` Float[mel bins, frames] (Whisper's log-mel), explicit
``has_image`` / ``has_audio`` flags, ``answer`` (the last assistant reply) and
``sample_id``. :meth:`LlavaDataset.restrict_loading` makes a rank load only the parts
its modules use (the training loop does, from the layout).

**Lengths.** The check tokenises every conversation, so it records each kept sample's
token count, placeholders expanded (:attr:`LlavaRecord.length`,
:meth:`LlavaTask.length_of`; a loaded sample carries it as ``length`` whatever parts
are loaded). Every rank thus knows the length of every sample without loading it: what
sequence packing (``data.packing``) decides its rows from, the same on every rank, on
an encoder rank that never tokenises too.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mimotron.data.chat import encode_conversation, shifted_sample, to_messages
from mimotron.data.collate import Sample
from mimotron.data.digits import SPLITS, SampleStream, split_ids
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava_file import SampleError, read_raw_samples
from mimotron.data.media import AudioFeatures, ImageProcessor

# Batch shape of a modality the model has no encoder for (collate fills it with zeros).
_ABSENT_SHAPE: tuple[int, ...] = (1, 1, 1)
# A sample's (image, audio) tensors; None: absent or not loaded on this rank.
_Media = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass(frozen=True)
class BadSample:
    """A sample that failed the checks: where it is, its id and why."""

    location: str  # "line 7" (JSONL, from 1) or "item 6" (JSON list, from 0)
    sample_id: str | None
    reason: str

    def describe(self, path: str | Path) -> str:
        """One line: file, location, id, reason."""
        return f"{path} {self.location} (sample id {self.sample_id!r}): {self.reason}"


@dataclass(frozen=True)
class LlavaRecord:
    """A checked sample: its location, id, resolved files, chat messages and token count
    (``length``: the tokens it trains on, placeholders expanded)."""

    location: str
    sample_id: str | None
    images: tuple[Path, ...]
    audios: tuple[Path, ...]
    messages: tuple[dict[str, str], ...]
    length: int


class LlavaDataset:
    """Every sample of a LLaVA file, checked when built (rules in the module docstring).

    Args:
        path: the JSON / JSONL file (``data.path``).
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
        num_workers: threads that check the samples (0: in this thread).
        allow_outside_root: accept media paths that resolve outside ``root`` (``..``,
            absolute paths, symlinks out of it); otherwise such a sample is bad.

    Raises:
        ValueError: the first bad sample (without ``skip_bad_samples``), a modality
            without its preprocessing, or no usable sample at all.
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
    ) -> None:
        self.path, self.root = Path(path), Path(root)
        self._real_root = self.root.resolve()
        self.allow_outside_root = allow_outside_root
        self.skip_bad_samples = skip_bad_samples
        # Samples that failed when loaded (skip_bad_samples); appended by loader threads.
        self.load_failures: list[BadSample] = []
        self._failures_lock = threading.Lock()
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.num_tokens = {m: int(n) for m, n in num_tokens.items()}
        self.image_processor = image_processor
        self.audio_features = audio_features
        self.system_prompt = system_prompt
        self._check_modalities()
        # Fast tokenizers are not safe to call from several threads at once.
        self._tokenizer_lock = threading.Lock()
        self.modalities = tuple(m for m in tokenizer.modalities if m in self.num_tokens)
        self.pad_id = tokenizer.pad_id
        self.image_shape = image_processor.output_shape if image_processor else _ABSENT_SHAPE
        self.audio_shape = audio_features.output_shape if audio_features else _ABSENT_SHAPE
        self.load_parts: frozenset[str] = frozenset(("text", *self.modalities))
        raw = read_raw_samples(self.path)
        checked = _map(self._check, raw, num_workers)
        self.records: list[LlavaRecord] = [r for r in checked if isinstance(r, LlavaRecord)]
        self.bad_samples: list[BadSample] = [r for r in checked if isinstance(r, BadSample)]
        if self.bad_samples and not skip_bad_samples:
            raise ValueError(self.bad_samples[0].describe(self.path)
                             + " (data.skip_bad_samples=true skips bad samples)")  # fmt: skip
        if not self.records:
            raise ValueError(f"data.path={str(self.path)!r} has no usable sample "
                             f"({len(self.bad_samples)} bad, {len(raw)} in all)")  # fmt: skip

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
        return len(self.records)

    def __repr__(self) -> str:
        return (f"LlavaDataset({str(self.path)!r}, len={len(self)}, "
                f"skipped={self.num_skipped})")  # fmt: skip

    # ---- checks -------------------------------------------------------------------------
    def _check(self, item: tuple[str, Any]) -> LlavaRecord | BadSample:
        location, raw = item
        sample_id = None
        try:
            if isinstance(raw, SampleError):
                raise raw
            if not isinstance(raw, dict):
                raise SampleError(f"expected a JSON object, got {type(raw).__name__}")
            sample_id = None if raw.get("id") is None else str(raw["id"])
            return self._check_sample(location, sample_id, raw)
        except SampleError as bad:
            return BadSample(location, sample_id, bad.reason)

    def _check_sample(self, location: str, sample_id: str | None, raw: dict) -> LlavaRecord:
        conversations = raw.get("conversations")
        if not isinstance(conversations, list) or not conversations:
            raise SampleError("'conversations' is missing or empty: expected a list of turns")
        try:
            messages = to_messages(conversations, self.system_prompt)
        except ValueError as exc:
            raise SampleError(str(exc)) from None
        files = {m: self._files(raw, m) for m in ("image", "audio")}
        for modality, paths in files.items():
            self._check_files(modality, paths, messages)
        try:
            # Tokenised once here, whatever this rank loads later: every rank knows every
            # sample's length (sequence packing decides rows from it).
            length = int(self._tokenize(tuple(messages))["tokens"].numel())
        except ValueError as exc:
            raise SampleError(str(exc)) from None
        return LlavaRecord(location, sample_id, files["image"], files["audio"],
                           tuple(messages), length)  # fmt: skip

    def _files(self, raw: dict, key: str) -> tuple[Path, ...]:
        value = raw.get(key)
        paths = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise SampleError(f"{key!r}={value!r} is invalid: expected a path or a list of paths")
        return tuple(self._resolve(key, p) for p in paths)

    def _resolve(self, key: str, relative: str) -> Path:
        """The real path of a media file, checked to lie inside the root."""
        try:
            # resolve() follows symlinks: a link in the root pointing out of it is out.
            real = (self.root / relative).resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise SampleError(f"{key} path {relative!r} does not resolve: {exc}") from None
        if not self.allow_outside_root and not real.is_relative_to(self._real_root):
            raise SampleError(f"{key} path {relative!r} resolves to {str(real)!r}, outside "
                       f"data.root={str(self.root)!r} (data.allow_outside_root=true "
                       "accepts it)")  # fmt: skip
        return real

    def _check_files(self, modality: str, paths: tuple[Path, ...],
                     messages: list[dict[str, str]]) -> None:  # fmt: skip
        placeholder = (self.tokenizer.placeholder_text(modality)
                       if modality in self.tokenizer.modalities else f"<{modality}>")
        count = sum(m["content"].count(placeholder) for m in messages)
        if count != len(paths):
            raise SampleError(f"{count} {placeholder} placeholder(s) in the conversation but "
                       f"{len(paths)} {modality} file(s): expected one placeholder per file")
        if paths and modality not in self.num_tokens:
            raise SampleError(f"has {modality} input but the model has no {modality} encoder")
        if len(paths) > 1:
            raise SampleError(f"{len(paths)} {modality} files: at most one per sample is supported")
        for file in paths:
            if not file.is_file():
                raise SampleError(f"{modality} file {str(file)!r} not found")
            try:
                # Decoded in full, by the decoder the load uses: a file corrupt past its
                # header is bad here, not when training reaches it.
                if modality == "image":
                    _open_image(file)
                else:
                    assert self.audio_features is not None
                    self.audio_features.decode(file)
            except ValueError as exc:
                raise SampleError(str(exc)) from None

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

    def _tokenize(self, messages: Sequence[dict[str, str]]) -> dict[str, torch.Tensor]:
        with self._tokenizer_lock:
            encoded = encode_conversation(self.tokenizer, messages, self.num_tokens)
        return shifted_sample(encoded, self.pad_id, self.seq_length)

    def _encode(self, record: LlavaRecord) -> dict[str, torch.Tensor]:
        if "text" not in self.load_parts:
            empty = torch.zeros(0, dtype=torch.long)
            return {"tokens": empty, "labels": empty, "loss_mask": empty.float()}
        return self._tokenize(record.messages)

    def load(self, index: int) -> Sample:
        """Sample ``index`` (of the kept samples, in file order).

        A media file that fails to load although it passed the check (it changed on disk
        since) is skipped with ``skip_bad_samples``: the sample keeps its shape and
        presence flags, so batches and every rank's transfers stay the same, but its
        media are zeros and its loss mask is empty (nothing of it is trained); it is
        counted in :attr:`num_skipped` and :attr:`load_failures` and reported on stderr.

        Raises:
            ValueError: a bad index, or (without ``skip_bad_samples``) a file that can no
                longer be read: one line naming the data file, line, sample id and file.
        """
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        record = self.records[index]
        sample: dict[str, Any] = self._encode(record)  # checked when built: cannot fail
        try:
            image, audio = self._load_media(record)
        except (OSError, ValueError) as exc:
            image, audio = self._skip_failed(record, exc)
            sample["loss_mask"] = torch.zeros_like(sample["loss_mask"])
        has = (bool(record.images), bool(record.audios))
        kind = {(True, True): "both", (True, False): "image", (False, True): "audio",
                (False, False): "text"}[has]  # fmt: skip
        answer = [m["content"] for m in record.messages if m["role"] == "assistant"][-1]
        sample.update(image=image, audio=audio, has_image=has[0], has_audio=has[1],
                      answer=answer, index=index, kind=kind, length=record.length,
                      sample_id=record.sample_id)  # fmt: skip
        return sample

    def _load_media(self, record: LlavaRecord) -> _Media:
        image = audio = None
        if record.images and "image" in self.load_parts:
            assert self.image_processor is not None
            image = self.image_processor(_open_image(record.images[0]))
        if record.audios and "audio" in self.load_parts:
            assert self.audio_features is not None
            audio = self.audio_features(record.audios[0])
        return image, audio

    def _skip_failed(self, record: LlavaRecord, exc: Exception) -> _Media:
        """Zero media standing in for a sample that failed to load, or its one-line error."""
        reason = " ".join(f"failed to load: {exc}".split())  # one line, whatever PIL says
        bad = BadSample(record.location, record.sample_id, reason)
        if not self.skip_bad_samples:
            raise ValueError(bad.describe(self.path)) from exc
        with self._failures_lock:
            self.load_failures.append(bad)
            count = len(self.load_failures)
        print(f"mimotron: skipped (data.skip_bad_samples, {count} at load so far): "
              f"{bad.describe(self.path)}", file=sys.stderr, flush=True)  # fmt: skip
        image = audio = None
        if record.images and "image" in self.load_parts:
            image = torch.zeros(self.image_shape)
        if record.audios and "audio" in self.load_parts:
            audio = torch.zeros(self.audio_shape)
        return image, audio


def _open_image(file: Path) -> Any:
    """The decoded PIL image of ``file`` (read fully, file closed)."""
    from PIL import Image

    try:
        with Image.open(file) as image:
            image.load()  # decodes now, so the file can close
            return image
    except Exception as exc:  # noqa: BLE001 - any decoding failure is an unreadable image
        raise ValueError(f"image file {str(file)!r} is unreadable: {exc}") from exc


def _map(fn: Callable[[Any], Any], items: Sequence[Any], num_workers: int) -> list[Any]:
    """``[fn(x) for x in items]``, on ``num_workers`` threads when > 0 (order kept)."""
    if num_workers <= 0:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(num_workers, thread_name_prefix="llava-check") as pool:
        return list(pool.map(fn, items))


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
        self.audio_shape = dataset.audio_shape
        self.modalities = dataset.modalities

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
        return self.dataset.records[int(self.indices[index])].length

    def get(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` of this split (``epoch`` is ignored: no augmentation)."""
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        sample = self.dataset.load(int(self.indices[index]))
        sample["index"] = index
        return sample

    def get_many(self, items: Sequence[tuple[int, int]]) -> list[Sample]:
        """Samples for several ``(index, epoch)`` pairs, in order."""
        return [self.get(index, epoch) for index, epoch in items]


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
