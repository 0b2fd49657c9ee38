"""Data: tokenizer, the digits/DTMF demo task, mock samples, collation and slicing.

Typical use in a training loop (every rank builds the same global batch, then takes its
contiguous DP slice, so the data order never depends on the layout)::

    tokenizer = CharTokenizer()
    train_task, validation_task = build_datasets(cfg, tokenizer)
    stream = SampleStream(train_task, cfg.train.seed)
    samples = stream.samples(consumed_samples, cfg.train.global_batch_size)
    batch = collate(samples, train_task.seq_length, train_task.pad_id,
                    train_task.image_shape, train_task.audio_shape)
    for micro_batch in split_microbatches(batch, cfg.train.micro_batch_size): ...

**Modalities without an encoder.** A task only produces the modalities that have an
encoder module in the config (``kind = "vit"`` for images, ``"audio"`` for tones), with
as many placeholder tokens as that module emits (``num_output_tokens``). A sample kind
that needs a missing encoder keeps the modalities that exist and drops the others:
without an audio encoder ``audio`` and ``both`` samples become ``image`` samples,
without a vision encoder ``image`` and ``both`` become ``audio``, and with neither every
sample is a text-only sum (see :func:`~mimotron.data.digits.modality_kind_map`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mimotron.config.hf_folder import read_hf_config
from mimotron.config.schema import MimoConfig
from mimotron.data.collate import (
    Batch,
    Sample,
    batch_size,
    build_text_sample,
    collate,
    slice_batch,
    split_microbatches,
)
from mimotron.data.digits import (
    DigitsTask,
    SampleStream,
    Task,
    load_digit_images,
    modality_kind_map,
    split_ids,
)
from mimotron.data.dtmf import (
    NUM_FRAMES,
    NUM_FREQ_BINS,
    dtmf_frequencies,
    dtmf_tone,
    dtmf_tones,
    spectrogram,
)
from mimotron.data.mock import MockTask
from mimotron.data.mrope_positions import MRopeRule
from mimotron.data.native_mock import NativeMockTask
from mimotron.data.tokenizer import NUMBER_WORDS, CharTokenizer, number_to_words

__all__ = [
    "NUMBER_WORDS",
    "NUM_FRAMES",
    "NUM_FREQ_BINS",
    "Batch",
    "CharTokenizer",
    "DigitsTask",
    "MockTask",
    "Sample",
    "SampleStream",
    "Task",
    "batch_size",
    "build_datasets",
    "build_text_sample",
    "collate",
    "dtmf_frequencies",
    "dtmf_tone",
    "dtmf_tones",
    "encoder_inputs",
    "load_digit_images",
    "modality_kind_map",
    "number_to_words",
    "slice_batch",
    "spectrogram",
    "split_ids",
    "split_microbatches",
]


def encoder_inputs(cfg: MimoConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Modalities that have an encoder module: ``{modality: (placeholders, input shape)}``.

    Args:
        cfg: the run config.

    Returns:
        E.g. ``{"image": (16, (1, 8, 8)), "audio": (4, (129, 16))}``; a modality without
        an encoder module is absent.
    """
    inputs: dict[str, tuple[int, tuple[int, ...]]] = {}
    for module in cfg.modules.values():
        if module.kind == "vit":
            shape = (module.in_channels, module.image_size, module.image_size)
            inputs["image"] = (module.num_output_tokens, shape)
        elif module.kind == "audio":
            inputs["audio"] = (module.num_output_tokens, (module.num_freq_bins, module.num_frames))
    return inputs


def _check_digits_shapes(cfg: MimoConfig, inputs: dict[str, tuple[int, tuple[int, ...]]]) -> None:
    """The digits task has fixed input shapes; an encoder built for others cannot read it."""
    expected = {"image": (1, 8, 8), "audio": (NUM_FREQ_BINS, NUM_FRAMES)}
    keys = {"image": "in_channels, image_size", "audio": "num_freq_bins, num_frames"}
    for name, module in cfg.modules.items():
        modality = module.modality
        if modality in inputs and inputs[modality][1] != expected[modality]:
            raise ValueError(
                f"modules.{name} ({keys[modality]}) expects {modality} inputs of shape "
                f"{inputs[modality][1]}: data.dataset='digits' provides {expected[modality]}"
            )


def _digits_tasks(
    cfg: MimoConfig, tokenizer: CharTokenizer, inputs: dict[str, tuple[int, tuple[int, ...]]]
) -> tuple[DigitsTask, DigitsTask]:
    """Train and validation digits tasks for the configured encoders."""
    _check_digits_shapes(cfg, inputs)
    data = cfg.data
    # A count for a missing modality is never used (its samples are remapped); 1 is valid.
    counts = {m: inputs[m][0] if m in inputs else 1 for m in ("image", "audio")}
    train, validation = (
        DigitsTask(
            tokenizer, data.seq_length, cfg.train.seed, split, data.train_fraction,
            data.p_image, data.p_audio, data.p_both, data.p_text, data.image_shift,
            num_image_tokens=counts["image"], num_audio_tokens=counts["audio"],
            modalities=tuple(inputs),
        )  # fmt: skip
        for split in ("train", "validation")
    )
    return train, validation


def _mock_tasks(
    cfg: MimoConfig, tokenizer: CharTokenizer, inputs: dict[str, tuple[int, tuple[int, ...]]]
) -> tuple[MockTask, MockTask]:
    """Train and validation mock tasks: ``mock_num_samples`` split by ``train_fraction``."""
    data = cfg.data
    if data.mock_num_samples < 2:
        raise ValueError(
            f"data.mock_num_samples={data.mock_num_samples!r} is invalid: expected an "
            "integer >= 2 (both splits need a sample)"
        )
    # The same fraction rule as the digits split, keeping both splits non-empty.
    num_train = min(max(round(data.train_fraction * data.mock_num_samples), 1),
                    data.mock_num_samples - 1)  # fmt: skip
    sizes = {"train": num_train, "validation": data.mock_num_samples - num_train}
    native = [m for m in cfg.modules.values() if m.hf_native is not None]
    if native:
        return _native_mock_tasks(cfg, tokenizer, native[0], sizes)
    counts = {m: inputs[m][0] if m in inputs else 1 for m in ("image", "audio")}
    train, validation = (
        MockTask(
            tokenizer, data.seq_length, cfg.train.seed, sizes[split], split,
            num_image_tokens=counts["image"], num_audio_tokens=counts["audio"],
            image_shape=inputs.get("image", (0, (1, 8, 8)))[1],
            audio_shape=inputs.get("audio", (0, (NUM_FREQ_BINS, NUM_FRAMES)))[1],
            modalities=tuple(inputs),
        )  # fmt: skip
        for split in ("train", "validation")
    )
    return train, validation


def _native_mock_tasks(cfg: MimoConfig, tokenizer: CharTokenizer, vision: Any,
                       sizes: dict[str, int]) -> tuple[NativeMockTask, NativeMockTask]:
    """Mock tasks for a native-resolution vision module (images of random sizes)."""
    if len(cfg.encoder_names) != 1:
        raise ValueError(f"data.dataset='mock' with a {vision.hf_native.model_type} folder "
                         f"takes its vision module alone; the config has encoders "
                         f"{cfg.encoder_names}")
    image_id = tokenizer.placeholder_id("image")
    rule = dataclasses.replace(MRopeRule.from_hf_config(read_hf_config(vision.hf_path)),
                               image_token_id=image_id)
    train, validation = (
        NativeMockTask(tokenizer.vocab_size, image_id, vision.hf_native, rule,
                       cfg.data.seq_length, cfg.train.seed, sizes[split], split)
        for split in ("train", "validation"))
    return train, validation


def build_datasets(cfg: MimoConfig, tokenizer: Any) -> tuple[Any, Any]:
    """Train and validation tasks for ``cfg.data.dataset`` (``digits``, ``mock``, ``llava``).

    Placeholder counts and input shapes come from the configured encoder modules; a
    modality without an encoder is never produced (rule in the module docstring). Each
    task has ``seq_length``, ``pad_id``, ``image_shape`` and ``audio_shape`` attributes,
    the arguments :func:`collate` needs.

    Args:
        cfg: the run config (``data``, ``train.seed`` and ``modules`` are used).
        tokenizer: the tokenizer shared with the model: a ``CharTokenizer`` for
            ``digits`` / ``mock``, an ``HFTokenizer`` for ``llava``
            (:func:`~mimotron.data.run_data.build_tokenizer` builds the right one).

    Returns:
        ``(train_task, validation_task)``.

    Raises:
        ValueError: unknown dataset, encoder shapes the digits task cannot provide, a
            ``data.seq_length`` too small for the longest sample, or (llava) a bad
            sample, naming its id and line.
    """
    if cfg.data.dataset == "llava":
        # Here, not at the top: the package's own modules import it (run_data, llava), and
        # the synthetic datasets never load transformers' tokenizers.
        from mimotron.data.hf_tokenizer import HFTokenizer
        from mimotron.data.run_data import build_llava_tasks

        if not isinstance(tokenizer, HFTokenizer):
            raise ValueError("data.dataset='llava' needs the Hugging Face tokenizer of "
                             "data.tokenizer (run_data.build_tokenizer), not "
                             f"{type(tokenizer).__name__}")
        return build_llava_tasks(cfg, tokenizer)
    inputs = encoder_inputs(cfg)
    if cfg.data.dataset == "digits":
        return _digits_tasks(cfg, tokenizer, inputs)
    if cfg.data.dataset == "mock":
        return _mock_tasks(cfg, tokenizer, inputs)
    raise ValueError(
        f"data.dataset={cfg.data.dataset!r} is invalid: expected 'digits', 'mock' or 'llava'"
    )
