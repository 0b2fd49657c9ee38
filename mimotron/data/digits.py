"""The demo task: read a digit image, hear a DTMF tone, answer in words.

Every sample is one of four kinds (docs/design.md, "The demo task"), with prompts and
answers like:

======  =================================  ==============================
kind    prompt                             answer
======  =================================  ==============================
image   ``<bos><image>x16=``                 ``seven<eos>``
audio   ``<bos><audio>x4=``                  ``three<eos>``
both    ``<bos><image>x16<audio>x4=``        ``seven plus three is ten<eos>``
text    ``<bos>two plus three=``             ``five<eos>``
======  =================================  ==============================

**Determinism (docs/design.md, "The parity contract").** A sample is a pure function of
``(seed, split, epoch, index)``: all its randomness (kind, audio digit, text digits,
image shift, tone) comes from one generator seeded with exactly that tuple. So any rank,
in any layout, that builds sample ``(index, epoch)`` gets the same tensors, and
:class:`SampleStream` fixes which ``(index, epoch)`` sits at each global position of the
training stream.
"""

from __future__ import annotations

import functools
import importlib.util
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from mimotron.data.collate import Sample, build_text_sample
from mimotron.data.dtmf import NUM_FRAMES, NUM_FREQ_BINS, tone_spectrograms
from mimotron.data.tokenizer import MODALITIES, CharTokenizer, number_to_words

SPLITS: tuple[str, ...] = ("train", "validation")
KINDS: tuple[str, ...] = ("image", "audio", "both", "text")

# Salts keep the random streams of different consumers (sample content, epoch order)
# unrelated even when they share (seed, epoch, index) numbers.
_DIGITS_SALT = 0x6D696D6F
_STREAM_SALT = 0x73747265
_SPLIT_SALT = 0x0DD5EED5


class Task(Protocol):
    """What :class:`SampleStream` and the training loop need from a dataset."""

    def __len__(self) -> int: ...

    def get(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` of epoch ``epoch``; a pure function of its arguments."""
        ...

    def get_many(self, items: Sequence[tuple[int, int]]) -> list[Sample]:
        """``[get(index, epoch) for index, epoch in items]``, possibly batched."""
        ...


def sample_rng(seed: int, salt: int, *key: int) -> np.random.Generator:
    """A generator that is a stable function of ``(seed, salt, *key)`` in every process.

    Philox is counter-based: ``(seed, salt)`` is its key and ``key`` (up to three
    non-negative integers, e.g. split, epoch, index) fills the high words of the
    256-bit counter. Every ``key`` thus owns a disjoint 2**64-block stretch of one
    stream, and building a generator costs a few microseconds (a ``SeedSequence`` costs
    several times more, which matters at 64 samples a step). Negative seeds are folded
    into ``[0, 2**64)``.
    """
    if len(key) > 3 or any(k < 0 for k in key):
        raise ValueError(f"key={key!r} is invalid: expected up to 3 integers >= 0")
    counter = [0, *key, 0, 0, 0][:4]
    bit_generator = np.random.Philox(counter=counter, key=[seed % 2**64, salt % 2**64])
    return np.random.Generator(bit_generator)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 hash: a fixed, numpy-version-independent scramble of uint64 values."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def split_ids(num_items: int, train_fraction: float, split: str) -> np.ndarray:
    """Item ids of one split: a fixed shuffle (independent of any seed) cut at the fraction.

    Args:
        num_items: items to split (1797 digit images).
        train_fraction: share of items in ``train``; ``round`` decides the boundary.
        split: ``"train"`` or ``"validation"``.

    Returns:
        Sorted int64 ids of the split (1438 / 359 for the digits at 0.8).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid: expected one of {SPLITS}")
    num_train = round(train_fraction * num_items)
    if not 0 < num_train < num_items:
        raise ValueError(
            f"train_fraction={train_fraction!r} is invalid: expected both splits non-empty "
            f"for {num_items} items (a number in (0, 1))"
        )
    with np.errstate(over="ignore"):  # uint64 wrap-around is the point of the hash
        order = np.argsort(_splitmix64(np.arange(num_items) + _SPLIT_SALT), kind="stable")
    ids = order[:num_train] if split == "train" else order[num_train:]
    return np.sort(ids).astype(np.int64)


@functools.lru_cache(maxsize=1)
def load_digit_images() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits, loaded once per process (no download).

    Returns:
        ``images`` Float[1797, 1, 8, 8] in ``[0, 1]`` and ``labels`` Long[1797]. Treat
        them as read-only: they are shared by every task in the process.
    """
    pixels, target = _read_bundled_digits()
    images = torch.from_numpy(pixels.astype(np.float32) / 16.0).unsqueeze(1)
    return images, torch.from_numpy(target.astype(np.int64))


def _read_bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images [1797, 8, 8], labels [1797])`` as ``sklearn.datasets.load_digits`` gives.

    The file is read straight from the installed package: importing scikit-learn costs
    ~3 s of CPU per process, which every rank of every launch paid at start-up.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "datasets/data/digits.csv.gz"
        if path.is_file():
            rows = np.loadtxt(path, delimiter=",")  # what load_digits itself reads
            return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1]
    from sklearn.datasets import load_digits  # another layout of the package

    data = load_digits()
    return data.images, data.target


def shift_image(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Move ``image`` ([C, H, W]) by ``dy`` rows and ``dx`` columns, filling with zeros."""
    out = torch.zeros_like(image)
    height, width = image.shape[-2:]
    if abs(dy) >= height or abs(dx) >= width:
        return out
    out[..., max(dy, 0) : height + min(dy, 0), max(dx, 0) : width + min(dx, 0)] = image[
        ..., max(-dy, 0) : height - max(dy, 0), max(-dx, 0) : width - max(dx, 0)
    ]
    return out


def modality_kind_map(modalities: Sequence[str]) -> dict[str, str]:
    """How each sample kind is remapped when an encoder is missing.

    The rule: a kind keeps the modalities that have an encoder and drops the others.
    Without an audio encoder, ``audio`` and ``both`` samples become ``image`` samples;
    without an image encoder, ``image`` and ``both`` become ``audio``; with neither,
    every sample is ``text``. The kind is still drawn with the configured probabilities
    first, so the other random choices of a sample do not change.
    """
    has_image, has_audio = "image" in modalities, "audio" in modalities
    fallback = "image" if has_image else ("audio" if has_audio else "text")
    return {
        "image": "image" if has_image else fallback,
        "audio": "audio" if has_audio else fallback,
        "both": "both" if has_image and has_audio else fallback,
        "text": "text",
    }


def _check_task_args(
    modalities: Sequence[str],
    probabilities: tuple[float, float, float, float],
    num_image_tokens: int,
    num_audio_tokens: int,
    image_shift: int,
) -> np.ndarray:
    """Validate ``DigitsTask`` arguments; return the normalised kind probabilities."""
    if any(m not in MODALITIES for m in modalities):
        raise ValueError(
            f"modalities={list(modalities)!r} is invalid: expected items of {MODALITIES}"
        )
    weights = np.array(probabilities, dtype=np.float64)
    if (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(
            f"p_image, p_audio, p_both, p_text = {list(probabilities)} are invalid: expected "
            "non-negative mixture weights with a positive sum"
        )
    for name, value in (("num_image_tokens", num_image_tokens),
                        ("num_audio_tokens", num_audio_tokens)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
    if image_shift < 0:
        raise ValueError(f"image_shift={image_shift!r} is invalid: expected an integer >= 0")
    return weights / weights.sum()


class _Plan(NamedTuple):
    """The random choices of one sample, drawn by ``DigitsTask._plan``."""

    kind: str
    dy: int
    dx: int
    audio_digit: int
    text_digits: tuple[int, int]
    # Continues after the choices above; it draws the tone.
    rng: np.random.Generator | None


class DigitsTask:
    """Digit images, DTMF tones and text sums, answered in words (docs/design.md, "The demo task").

    Args:
        tokenizer: the character tokenizer (placeholder ids come from it).
        seq_length: the most tokens a sample may have (placeholders included).
        seed: the run's seed (``train.seed``); sample content depends on it, the split
            does not.
        split: ``"train"`` or ``"validation"``; validation samples never change (epoch 0,
            no image shift) so evaluations are comparable.
        train_fraction: share of the 1797 images in ``train`` (0.8 gives 1438 / 359).
        p_image: weight of image-only samples (weights are normalised).
        p_audio: weight of audio-only samples.
        p_both: weight of image + audio samples (answer ``a plus b is c``).
        p_text: weight of text-only sums.
        image_shift: largest random shift in pixels (train only; 0 disables it).
        num_image_tokens: ``<image>`` placeholders per image (the vision encoder's
            output tokens).
        num_audio_tokens: ``<audio>`` placeholders per tone.
        modalities: modalities that have an encoder; kinds needing a missing one are
            remapped by :func:`modality_kind_map`.

    Raises:
        ValueError: a bad argument, or ``seq_length`` too small for the longest sample.
    """

    def __init__(
        self,
        tokenizer: CharTokenizer,
        seq_length: int,
        seed: int,
        split: str = "train",
        train_fraction: float = 0.8,
        p_image: float = 0.3,
        p_audio: float = 0.2,
        p_both: float = 0.4,
        p_text: float = 0.1,
        image_shift: int = 1,
        num_image_tokens: int = 16,
        num_audio_tokens: int = 4,
        modalities: Sequence[str] = MODALITIES,
    ) -> None:
        weights = _check_task_args(
            modalities, (p_image, p_audio, p_both, p_text), num_image_tokens,
            num_audio_tokens, image_shift,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.image_shift = image_shift if split == "train" else 0
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        self.pad_id = tokenizer.pad_id
        self.num_image_tokens = num_image_tokens
        self.num_audio_tokens = num_audio_tokens
        self.image_shape: tuple[int, ...] = (1, 8, 8)
        self.audio_shape: tuple[int, ...] = (NUM_FREQ_BINS, NUM_FRAMES)
        images, labels = load_digit_images()
        ids = split_ids(len(labels), train_fraction, split)
        self._images = images[torch.from_numpy(ids)]  # a private copy, [N, 1, 8, 8]
        self._labels: list[int] = labels[torch.from_numpy(ids)].tolist()
        self._split_id = SPLITS.index(split)
        self._cumulative: list[float] = np.cumsum(weights).tolist()
        self._kind_map = modality_kind_map(self.modalities)
        reachable = {self._kind_map[k] for k, w in zip(KINDS, weights, strict=True) if w > 0}
        self.kinds: tuple[str, ...] = tuple(k for k in KINDS if k in reachable)
        image_ids = tokenizer.placeholders([("image", num_image_tokens)])
        audio_ids = tokenizer.placeholders([("audio", num_audio_tokens)])
        tail = tokenizer.encode("=")
        self._prompts: dict[str, list[int]] = {
            "image": [tokenizer.bos_id, *image_ids, *tail],
            "audio": [tokenizer.bos_id, *audio_ids, *tail],
            "both": [tokenizer.bos_id, *image_ids, *audio_ids, *tail],
        }
        # (kind, digits...) -> (text tensors, answer); bounded by the ~220 distinct texts.
        self._text_cache: dict[tuple[Any, ...], tuple[dict[str, torch.Tensor], str]] = {}
        self.max_sample_length = self._longest_sample()
        if self.max_sample_length > seq_length:
            raise ValueError(
                f"data.seq_length={seq_length} is too small: the longest {split} sample needs "
                f"{self.max_sample_length} tokens"
            )

    def __len__(self) -> int:
        return len(self._labels)

    def __repr__(self) -> str:
        return f"DigitsTask(split={self.split!r}, len={len(self)}, kinds={self.kinds})"

    def stream(self, seed: int, shuffle: bool = True) -> SampleStream:
        """The endless, layout-independent order of this task's samples for ``seed``."""
        return SampleStream(self, seed, shuffle)

    # ---- text of a sample ---------------------------------------------------------------
    def _prompt_and_answer(self, kind: str, image_digit: int, plan: _Plan) -> tuple[list[int], str]:
        """Prompt ids and answer text of a sample of ``kind``."""
        if kind == "image":
            return self._prompts[kind], number_to_words(image_digit)
        if kind == "audio":
            return self._prompts[kind], number_to_words(plan.audio_digit)
        if kind == "both":
            total = image_digit + plan.audio_digit
            return self._prompts[kind], (
                f"{number_to_words(image_digit)} plus {number_to_words(plan.audio_digit)} "
                f"is {number_to_words(total)}"
            )
        a, b = plan.text_digits
        question = f"{number_to_words(a)} plus {number_to_words(b)}="
        return [self.tokenizer.bos_id, *self.tokenizer.encode(question)], number_to_words(a + b)

    def _longest_sample(self) -> int:
        """Tokens of the longest sample any reachable kind can produce."""
        longest = 0
        for kind in self.kinds:
            for a in range(10):
                for b in range(10):
                    plan = _Plan(kind, 0, 0, b, (a, b), None)
                    prompt, answer = self._prompt_and_answer(kind, a, plan)
                    longest = max(longest, len(prompt) + len(answer) + 1)
        return longest

    # ---- samples ------------------------------------------------------------------------
    def _plan(self, index: int, epoch: int) -> _Plan:
        """Draw every random choice of sample ``(index, epoch)`` in a fixed order."""
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        if epoch < 0:
            raise ValueError(f"epoch={epoch!r} is invalid: expected an integer >= 0")
        rng = sample_rng(self.seed, _DIGITS_SALT, self._split_id, epoch, index)
        # One draw for every choice (a single call is much cheaper than several).
        u = rng.random(6)
        # min(): guards the cumulative sum's last entry being a hair below 1.0.
        kind_id = min(sum(1 for c in self._cumulative if c <= u[0]), 3)
        span = 2 * self.image_shift + 1
        dy, dx = (int(v * span) - self.image_shift for v in u[1:3])
        audio_digit, a, b = (int(v * 10) for v in u[3:6])
        # The generator goes on to draw the tone, after every other choice.
        return _Plan(self._kind_map[KINDS[kind_id]], dy, dx, audio_digit, (a, b), rng)

    def get(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` of epoch ``epoch`` (validation always uses epoch 0).

        Args:
            index: position in the split, ``0 <= index < len(self)``.
            epoch: pass over the data; training augmentation differs per epoch.

        Returns:
            The sample dict (format in :mod:`mimotron.data.collate`).
        """
        return self.get_many([(index, epoch)])[0]

    def get_many(self, items: Sequence[tuple[int, int]]) -> list[Sample]:
        """Several samples at once; tones share one batched STFT.

        Each sample is identical to ``get(index, epoch)`` whatever else is in ``items``.

        Args:
            items: ``(index, epoch)`` pairs.

        Returns:
            One sample dict per pair, in order.
        """
        if self.split != "train":
            items = [(index, 0) for index, _ in items]
        plans = [self._plan(index, epoch) for index, epoch in items]
        with_audio = [k for k, p in enumerate(plans) if p.kind in ("audio", "both")]
        specs = tone_spectrograms(
            [plans[k].audio_digit for k in with_audio], [plans[k].rng for k in with_audio]
        )
        audio: dict[int, torch.Tensor] = dict(zip(with_audio, specs, strict=True))
        return [
            self._assemble(index, plan, audio.get(k))
            for k, ((index, _), plan) in enumerate(zip(items, plans, strict=True))
        ]

    def _text_tensors(self, plan: _Plan, image_digit: int) -> tuple[dict[str, torch.Tensor], str]:
        """``tokens``/``labels``/``loss_mask`` (fresh copies) and the answer of a sample.

        There are only ~220 distinct texts, so they are built once per task and cloned:
        a clone is several times cheaper than ``torch.tensor`` from a list.
        """
        key = (
            plan.kind,
            image_digit if plan.kind in ("image", "both") else -1,
            plan.audio_digit if plan.kind in ("audio", "both") else -1,
            plan.text_digits if plan.kind == "text" else (-1, -1),
        )
        if key not in self._text_cache:
            prompt, answer = self._prompt_and_answer(plan.kind, image_digit, plan)
            tok = self.tokenizer
            tensors = build_text_sample(
                prompt, tok.encode(answer), tok.eos_id, tok.pad_id, self.seq_length
            )
            self._text_cache[key] = (tensors, answer)
        tensors, answer = self._text_cache[key]
        return {name: t.clone() for name, t in tensors.items()}, answer

    def _assemble(self, index: int, plan: _Plan, audio: torch.Tensor | None) -> Sample:
        """Build the sample dict from its random choices and spectrogram."""
        image_digit = self._labels[index]
        sample: dict[str, Any]
        sample, answer = self._text_tensors(plan, image_digit)
        image = None
        if plan.kind in ("image", "both"):
            image = shift_image(self._images[index], plan.dy, plan.dx)
        sample.update(image=image, audio=audio, answer=answer, index=index, kind=plan.kind)
        return sample


class SampleStream:
    """An endless, layout-independent order of a task's samples.

    Global position ``p`` holds sample ``perm_e[p % len]`` of epoch ``e = p // len``,
    where ``perm_e`` is a permutation seeded by ``(seed, e)``. Training reads global
    batch ``k`` as ``samples(k * global_batch_size, global_batch_size)`` on every rank,
    so the data order depends only on the seed and the consumed-sample count: a resume
    from ``consumed_samples`` continues exactly where the run stopped.

    Args:
        dataset: a task with ``__len__`` and ``get_many`` (or ``get``).
        seed: the run's seed.
        shuffle: ``False`` reads every epoch in index order (for evaluation).
        num_cached_epochs: permutations kept in memory (two suffice for a batch that
            straddles an epoch boundary).
    """

    def __init__(
        self, dataset: Task, seed: int, shuffle: bool = True, num_cached_epochs: int = 4
    ) -> None:
        if len(dataset) < 1:
            raise ValueError("dataset is empty: a sample stream needs at least one sample")
        if num_cached_epochs < 1:
            raise ValueError(
                f"num_cached_epochs={num_cached_epochs!r} is invalid: expected an integer >= 1"
            )
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self._num_cached_epochs = num_cached_epochs
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Indices of the task in the order epoch ``epoch`` visits them."""
        if epoch < 0:
            raise ValueError(f"epoch={epoch!r} is invalid: expected an integer >= 0")
        if epoch in self._orders:
            self._orders.move_to_end(epoch)
            return self._orders[epoch]
        num = len(self.dataset)
        if self.shuffle:
            order = sample_rng(self.seed, _STREAM_SALT, epoch).permutation(num)
        else:
            order = np.arange(num)
        order.setflags(write=False)
        self._orders[epoch] = order
        if len(self._orders) > self._num_cached_epochs:
            self._orders.popitem(last=False)
        return order

    def items(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(index, epoch)`` of global positions ``[start, start + count)``."""
        if start < 0 or count < 0:
            raise ValueError(
                f"start={start!r}, count={count!r} are invalid: expected integers >= 0"
            )
        num = len(self.dataset)
        return [
            (int(self.epoch_order(p // num)[p % num]), p // num)
            for p in range(start, start + count)
        ]

    def samples(self, start: int, count: int) -> list[Sample]:
        """The samples at global positions ``[start, start + count)``.

        Args:
            start: first global position (``consumed_samples`` of the run so far).
            count: number of samples (a global batch).

        Returns:
            Sample dicts in position order.
        """
        items = self.items(start, count)
        parts_at = getattr(self.dataset, "parts_at", None)  # what each position loads
        if parts_at is not None:
            return self.dataset.get_many(items, [parts_at(start + k) for k in range(count)])
        get_many = getattr(self.dataset, "get_many", None)
        if get_many is not None:
            return get_many(items)
        return [self.dataset.get(index, epoch) for index, epoch in items]

    def load(self, positions: Sequence[int], parts: Sequence[frozenset[str]]) -> list[Sample]:
        """The samples at ``positions`` with only ``parts`` each: the second read of media
        decoded once a step shows which items a rank encodes
        (:class:`~mimotron.data.media_policy.DeferredMedia`)."""
        items = [self.items(p, 1)[0] for p in positions]
        return self.dataset.get_many(items, list(parts))
