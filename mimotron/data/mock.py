"""Random samples with the digits task's schema, for parity and layout tests.

Mock samples exercise every code path the real task does (each modality present or
absent, text-only samples, answer spans of varying length and position) but carry no
learnable signal and need no data files, so multi-rank tests can compare layouts on
them cheaply. Like :class:`~mimotron.data.digits.DigitsTask`, a sample is a pure
function of ``(seed, split, epoch, index)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mimotron.data.collate import Sample, build_text_sample
from mimotron.data.digits import KINDS, SPLITS, SampleStream, modality_kind_map, sample_rng
from mimotron.data.tokenizer import MODALITIES, CharTokenizer

_MOCK_SALT = 0x6D6F636B
_MAX_ANSWER_TOKENS = 8
_MAX_QUESTION_TOKENS = 12


class MockTask:
    """Random token ids, images and spectrograms in the sample format of the digits task.

    Kinds (``image``, ``audio``, ``both``, ``text``) are equally likely, remapped like the
    digits task when an encoder is missing (:func:`modality_kind_map`). The prompt is
    ``<bos>``, the placeholders of the sample's modalities and 0-12 random character ids;
    the answer is 1-8 random character ids, then ``<eos>``; everything fits in
    ``seq_length``. Images and spectrograms are standard normal.

    Args:
        tokenizer: a :class:`CharTokenizer`, or a vocabulary size; with a size, ids follow
            the same layout (pad 0, bos 1, eos 2, ``<image>`` 3, ``<audio>`` 4, then
            ordinary tokens), so a model built for either sees the same placeholders.
        seq_length: the most tokens a sample may have.
        seed: the run's seed.
        num_samples: samples in this split.
        split: ``"train"`` or ``"validation"`` (validation ignores ``epoch``).
        num_image_tokens: ``<image>`` placeholders per image.
        num_audio_tokens: ``<audio>`` placeholders per spectrogram.
        image_shape: shape of one image.
        audio_shape: shape of one spectrogram.
        modalities: modalities that have an encoder.

    Raises:
        ValueError: a bad argument, or ``seq_length`` too small for the longest prompt.
    """

    def __init__(
        self,
        tokenizer: CharTokenizer | int,
        seq_length: int,
        seed: int,
        num_samples: int,
        split: str = "train",
        num_image_tokens: int = 16,
        num_audio_tokens: int = 4,
        image_shape: Sequence[int] = (1, 8, 8),
        audio_shape: Sequence[int] = (129, 16),
        modalities: Sequence[str] = MODALITIES,
    ) -> None:
        self.tokenizer = tokenizer if isinstance(tokenizer, CharTokenizer) else None
        self.vocab_size = tokenizer.vocab_size if self.tokenizer else int(tokenizer)
        self._first_id = 3 + len(MODALITIES)  # pad, bos, eos, placeholders
        if self.vocab_size <= self._first_id:
            raise ValueError(
                f"vocab_size={self.vocab_size!r} is invalid: expected > {self._first_id} "
                "(specials and placeholders come first)"
            )
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is invalid: expected one of {SPLITS}")
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r} is invalid: expected an integer >= 1")
        if any(m not in MODALITIES for m in modalities):
            raise ValueError(
                f"modalities={list(modalities)!r} is invalid: expected items of {MODALITIES}"
            )
        self.seq_length = seq_length
        self.seed = seed
        self.split = split
        self.num_samples = num_samples
        self.image_shape = tuple(image_shape)
        self.audio_shape = tuple(audio_shape)
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.num_image_tokens = num_image_tokens
        self.num_audio_tokens = num_audio_tokens
        self._kind_map = modality_kind_map(self.modalities)
        self.kinds = tuple(k for k in KINDS if k in set(self._kind_map.values()))
        self._placeholders = {
            "image": [3] * num_image_tokens if "image" in self.modalities else [],
            "audio": [4] * num_audio_tokens if "audio" in self.modalities else [],
        }
        longest_prompt = max(len(self._prompt_head(kind)) for kind in self.kinds)
        # The shortest possible sample: the prompt, one answer token and <eos>.
        if longest_prompt + 2 > seq_length:
            raise ValueError(
                f"data.seq_length={seq_length} is too small: mock samples need at least "
                f"{longest_prompt + 2} tokens ({longest_prompt} prompt + answer + <eos>)"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return f"MockTask(split={self.split!r}, len={len(self)}, kinds={self.kinds})"

    def stream(self, seed: int, shuffle: bool = True) -> SampleStream:
        """The endless, layout-independent order of this task's samples for ``seed``."""
        return SampleStream(self, seed, shuffle)

    def _prompt_head(self, kind: str) -> list[int]:
        """``<bos>`` and the placeholders of a sample of ``kind``."""
        head = [self.bos_id]
        if kind in ("image", "both"):
            head += self._placeholders["image"]
        if kind in ("audio", "both"):
            head += self._placeholders["audio"]
        return head

    def get(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` of epoch ``epoch`` (format in :mod:`mimotron.data.collate`).

        Args:
            index: ``0 <= index < len(self)``.
            epoch: pass over the data (ignored for validation).

        Returns:
            The sample dict.
        """
        if not 0 <= index < len(self):
            raise ValueError(f"index={index!r} is invalid: expected 0 <= index < {len(self)}")
        if epoch < 0:
            raise ValueError(f"epoch={epoch!r} is invalid: expected an integer >= 0")
        epoch = epoch if self.split == "train" else 0
        rng = sample_rng(self.seed, _MOCK_SALT, SPLITS.index(self.split), epoch, index)
        kind = self._kind_map[KINDS[int(rng.integers(len(KINDS)))]]
        prompt = self._prompt_head(kind)
        room = self.seq_length - len(prompt) - 1  # tokens left for question + answer
        num_answer = int(rng.integers(1, min(_MAX_ANSWER_TOKENS, room) + 1))
        num_question = int(rng.integers(0, min(_MAX_QUESTION_TOKENS, room - num_answer) + 1))
        question = rng.integers(self._first_id, self.vocab_size, size=num_question).tolist()
        answer = rng.integers(self._first_id, self.vocab_size, size=num_answer).tolist()
        sample: dict[str, Any] = build_text_sample(
            prompt + question, answer, self.eos_id, self.pad_id, self.seq_length
        )
        image = audio = None
        if kind in ("image", "both"):
            image = torch.from_numpy(rng.standard_normal(self.image_shape, dtype="float32"))
        if kind in ("audio", "both"):
            audio = torch.from_numpy(rng.standard_normal(self.audio_shape, dtype="float32"))
        text = self.tokenizer.decode(answer) if self.tokenizer else " ".join(map(str, answer))
        sample.update(image=image, audio=audio, answer=text, index=index, kind=kind)
        return sample

    def get_many(self, items: Sequence[tuple[int, int]]) -> list[Sample]:
        """Samples for several ``(index, epoch)`` pairs, in order."""
        return [self.get(index, epoch) for index, epoch in items]
