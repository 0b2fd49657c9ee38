"""The checks of one LLaVA sample, and the parse a load repeats without them.

:class:`SampleChecker` holds the rules (see :mod:`mimotron.data.llava`): valid JSON,
known roles, an assistant turn, no key the loader does not read unless ignored
(:mod:`~mimotron.data.sample_keys`; a sample in the ``messages`` layout of LLaMA-Factory
and ms-swift is read as its LLaVA equivalent), as many placeholders as files, media
paths that resolve inside the root (symlinks followed; unless ``allow_outside_root``), files that
exist and decode in full by the decoder the load uses (images decoded by PIL, WAV files
read to the last frame at the encoder's rate), images whose resized size is within the
image processor's bound (read from the header, before decoding:
:meth:`~mimotron.data.media.ImageProcessor.check_size`), a modality the model has an
encoder for, at most ``max_images`` images (``data.max_images_per_sample``; one for a tar
shard's sample, whose index row addresses one image member) and one audio clip per
sample, and a token count within ``seq_length``.

A sample comes as a :class:`RawItem`: its location for messages, its parsed JSON (or
the :class:`~mimotron.data.llava_file.SampleError` reading it gave) and, for a tar
shard, its media members (a JSON file's media are paths in the JSON, relative to the
root). :meth:`SampleChecker.check` runs every rule and tokenises (the sample's length);
:meth:`SampleChecker.check_many` does the same for a chunk of samples, tokenising them as
one batch (:mod:`~mimotron.data.chat_batch`: the same lengths, a fraction of the CPU);
:meth:`SampleChecker.parse` is what a load needs (messages, resolved media) without
decoding or tokenising again.

A media file used by many samples is decoded once per checking process: its result is
kept by ``(real path, size, modification time)``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mimotron.data.chat import (
    EncodedConversation,
    encode_conversation,
    shifted_sample,
    to_messages,
)
from mimotron.data.chat_batch import ConversationEncoder
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava_file import SampleError
from mimotron.data.media import AudioFeatures, ImageProcessor
from mimotron.data.sample_keys import check_sample_keys, check_shard_members, sample_layout
from mimotron.data.webdataset import TarMember

if TYPE_CHECKING:  # an annotation only: native_llava builds on this file
    from mimotron.data.native_llava import NativeLlava
    from mimotron.data.native_video import VideoPlan

Media = Path | TarMember
"""A media file: a resolved path, or a member of a tar shard."""
MODALITIES_CHECKED = ("image", "audio")


@dataclass(frozen=True)
class BadSample:
    """A sample that failed the checks: where it is, its id and why."""

    location: str  # "line 7" (JSONL, from 1), "item 6" (JSON list, from 0), shard + key
    sample_id: str | None
    reason: str

    def describe(self, path: str | Path) -> str:
        """One line: file, location, id, reason."""
        return f"{path} {self.location} (sample id {self.sample_id!r}): {self.reason}"


@dataclass(frozen=True)
class LlavaRecord:
    """A checked sample: its location, id, media, chat messages and token count
    (``length``: the tokens it trains on, placeholders expanded); with a
    native-resolution vision module, each image's token count as the check read it
    (``image_tokens``; empty after a :meth:`SampleChecker.parse`), its videos with the
    sampled frames and grid their headers give (``videos``, ``video_plans``) and the kind
    of each ``<image>`` / ``<video>`` placeholder in text order (``item_kinds``)."""

    location: str
    sample_id: str | None
    images: tuple[Media, ...]
    audios: tuple[Media, ...]
    messages: tuple[dict[str, str], ...]
    length: int
    image_tokens: tuple[int, ...] = ()
    videos: tuple[Media, ...] = ()
    video_plans: tuple[VideoPlan, ...] = ()
    item_kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class RawItem:
    """A sample as read from its file, before any check.

    Attributes:
        location: where it is, for messages (``"line 3"``).
        raw: the parsed JSON, or the SampleError reading it gave.
        media: a shard sample's members by modality; ``None``: paths in the JSON.
        key: a shard sample's key (its id when the JSON has none).
        unread: a shard sample's members that no reader takes (``k.txt``).
    """

    location: str
    raw: Any
    media: dict[str, tuple[TarMember, ...]] | None = None
    key: str | None = None
    unread: tuple[str, ...] = ()


class SampleChecker:
    """The rules of one sample (module docstring); shared by the check and the load.

    Args:
        root: folder the media paths are relative to (``data.root``).
        tokenizer: the run's tokenizer (with its chat template).
        seq_length: the most tokens a sample may have, placeholders expanded.
        num_tokens: modality -> the encoder's output tokens per item.
        audio_features: the Whisper feature extraction (its decoder checks WAV files).
        system_prompt: a system message put first in conversations that have none.
        allow_outside_root: accept media paths that resolve outside ``root``.
        image_processor: the vision tower's preprocessing (its resize bound is checked).
        ignore_keys: keys the loader does not read that are accepted (``data.ignore_keys``).
        max_images: the most images a sample may hold (``data.max_images_per_sample``).
        native: a native-resolution vision module's image text and processor
            (:class:`~mimotron.data.native_llava.NativeLlava`): each ``<image>`` becomes
            the model's image text, expanded to the image's own token count read from its
            header; ``image_processor`` is then its processor.
    """

    def __init__(self, root: str | Path, tokenizer: HFTokenizer, seq_length: int,
                 num_tokens: dict[str, int], audio_features: AudioFeatures | None = None,
                 system_prompt: str | None = None, allow_outside_root: bool = False,
                 image_processor: ImageProcessor | None = None,
                 ignore_keys: Sequence[str] = (), max_images: int = 1,
                 native: NativeLlava | None = None) -> None:  # fmt: skip
        self.root = Path(root)
        self.max_images = max_images
        self.native = native
        self.image_processor: Any = native.processor if native is not None else image_processor
        if native is not None:  # one placeholder id per image, expanded to its own count
            num_tokens = {**num_tokens, "image": 1}
        self.ignore_keys = frozenset(ignore_keys)
        self.real_root = self.root.resolve()
        self.tokenizer, self.seq_length, self.num_tokens = tokenizer, seq_length, num_tokens
        self.audio_features = audio_features
        self.system_prompt = system_prompt
        self.allow_outside_root = allow_outside_root
        self.pad_id = tokenizer.pad_id
        # Fast tokenizers are not safe to call from several threads at once.
        self._tokenizer_lock = threading.Lock()
        self._encoder = ConversationEncoder(tokenizer, num_tokens)
        # Files already decoded by this process: (real path, size, mtime) -> (error or
        # None, an image's (width, height) or None).
        self._decoded: dict[tuple[str, int, int], tuple[str | None, tuple[int, int] | None]] = {}
        # Media paths many samples share are resolved once (bounded: ranks parse on load).
        self._resolve = functools.lru_cache(maxsize=4096)(self._resolve_path)

    def check(self, item: RawItem) -> tuple[LlavaRecord, int] | BadSample:
        """Every rule; the record with its token count, or why the sample is bad."""
        return self.check_many([item])[0]

    def check_many(self, items: Sequence[RawItem], num_workers: int = 0
                   ) -> list[tuple[LlavaRecord, int] | BadSample]:  # fmt: skip
        """:meth:`check` of each item: media checked per sample (on ``num_workers``
        threads when > 0), the conversations tokenised as one batch
        (:class:`~mimotron.data.chat_batch.ConversationEncoder`: the same token counts
        and messages as one at a time, a fraction of the CPU)."""
        if num_workers > 0:
            with ThreadPoolExecutor(num_workers, thread_name_prefix="llava-check") as pool:
                parsed = list(pool.map(self._check_media, items))
        else:
            parsed = [self._check_media(item) for item in items]
        records = [p for p in parsed if isinstance(p, LlavaRecord)]
        # Tokenised once here, whatever a rank loads later: every rank knows every
        # sample's length (sequence packing decides rows from it).
        with self._tokenizer_lock:
            encoded = iter(self._encoder.encode([r.messages for r in records]))
        out: list[tuple[LlavaRecord, int] | BadSample] = []
        for item, result in zip(items, parsed, strict=True):
            if isinstance(result, BadSample):
                out.append(result)
                continue
            try:
                out.append((result, self._length_of(next(encoded), result.image_tokens,
                                                    result.video_plans)))
            except ValueError as exc:
                out.append(BadSample(item.location, result.sample_id, str(exc)))
        return out

    def _check_media(self, item: RawItem) -> LlavaRecord | BadSample:
        """The parse and the media rules of :meth:`check` (no tokenising)."""
        sample_id = None
        try:
            record = self.parse(item)
            sample_id = record.sample_id
            check_sample_keys(item.raw, self.ignore_keys, videos=self.native is not None)
            check_shard_members(item.unread, self.ignore_keys)
            sizes = self._check_files("image", record.images, record.messages)
            self._check_files("audio", record.audios, record.messages)
            if len(record.images) + len(record.videos) > self.max_images:
                raise SampleError(f"{len(record.images)} image(s) and {len(record.videos)} "
                                  f"video(s): more items than data.max_images_per_sample="
                                  f"{self.max_images} (raise it to at least "
                                  f"{len(record.images) + len(record.videos)})")
            if self.native is not None:
                counts = [self.native.processor.tokens_for_size(*size) for size in sizes]
                record = dataclasses.replace(record, image_tokens=tuple(counts))
        except SampleError as bad:
            return BadSample(item.location, bad.sample_id or sample_id, bad.reason)
        except ValueError as exc:
            return BadSample(item.location, sample_id, str(exc))
        return record

    def parse(self, item: RawItem, length: int = 0) -> LlavaRecord:
        """The sample's messages and media, without decoding or tokenising.

        Raises:
            SampleError: not a JSON object, bad turns, bad media paths.
        """
        raw = item.raw
        if isinstance(raw, SampleError):
            raise raw
        if not isinstance(raw, dict):
            raise SampleError(f"expected a JSON object, got {type(raw).__name__}")
        sample_id = str(raw["id"]) if raw.get("id") is not None else item.key
        try:
            layout = sample_layout(raw)
            turns = raw.get(layout.turns)
            if not isinstance(turns, list) or not turns:
                raise SampleError(f"{layout.turns!r} is missing or empty: expected a list of "
                                  "turns ('conversations' of from/value, or 'messages' of "
                                  "role/content)")  # fmt: skip
            try:
                messages = tuple(to_messages(turns, self.system_prompt, layout))
            except ValueError as exc:
                raise SampleError(str(exc)) from None
            if item.media is not None:
                files = {m: tuple(item.media.get(m, ())) for m in MODALITIES_CHECKED}
            else:
                keys = {"image": layout.image, "audio": layout.audio}
                files = {m: self._files(raw, keys[m]) for m in MODALITIES_CHECKED}
            videos: dict[str, Any] = {}
            if self.native is not None:
                videos = self._native_videos(raw, layout.video, item.media is None, messages)
                messages = tuple(videos.pop("messages"))
        except SampleError as bad:
            raise SampleError(bad.reason, sample_id) from None
        return LlavaRecord(item.location, sample_id, files["image"], files["audio"], messages,
                           length, **videos)  # fmt: skip

    def _native_videos(self, raw: dict, key: str, in_json: bool,
                       messages: tuple[dict[str, str], ...]) -> dict[str, Any]:
        """A native-resolution sample's videos (their headers read), the kind of each
        placeholder in text order, and its ``messages`` with each ``<image>`` and
        ``<video>`` written as the model's text.

        Raises:
            SampleError: a bad ``video`` value, a placeholder count that differs from its
                files, or a video that cannot be read (one line naming the file).
        """
        assert self.native is not None
        kinds = self.native.item_kinds(messages)
        videos = self._files(raw, key) if in_json else ()
        try:
            plans = self.native.video_plans(videos)
            wrapped = self.native.wrap_videos(self.native.wrap(messages), plans)
        except ValueError as exc:
            raise SampleError(str(exc)) from None
        return {"videos": videos, "video_plans": tuple(plans), "item_kinds": kinds,
                "messages": wrapped}

    def length(self, messages: tuple[dict[str, str], ...], image_tokens: Sequence[int] = (),
               videos: Sequence[VideoPlan] = ()) -> int:  # fmt: skip
        """The conversation's token count (what :meth:`tokenize` would give, no tensors).

        Raises:
            ValueError: as :meth:`tokenize`.
        """
        with self._tokenizer_lock:
            encoded = encode_conversation(self.tokenizer, messages, self.num_tokens)
        return self._length_of(encoded, image_tokens, videos)

    def _length_of(self, encoded: EncodedConversation | ValueError,
                   image_tokens: Sequence[int] = (), videos: Sequence[VideoPlan] = ()
                   ) -> int:  # fmt: skip
        """The token count, or the ``ValueError`` of an encoding or a length past
        ``seq_length``."""
        if isinstance(encoded, ValueError):
            raise encoded
        encoded = self._expanded(encoded, image_tokens, videos)
        if len(encoded.tokens) > self.seq_length:
            shifted_sample(encoded, self.pad_id, self.seq_length)  # raises its message
        return len(encoded.tokens)

    def _expanded(self, encoded: EncodedConversation, image_tokens: Sequence[int],
                  videos: Sequence[VideoPlan] = ()) -> EncodedConversation:  # fmt: skip
        """A native-resolution sample's image and video placeholders expanded to their
        counts.

        Raises:
            ValueError: items whose tokens alone exceed ``seq_length``.
        """
        if self.native is None:
            return encoded
        counts = [*image_tokens, *(t * h * w // self.native.processor.merge_size**2
                                   for t, h, w in (p.grid for p in videos))]
        if sum(counts) > self.seq_length:
            raise ValueError(f"its {len(image_tokens)} image(s) and {len(videos)} video(s) "
                             f"alone need {sum(counts)} vision tokens {counts}: more than "
                             f"data.seq_length={self.seq_length} (raise data.seq_length or "
                             "lower modules.<vision>.max_pixels)")
        return self.native.expand(encoded, image_tokens, videos)

    def tokenize(self, messages: tuple[dict[str, str], ...] | list[dict[str, str]],
                 image_tokens: Sequence[int] = (), videos: Sequence[VideoPlan] = ()
                 ) -> dict[str, Any]:  # fmt: skip
        """``tokens``, ``labels`` and ``loss_mask`` of a conversation.

        Args:
            messages: the conversation (as :meth:`parse` gives it).
            image_tokens: with a native-resolution vision module, each image's tokens.
            videos: its videos (their text's runs are expanded to their tokens).

        Raises:
            ValueError: the conversation cannot be encoded or is longer than seq_length.
        """
        with self._tokenizer_lock:
            encoded = encode_conversation(self.tokenizer, messages, self.num_tokens)
        return shifted_sample(self._expanded(encoded, image_tokens, videos), self.pad_id,
                              self.seq_length)

    # ---- media --------------------------------------------------------------------------
    def _files(self, raw: dict, key: str) -> tuple[Path, ...]:
        value = raw.get(key)
        paths = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise SampleError(f"{key!r}={value!r} is invalid: expected a path or a list of paths")
        return tuple(self._resolve(key, p) for p in paths)

    def _resolve_path(self, key: str, relative: str) -> Path:
        """The real path of a media file, checked to lie inside the root."""
        try:
            # resolve() follows symlinks: a link in the root pointing out of it is out.
            real = (self.root / relative).resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop
            raise SampleError(f"{key} path {relative!r} does not resolve: {exc}") from None
        if not self.allow_outside_root and not real.is_relative_to(self.real_root):
            raise SampleError(f"{key} path {relative!r} resolves to {str(real)!r}, outside "
                              f"data.root={str(self.root)!r} (data.allow_outside_root=true "
                              "accepts it)")  # fmt: skip
        return real

    def _check_files(self, modality: str, files: tuple[Media, ...],
                     messages: tuple[dict[str, str], ...]) -> list[tuple[int, int] | None]:
        """The rules of a sample's files of ``modality``; each image's (width, height)."""
        tokenizer = self.tokenizer
        placeholder = (tokenizer.placeholder_text(modality)
                       if modality in tokenizer.modalities else f"<{modality}>")
        count = sum(m["content"].count(placeholder) for m in messages)
        if self.native is not None and modality == "image":
            placeholder = "<image>"  # what the data holds (parse wrote it as the model's text)
        if count != len(files):
            raise SampleError(f"{count} {placeholder} placeholder(s) in the conversation but "
                              f"{len(files)} {modality} file(s): expected one placeholder per "
                              "file")  # fmt: skip
        if files and modality not in self.num_tokens:
            raise SampleError(f"has {modality} input but the model has no {modality} encoder")
        self._check_file_count(modality, files)
        return [self._decode_once(modality, file) for file in files]

    def _check_file_count(self, modality: str, files: tuple[Media, ...]) -> None:
        """At most one audio clip, one image of a shard sample, ``max_images`` images."""
        if len(files) <= 1:
            return
        if modality != "image" or any(isinstance(f, TarMember) for f in files):
            raise SampleError(f"{len(files)} {modality} files: at most one per sample is "
                              "supported" + (" in tar shards" if modality == "image" else ""))
        if len(files) > self.max_images:
            raise SampleError(f"{len(files)} image files and <image> placeholders: more than "
                              f"data.max_images_per_sample={self.max_images} (raise "
                              f"data.max_images_per_sample to at least {len(files)} to "
                              "accept the sample)")  # fmt: skip

    def _decode_once(self, modality: str, file: Media) -> tuple[int, int] | None:
        """Decode ``file`` in full by the load's decoder, once per file and process; an
        image's (width, height)."""
        memo = None
        if isinstance(file, Path):
            try:
                stat = file.stat()
            except OSError:
                raise SampleError(f"{modality} file {str(file)!r} not found") from None
            if not file.is_file():
                raise SampleError(f"{modality} file {str(file)!r} not found")
            memo = (str(file), stat.st_size, stat.st_mtime_ns)
            if memo in self._decoded:
                error, size = self._decoded[memo]
                if error is not None:
                    raise SampleError(error)
                return size
        size = None
        try:
            # Decoded in full, by the decoder the load uses: a file corrupt past its
            # header is bad here, not when training reaches it.
            if modality == "image":
                size = open_image(file, self.image_processor).size
            else:
                assert self.audio_features is not None
                self.audio_features.decode(file.open() if isinstance(file, TarMember) else file)
            error = None
        except (ValueError, OSError) as exc:
            error = " ".join(str(exc).split())
        if memo is not None:
            self._decoded[memo] = (error, size)
        if error is not None:
            raise SampleError(error)
        return size


def open_image(file: Media, processor: ImageProcessor | None = None) -> Any:
    """The decoded PIL image of ``file`` (read fully, file closed).

    Args:
        file: the image file.
        processor: when given, the size the header declares is checked against its
            resize bound (:meth:`ImageProcessor.check_size`) before any pixel is decoded.

    Raises:
        ValueError: not an image PIL can decode to the end, or one the processor would
            resize past its bound.
    """
    from PIL import Image

    def unreadable(exc: Exception) -> ValueError:
        return ValueError(f"image file {str(file)!r} is unreadable: {exc}")

    try:
        image = Image.open(file.open() if isinstance(file, TarMember) else file)  # header only
    except Exception as exc:  # noqa: BLE001 - any decoding failure is an unreadable image
        raise unreadable(exc) from exc
    with image:
        if processor is not None:
            try:
                processor.check_size(*image.size)  # before a pixel is decoded or resized
            except ValueError as exc:
                raise ValueError(f"image file {str(file)!r}: {exc}") from None
        try:
            image.load()  # decodes now, so the file can close
        except Exception as exc:  # noqa: BLE001 - as above
            raise unreadable(exc) from exc
        return image


def load_media(record: LlavaRecord, parts: frozenset[str],
               image_processor: ImageProcessor | None,
               audio_features: AudioFeatures | None,
               stack_images: bool = False) -> tuple[Any, Any]:  # fmt: skip
    """A record's ``(image, audio)`` tensors for the loaded ``parts`` (``None``: absent).

    Args:
        record: the checked sample.
        parts: the parts this rank loads (``"image"``, ``"audio"``, ``"text"``).
        image_processor: the vision tower's preprocessing.
        audio_features: the Whisper feature extraction.
        stack_images: give the image as ``[n, C, H, W]``, every image of the sample in
            the order of its list (``data.max_images_per_sample > 1``); otherwise the one
            image as ``[C, H, W]``.

    Raises:
        ValueError, OSError: a file that no longer decodes.
    """
    image = audio = None
    if record.images and "image" in parts:
        assert image_processor is not None
        assert stack_images or len(record.images) == 1, "the check allows one image"
        # The header's size is checked before decoding, as at the check.
        images = [image_processor(open_image(f, image_processor)) for f in record.images]
        image = torch.stack(images) if stack_images else images[0]
    if record.audios and "audio" in parts:
        assert audio_features is not None
        file = record.audios[0]
        audio = audio_features(file.open() if isinstance(file, TarMember) else file)
    return image, audio
