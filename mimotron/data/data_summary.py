"""What a run trains and validates on, in two lines for the start-up banner.

:func:`summarize_data` reads only what building the data already computed: the split
sizes, and for LLaVA data each checked sample's media and token count
(:class:`~mimotron.data.llava.LlavaRecord`, recorded when the file was checked). No file
is read again, nothing is loaded. The digits and mock tasks draw each sample's kind when
it is loaded, so their summary names the kinds they can draw instead of counting them.

A summary says where each split comes from (``data.path``'s ``train_fraction`` split, or
``data.valid_path``), how many samples hold an image, audio, both or only text, the
longest sample in tokens against ``data.seq_length``, and whether packing is on::

    data: llava, train 40 samples (d/train.jsonl), validation 12 (d/val.jsonl); packing off
    data: train image 10, audio 7, both 18, text only 5; validation image 2, audio 2,
    both 6, text only 2; longest sample 64 of 96 tokens (data.seq_length)

(the second line is one line on the console).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from mimotron.config.schema import MimoConfig

# Sample kinds in the order they are shown (``text``: no media at all).
KIND_ORDER = ("image", "audio", "both", "text")
_KIND_LABELS = {"image": "image", "audio": "audio", "both": "both", "text": "text only"}


@dataclass(frozen=True)
class SplitSummary:
    """One split: its size, where it comes from, its kinds and its longest sample.

    Attributes:
        num_samples: samples in the split.
        source: where they come from (``"80% of data.jsonl"``, ``"valid.jsonl"``,
            ``"synthetic"``).
        kinds: samples per kind (``image``/``audio``/``both``/``text``); ``None`` when
            kinds are drawn per sample when loaded (digits, mock).
        longest: tokens of the longest sample, placeholders included (``None``: unknown).
        num_skipped: bad samples its file had left out (``data.skip_bad_samples``).
    """

    num_samples: int
    source: str
    kinds: dict[str, int] | None
    longest: int | None
    num_skipped: int = 0


@dataclass(frozen=True)
class DataSummary:
    """The run's data at a glance (:func:`summarize_data`; shown by the banner).

    Attributes:
        dataset: ``data.dataset``.
        train: the training split.
        validation: the validation split.
        seq_length: ``data.seq_length``.
        packing: ``data.packing``.
        drawn_kinds: the kinds a synthetic task draws (empty for LLaVA data).
    """

    dataset: str
    train: SplitSummary
    validation: SplitSummary
    seq_length: int
    packing: bool
    drawn_kinds: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """The banner's ``data:`` lines (see the module docstring)."""
        splits = (("train", self.train), ("validation", self.validation))
        sizes = ", ".join(f"{name} {s.num_samples}{' samples' if name == 'train' else ''} "
                          f"({s.source}{_skipped(s)})" for name, s in splits)
        first = f"data: {self.dataset}, {sizes}; packing {'on' if self.packing else 'off'}"
        parts = []
        if self.drawn_kinds:
            kinds = ", ".join(_KIND_LABELS[k] for k in self.drawn_kinds)
            parts.append(f"kinds drawn per sample: {kinds}")
        for name, s in splits:
            if s.kinds is not None:
                counts = ", ".join(f"{_KIND_LABELS[k]} {s.kinds[k]}" for k in KIND_ORDER
                                   if s.kinds.get(k))
                parts.append(f"{name} {counts}")
        longest = [s.longest for _, s in splits if s.longest is not None]
        if longest:
            parts.append(f"longest sample {max(longest)} of {self.seq_length} tokens "
                         "(data.seq_length)")
        return [first, "data: " + "; ".join(parts)] if parts else [first]


def _skipped(split: SplitSummary) -> str:
    return f", {split.num_skipped} bad skipped" if split.num_skipped else ""


def summarize_data(cfg: MimoConfig, train_task: Any, valid_task: Any) -> DataSummary:
    """The summary of the tasks ``build_datasets`` returned (nothing is read or loaded).

    Args:
        cfg: the run config (``data``).
        train_task: the training task.
        valid_task: the validation task.

    Returns:
        The summary; for LLaVA data with counts per kind, from the checked records.
    """
    d = cfg.data
    if d.dataset == "llava":
        shared = valid_task.dataset is train_task.dataset  # a train_fraction split
        shares = (d.train_fraction, 1.0 - d.train_fraction) if shared else (None, None)
        train, valid = (_llava_split(task, share) for task, share in
                        zip((train_task, valid_task), shares, strict=True))  # fmt: skip
        if shared:  # one file: its bad samples are said once
            valid = SplitSummary(valid.num_samples, valid.source, valid.kinds, valid.longest)
        return DataSummary(d.dataset, train, valid, d.seq_length, d.packing)
    source = "synthetic" if d.dataset == "digits" else "random"
    train, valid = (SplitSummary(len(task), source, None,
                                 getattr(task, "max_sample_length", None))
                    for task in (train_task, valid_task))  # fmt: skip
    kinds = tuple(k for k in KIND_ORDER if k in getattr(train_task, "kinds", KIND_ORDER))
    return DataSummary(d.dataset, train, valid, d.seq_length, d.packing, kinds)


def _llava_split(task: Any, share: float | None) -> SplitSummary:
    """One LLaVA split from its index: kinds by the media each sample holds."""
    data, indices = task.dataset, task.indices  # the index's arrays: no file is read
    kinds: Counter[str] = Counter()
    for has_image, has_audio in zip(data.has_image[indices], data.has_audio[indices],
                                    strict=True):  # fmt: skip
        kinds[_kind(bool(has_image), bool(has_audio))] += 1
    longest = int(data.lengths[indices].max()) if len(indices) else 0
    path = str(task.dataset.path)
    source = path if share is None else f"{100 * share:.0f}% of {path}"
    return SplitSummary(len(task), source, dict(kinds), longest or None,
                        task.dataset.num_skipped)


def _kind(has_image: bool, has_audio: bool) -> str:
    if has_image and has_audio:
        return "both"
    return "image" if has_image else "audio" if has_audio else "text"
