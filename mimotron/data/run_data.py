"""The run's tokenizer and LLaVA data, built from the config (``data.dataset = "llava"``).

**Tokenizer.** The synthetic datasets (``digits``, ``mock``) use the character tokenizer;
``llava`` loads the Hugging Face tokenizer folder ``data.tokenizer``
(:class:`~mimotron.data.hf_tokenizer.HFTokenizer`) with one placeholder per modality the
configured encoders consume. Unset, ``data.tokenizer`` is the language model's folder
(``modules.language.hf_path``; filled in when the config is loaded).

**Validation data** is the ``data.train_fraction`` split of ``data.path``, or, with
``data.valid_path``, that whole file (checked by the same rules; media relative to
``data.root``, or to the file's own folder when ``data.root`` is empty) while
``data.path`` trains in full.

**Placeholders per sample** are each encoder's ``num_output_tokens`` (what the model
scatters into the placeholder positions), as for the synthetic datasets.

**Native-resolution images** (a Qwen2.5-VL / Qwen3-VL folder's vision module,
``modules.<m>.hf_native``): the image placeholder is the folder's own ``<|image_pad|>``
(its ``config.json`` ``image_token_id``; no token is added), each ``<image>`` of the data
becomes ``<|vision_start|>``, the image's own count of ``<|image_pad|>``, ``<|vision_end|>``,
and the images are the folder's processor's patches with the run's ``max_pixels``
(:mod:`mimotron.data.native_llava`). Such a run also reads the samples' videos (``video``,
``videos``; files decoded with PyAV or folders of frames): each is one more item of the
vision module, sampled and sized by the folder's video rules
(:mod:`mimotron.data.native_video`).

**Preprocessing.** An encoder module loaded from a Hugging Face folder
(``modules.<m>.hf_path``) preprocesses with that folder's ``preprocessor_config.json``
(CLIP / SigLIP image processor, Whisper feature extractor). A toy encoder gets
parameters derived from its own sizes: a ``vit`` reads RGB images resized to
``image_size`` squared and normalised with mean = std = 0.5 (no crop); an ``audio``
encoder reads 16 kHz WAV clips of 1 s as Whisper log-mel features with ``num_freq_bins``
mel bins and ``num_frames`` frames.

**Checked before any collective, once per run.** :func:`build_llava_tasks` checks every
sample (:class:`~mimotron.data.llava.LlavaDataset`) into an index kept in
``data.index_dir`` (default ``<log.dir>/data_index``; :mod:`mimotron.data.sample_index`),
on all the cores this process may use: ``mimotron train`` and ``mimotron plan`` call
:func:`check_data` before launching anything, so the ranks find the index; under another
launcher rank 0 builds it while the others wait. ``setup_mimo`` builds the data before
its first collective.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mimotron.config.hf_folder import check_hf_weight_files
from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.config.validation import TOY_AUDIO_RATE
from mimotron.config.vocab_size import VOCAB_MULTIPLE, model_vocab_size
from mimotron.data.chat_templates import check_template_tokens, resolve_chat_template
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava import LlavaDataset, LlavaTask, llava_tasks
from mimotron.data.media import AudioFeatures, ImageProcessor
from mimotron.data.media_policy import media_policy
from mimotron.data.native_llava import NativeLlava, native_image_id
from mimotron.data.sample_index import default_processes
from mimotron.data.tokenizer import MODALITIES, CharTokenizer
from mimotron.data.vocab_check import vocabulary_check
from mimotron.names import LANGUAGE

if TYPE_CHECKING:  # an annotation only: the layout is built above the data
    from mimotron.parallel.layout import Layout

# Toy vision preprocessing: a plain square resize, normalised to [-1, 1] (SigLIP's rule).
_TOY_MEAN_STD = (0.5, 0.5, 0.5)


def encoder_modalities(cfg: MimoConfig) -> dict[str, str]:
    """``{modality: encoder module name}`` of the configured encoders."""
    return {m.modality: name for name, m in cfg.modules.items()
            if m.is_encoder and m.modality is not None}  # fmt: skip


def native_image_module(cfg: MimoConfig) -> str | None:
    """The name of the native-resolution vision module (``hf_native``), or ``None``."""
    names = [n for n, m in cfg.modules.items()
             if m.hf_native is not None and m.modality == "image"]  # fmt: skip
    return names[0] if names else None


def native_placeholder_ids(cfg: MimoConfig) -> dict[str, int]:
    """``{"image": image_token_id}`` of a native-resolution vision module's folder, else
    ``{}``: the placeholder ids :func:`run_hf_tokenizer` takes from the model."""
    name = native_image_module(cfg)
    return {} if name is None else {"image": native_image_id(cfg.modules[name].hf_path)}


def run_hf_tokenizer(path: str | Path, kinds: Iterable[str | None],
                     chat_template: str = "", placeholder_ids: Mapping[str, int] | None = None
                     ) -> HFTokenizer:  # fmt: skip
    """The run's Hugging Face tokenizer: one placeholder per encoder modality.

    Training (:func:`build_tokenizer`), ``mimotron export --format hf`` and generation
    (from the config a checkpoint records) all build the tokenizer here, so the
    placeholders are added in the same order and get the same ids (one for each modality
    an encoder kind of ``kinds`` consumes, in :data:`~mimotron.data.tokenizer.MODALITIES`
    order), and the chat template is the one training rendered with.

    Args:
        path: the tokenizer folder (``data.tokenizer``).
        kinds: the ``kind`` of every module (``language`` and unknown kinds add nothing).
        chat_template: ``data.chat_template``: ``""`` keeps the folder's template, else a
            built-in name or a ``.jinja`` file replaces it
            (:func:`~mimotron.data.chat_templates.resolve_chat_template`).
        placeholder_ids: modality -> the model's own placeholder id, a special token the
            tokenizer has (:func:`native_placeholder_ids`: a Qwen-VL folder's
            ``<|image_pad|>``); other modalities get ``<image>`` / ``<audio>``.

    Raises:
        ValueError: the tokenizer folder is missing or unusable (see ``HFTokenizer``), or
            the chat template is unknown, missing or needs tokens the tokenizer lacks.
    """
    present = {ModuleConfig(kind=kind).modality for kind in kinds}  # type: ignore[arg-type]
    template = resolve_chat_template(chat_template)
    tokenizer = HFTokenizer(path, modalities=[m for m in MODALITIES if m in present],
                            chat_template=template.source if template else None,
                            chat_template_origin=template.origin if template else "",
                            placeholder_ids=placeholder_ids)
    if template is not None:
        check_template_tokens(template, tokenizer)
    return tokenizer


def build_tokenizer(cfg: MimoConfig) -> CharTokenizer | HFTokenizer:
    """The run's tokenizer: characters for the synthetic datasets, ``data.tokenizer`` for llava.

    Raises:
        ValueError: the tokenizer folder is missing or unusable (see ``HFTokenizer``), or
            its vocabulary dwarfs the model (:func:`~mimotron.data.vocab_check.vocabulary_check`).
    """
    if cfg.data.dataset != "llava":
        return CharTokenizer()
    try:
        tokenizer = run_hf_tokenizer(cfg.data.tokenizer, [m.kind for m in cfg.modules.values()],
                                     cfg.data.chat_template, native_placeholder_ids(cfg))
    except ValueError as exc:
        # The hint below is about the folder: not for an error of data.chat_template's.
        if cfg.data.tokenizer != cfg.modules[LANGUAGE].hf_path or (
                "data.chat_template=" in str(exc)):
            raise
        # The folder may be a model without a tokenizer: say where the path came from.
        raise ValueError(f"{exc} (data.tokenizer is modules.language.hf_path's folder, its "
                         "default: set data.tokenizer to the tokenizer's folder)") from None
    vocabulary_check(cfg, tokenizer.vocab_size)  # before a model is sized from it
    return tokenizer


def image_processor(cfg: MimoConfig, module: str) -> ImageProcessor:
    """The preprocessing of encoder ``module``'s images (rule in the module docstring)."""
    m = cfg.modules[module]
    hf_path = getattr(m, "hf_path", "")  # Hugging Face modules only.
    if hf_path:
        return ImageProcessor.from_pretrained(hf_path)
    size = (("height", m.image_size), ("width", m.image_size))
    return ImageProcessor(size=size, crop_size=size, do_center_crop=False,
                          image_mean=_TOY_MEAN_STD, image_std=_TOY_MEAN_STD)  # fmt: skip


def audio_features(cfg: MimoConfig, module: str) -> AudioFeatures:
    """The log-mel extraction of encoder ``module``'s audio (rule in the module docstring)."""
    m = cfg.modules[module]
    hf_path = getattr(m, "hf_path", "")
    if hf_path:
        return AudioFeatures(hf_path)
    return AudioFeatures(feature_size=m.num_freq_bins, sampling_rate=TOY_AUDIO_RATE,
                         hop_length=TOY_AUDIO_RATE // m.num_frames, chunk_length=1,
                         n_fft=400)  # fmt: skip


def check_input_shapes(cfg: MimoConfig, images: ImageProcessor | None,
                       audio: AudioFeatures | None) -> None:  # fmt: skip
    """Check that the preprocessing gives the inputs the encoders take.

    A Hugging Face folder's ``preprocessor_config.json`` can disagree with its
    ``config.json`` (another crop size, another clip length); the tower would then fail
    on its first batch, on its own ranks only. Found here, before any launch.

    Raises:
        ValueError: names the module, its ``hf_path`` (or the toy keys) and both shapes.
    """
    encoders = encoder_modalities(cfg)
    checks = []
    if images is not None:
        m = cfg.modules[encoders["image"]]
        checks.append((encoders["image"], images.output_shape,
                       (m.in_channels, m.image_size, m.image_size)))  # fmt: skip
    if audio is not None:
        m = cfg.modules[encoders["audio"]]
        checks.append((encoders["audio"], audio.output_shape, (m.num_freq_bins, m.num_frames)))
    for name, got, want in checks:
        if tuple(got) != want:
            hf_path = cfg.modules[name].hf_path
            source = (f"modules.{name}.hf_path={hf_path!r}: preprocessor_config.json"
                      if hf_path else f"modules.{name}'s preprocessing")
            raise ValueError(f"{source} gives inputs of shape {tuple(got)}, but the encoder "
                             f"takes {want}; make the preprocessing produce {want}")


def data_root(cfg: MimoConfig, path: str = "") -> Path:
    """``data.root``, or the folder of ``path`` (default ``data.path``) when it is empty."""
    return Path(cfg.data.root) if cfg.data.root else Path(path or cfg.data.path).parent


def index_dir(cfg: MimoConfig) -> Path:
    """``data.index_dir``, or ``<log.dir>/data_index`` when it is empty."""
    return Path(cfg.data.index_dir) if cfg.data.index_dir else cfg.log_dir / "data_index"


def build_llava_tasks(cfg: MimoConfig, tokenizer: HFTokenizer) -> tuple[LlavaTask, LlavaTask]:
    """Train and validation data: splits of ``data.path``, or it and ``data.valid_path``.

    Args:
        cfg: the run config (``data``, the encoder modules).
        tokenizer: the run's Hugging Face tokenizer (:func:`build_tokenizer`).

    Returns:
        ``(train_task, validation_task)``; ``task.num_skipped`` counts the bad samples
        its file had left out with ``data.skip_bad_samples``.

    Raises:
        ValueError: the first bad sample (file, line or item, sample id, reason) unless
            skipped; no usable sample; an empty split.
    """
    d = cfg.data
    encoders = encoder_modalities(cfg)
    num_tokens = {mod: cfg.modules[name].num_output_tokens for mod, name in encoders.items()}
    native_name = native_image_module(cfg)
    native = None if native_name is None else NativeLlava.from_folder(
        cfg.modules[native_name].hf_path, cfg.modules[native_name].hf_native, tokenizer)
    images = (image_processor(cfg, encoders["image"])
              if "image" in encoders and native is None else None)
    audio = audio_features(cfg, encoders["audio"]) if "audio" in encoders else None
    check_input_shapes(cfg, images, audio)

    def dataset(path: str) -> LlavaDataset:
        return LlavaDataset(path, data_root(cfg, path), tokenizer, d.seq_length, num_tokens,
                            image_processor=images, audio_features=audio,
                            skip_bad_samples=d.skip_bad_samples,
                            system_prompt=d.system_prompt or None,
                            num_workers=d.num_workers,
                            allow_outside_root=d.allow_outside_root,
                            # Checked once per run, kept for the ranks and later runs.
                            index_dir=index_dir(cfg), num_check_processes=default_processes(),
                            wait_timeout_s=cfg.train.pg_timeout_s,
                            ignore_keys=d.ignore_keys,
                            max_images=d.max_images_per_sample, native=native)  # fmt: skip

    if not d.valid_path:
        return llava_tasks(dataset(d.path), d.train_fraction)
    train = dataset(d.path)
    try:
        valid = dataset(d.valid_path)
    except ValueError as exc:
        # The file-level messages name the key data.path; this file is data.valid_path.
        raise ValueError(str(exc).replace("data.path=", "data.valid_path=", 1)) from None
    return (LlavaTask(train, range(len(train)), "train"),
            LlavaTask(valid, range(len(valid)), "validation"))


def restrict_to_rank(task: object, cfg: MimoConfig, layout: Layout, rank: int) -> None:
    """Make a LLaVA task load only what ``rank``'s modules use (other tasks: nothing).

    The language model needs the tokens; an encoder's first pipeline stage needs its
    modality's media (later stages receive activations). A rank holding the vision tower
    alone so never tokenises nor computes log-mels, and a language rank never decodes
    an image: with every module on its own ranks, each sample is decoded once per DP
    replica instead of once per rank. The samples and their order do not change. Into a
    context-parallel language model an encoder's last stage also needs the tokens: it
    sends each CP rank the rows of the placeholders at its positions.
    """
    if not isinstance(task, LlavaTask):
        return
    routes_by_position = cfg.modules[LANGUAGE].parallel.context > 1
    parts: set[str] = set()
    for role in layout.roles(rank):
        module = cfg.modules[role.module]
        if not module.is_encoder:
            parts.add("text")
            continue
        if role.is_first_stage and module.modality in task.dataset.modalities:
            parts.add(str(module.modality))
        if role.is_last_stage and routes_by_position:
            parts.add("text")
    task.dataset.restrict_loading(parts)
    task.parts_at = media_policy(cfg, layout, rank, frozenset(parts))


def check_data(cfg: MimoConfig) -> CharTokenizer | HFTokenizer:
    """Build the tokenizer and check every sample (llava); for the CLI, before any launch.

    Returns:
        The run's tokenizer (its vocabulary sizes the model).

    Raises:
        ValueError: what :func:`build_tokenizer` or :func:`build_llava_tasks` raise.
    """
    check_hf_weight_files(cfg)  # Safetensors headers: one line naming a bad file.
    tokenizer = build_tokenizer(cfg)
    if isinstance(tokenizer, HFTokenizer):
        build_llava_tasks(cfg, tokenizer)  # both files with data.valid_path
    return tokenizer


def check_vocab_split(cfg: MimoConfig) -> None:
    """Raise unless the language model's TP degree divides its padded vocabulary.

    The embedding and the head split the vocabulary over TP
    (:func:`~mimotron.parallel.tensor_parallel.apply_tensor_parallel`). It is padded to
    a multiple of :data:`~mimotron.config.vocab_size.VOCAB_MULTIPLE`, so only a degree that
    does not divide that multiple needs the tokenizer's size (the run's tokenizer is
    built for it: characters, or the ``data.tokenizer`` folder). It is a layout rule
    (:func:`~mimotron.parallel.layout.check_layout` calls it) that needs the data's
    tokenizer, so it lives beside :func:`build_tokenizer`.

    Raises:
        ValueError: naming ``modules.language.parallel.tensor`` and the padded size.
    """
    tp = cfg.modules[LANGUAGE].parallel.tensor
    if VOCAB_MULTIPLE % tp == 0:
        return
    vocab = model_vocab_size(cfg, build_tokenizer(cfg).vocab_size)
    if vocab % tp:
        raise ValueError(
            f"modules.{LANGUAGE}.parallel.tensor={tp} is invalid: it must divide the padded "
            f"vocabulary ({vocab} rows, a multiple of {VOCAB_MULTIPLE}) that the embedding "
            f"and the output head split; use a divisor of {VOCAB_MULTIPLE}"
        )
