"""Export a checkpoint as one ``transformers`` LLaVA folder: ``export --format hf-llava``.

A run with a CLIP or SigLIP vision tower and a Llama-family decoder loaded from Hugging
Face folders (``modules.<m>.hf_path``) and trained on LLaVA data becomes ``OUT_DIR``, a
folder that ``AutoModelForImageTextToText.from_pretrained`` loads as
``LlavaForConditionalGeneration`` and ``AutoProcessor.from_pretrained`` as a
``LlavaProcessor``, computing what mimotron's model computes:

- ``model.safetensors``, in the layout of the ``llava-hf`` checkpoints (which every
  ``transformers`` version with LLaVA loads): ``vision_tower.vision_model.*`` (the vision
  folder's whole tower, the trained tensors in place, its untrained later layers as they
  were), ``multi_modal_projector.linear_1`` / ``linear_2`` (mimotron's projector: both
  are Linear -> exact GELU -> Linear), ``language_model.model.*`` and
  ``language_model.lm_head.weight`` (not written when tied). Every tensor keeps the dtype
  its folder stored it in; the projector takes the language model's.
- ``config.json``: a ``LlavaConfig`` holding the vision folder's tower config and the
  language folder's config (``vocab_size``: the trained vocabulary, placeholders in,
  padding out), ``image_token_index`` = mimotron's ``<image>`` placeholder id,
  ``image_seq_length`` = the vision module's tokens per image, and mimotron's
  ``vision_feature_layer`` and ``vision_feature_select_strategy``.
- the processor: the vision folder's image preprocessing (the settings training read
  from its ``preprocessor_config.json``), the run's tokenizer with its placeholders and
  chat template, ``patch_size`` and ``num_additional_image_tokens`` (1 for CLIP's class
  token, 0 for SigLIP), so that one ``<image>`` in a prompt becomes as many image tokens
  as training put there.
- the language folder's ``generation_config.json``; ``mimotron_config.json`` (the run
  config).

A LLaVA folder holds one vision tower and the language model. A run with other modules
(an audio encoder) is refused unless ``modules`` names the ones to keep: the others are
left out (their placeholder keeps its id and row in the vocabulary). ``OUT_DIR`` follows
:mod:`~mimotron.checkpoint.export_folder`.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import read_full_model, split_by_module
from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.hf_export import (
    CONFIG_FILE,
    RUN_CONFIG_FILE,
    TOWER_PREFIX,
    check_hf_folder,
    family_of,
    hf_module_weights,
    hf_paths,
    run_tokenizer,
    set_file_modes,
)
from mimotron.checkpoint.lora_merge import merge_adapters
from mimotron.checkpoint.state import VOCAB_SIZE_UNPADDED
from mimotron.checkpoint.vlm_export import vlm_folder
from mimotron.config.hf_folder import SINGLE_FILE, read_hf_config, tensor_files
from mimotron.models.hf.llama import LLAMA_WEIGHTS
from mimotron.names import LANGUAGE

FORMAT = "hf-llava"
GENERATION_CONFIG = "generation_config.json"
# Where each part sits in a llava-hf checkpoint.
VISION_PREFIX, PROJECTOR_PREFIX = "vision_tower.vision_model.", "multi_modal_projector."
LANGUAGE_PREFIX = "language_model."
# mimotron's projector (ModalitySubmodule.projector) -> LlavaMultiModalProjector.
_PROJECTOR = {"projector.fc1.": "linear_1.", "projector.fc2.": "linear_2."}
_FULL_MODEL_TYPES = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}


@dataclass(frozen=True)
class LlavaParts:
    """The two modules of a run that become a LLaVA folder, from its recorded config.

    Attributes:
        vision: the vision module's name (kind ``vit``).
        vision_path: its ``hf_path``.
        feature_layer: its ``vision_feature_layer``.
        strategy: its ``vision_feature_select_strategy``.
        language_path: the language module's ``hf_path``.
    """

    vision: str
    vision_path: Path
    feature_layer: int
    strategy: str
    language_path: Path


def llava_parts(run_config: Mapping[str, Any], modules: Sequence[str] | None = None
                ) -> LlavaParts:
    """Which modules of a run a LLaVA folder holds (rules in the module docstring).

    Args:
        run_config: the run config the checkpoint records.
        modules: the modules to export (``--modules``); ``None``: every module of the run.

    Raises:
        ValueError: one line naming the module in the way and what to pass instead.
    """
    recorded = {n: m for n, m in (run_config.get("modules") or {}).items()
                if isinstance(m, Mapping)}
    wanted = list(recorded) if modules is None else list(modules)
    unknown = [m for m in wanted if m not in recorded]
    if unknown:
        raise ValueError(f"--modules names {unknown[0]!r}, which this run does not have; "
                         f"expected names from {sorted(recorded)}")
    vits = [n for n in wanted if recorded[n].get("kind") == "vit"]
    keep = f"{vits[0] if vits else '<vision module>'},{LANGUAGE}"
    others = [n for n in wanted if n != LANGUAGE and n not in vits]
    if others:
        raise ValueError(f"export --format {FORMAT}: module {others[0]!r} (kind "
                         f"{recorded[others[0]].get('kind')!r}) has no place in a LLaVA folder "
                         f"(one vision tower and the language model); pass --modules {keep} "
                         "to leave it out")
    if LANGUAGE not in wanted or len(vits) != 1:
        raise ValueError(f"export --format {FORMAT} needs one vit module and {LANGUAGE!r}; "
                         f"got {sorted(wanted)}: pass --modules {keep}")
    paths = hf_paths(run_config)
    for name in (vits[0], LANGUAGE):
        if name not in paths:
            raise ValueError(f"modules.{name} has no hf_path: export --format {FORMAT} needs "
                             "the vision tower and the language model loaded from Hugging Face "
                             "folders; use --format mimotron")
    vision = recorded[vits[0]]
    return LlavaParts(
        vision=vits[0], vision_path=Path(paths[vits[0]]),
        feature_layer=int(vision.get("vision_feature_layer", -2)),
        strategy=str(vision.get("vision_feature_select_strategy", "default")),
        language_path=Path(paths[LANGUAGE]))


def export_llava_checkpoint(checkpoint: str | Path, out_dir: str | Path,
                            modules: Sequence[str] | None = None) -> dict[str, Path]:
    """Write a checkpoint as one LLaVA folder (see the module docstring).

    Everything that can be checked without tensors is checked before any is read: the
    output folder, the modules, the recorded folders and the tokenizer.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        out_dir: the output folder (created): new, empty, or a previous export's own.
        modules: the modules to export (one ``vit`` and ``language``); ``None``: all of
            the run's, which must then be exactly those.

    Returns:
        ``{"llava": OUT_DIR, "run config": OUT_DIR/mimotron_config.json}``.

    Raises:
        ValueError: not a checkpoint path, an output folder export may not write, a run
            a LLaVA folder cannot hold (names the module and what to pass), a recorded
            folder that is gone or unusable, or a projector LLaVA cannot express.
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    folder = ExportFolder(out_dir)
    found: dict[str, Any] = {}

    def check(meta: dict[str, Any]) -> None:
        found["parts"], found["tokenizer"] = _check_run(meta["config"], modules, folder)

    tensors, meta = read_full_model(checkpoint, check_meta=check)
    tensors = merge_adapters(tensors, meta["config"])  # the adapted model, as plain weights
    parts, tokenizer = found["parts"], found["tokenizer"]
    state = split_by_module(tensors)
    weights, text_config = _language_weights(state[LANGUAGE], parts, tokenizer,
                                             meta.get(VOCAB_SIZE_UNPADDED))
    tower, projector = _vision_weights(state[parts.vision], parts, text_config)
    dtype = weights[LANGUAGE_PREFIX + "model.embed_tokens.weight"].dtype
    weights.update({n: t.to(dtype).contiguous() for n, t in projector.items()})
    weights.update(tower)
    config = _llava_config(parts, text_config, tokenizer)
    written = _write_folder(folder, parts, config, tokenizer)
    written.append(folder.file(SINGLE_FILE))
    save_file(weights, str(written[-1]), metadata={
        "format": "pt", "iteration": str(meta["iteration"]), "mimotron_export": FORMAT})
    written.append(folder.file(RUN_CONFIG_FILE))
    written[-1].write_text(json.dumps(meta["config"], indent=1) + "\n")
    set_file_modes(written)
    folder.finish()
    return {"llava": folder.root, "run config": written[-1]}


def _check_run(run: Mapping[str, Any], modules: Sequence[str] | None, folder: ExportFolder
               ) -> tuple[LlavaParts, Any]:
    """What can be checked before any tensor is read; the parts and the run's tokenizer.

    Raises:
        ValueError: as :func:`export_llava_checkpoint`.
    """
    parts = llava_parts(run, modules)
    folder.check(run)
    if vlm_folder(run) is not None:  # a part of a VLM folder without the other: raises
        raise ValueError(f"modules.{parts.vision}.hf_path={str(parts.vision_path)!r} is one "
                         "vision-language folder: export the run with --format hf, which writes "
                         "one folder of its class")
    for name, path in ((parts.vision, parts.vision_path), (LANGUAGE, parts.language_path)):
        config = read_hf_config(check_hf_folder(path, name))
        family = family_of(config, f"modules.{name}.hf_path={str(path)!r}")
        if family.name not in (("llama",) if name == LANGUAGE else ("clip", "siglip")):
            raise ValueError(f"modules.{name}.hf_path={str(path)!r} holds a {family.name} "
                             "model; a LLaVA folder needs a CLIP or SigLIP tower and a "
                             "Llama-family decoder")
    tokenizer = run_tokenizer(run)
    if tokenizer is None or "image" not in tokenizer.modalities:
        raise ValueError(f"export --format {FORMAT} needs the run's Hugging Face tokenizer "
                         "(data.tokenizer) with its <image> placeholder")
    return parts, tokenizer


def _language_weights(
    state: dict[str, torch.Tensor], parts: LlavaParts, tokenizer: Any, vocab: int | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The decoder under ``language_model.`` (its folder's names), and its config."""
    weights, config = hf_module_weights(state, parts.language_path, module=LANGUAGE,
                                        vocab_size=vocab, tokenizer=tokenizer)
    # Stored RoPE frequencies of older conversions are not weights: transformers skips them.
    return ({LANGUAGE_PREFIX + n: t for n, t in weights.items()
             if not LLAMA_WEIGHTS.is_ignored(n)}, config)


def _vision_weights(
    state: dict[str, torch.Tensor], parts: LlavaParts, text_config: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(the tower under vision_tower.vision_model., the projector under its LLaVA names)``.

    Raises:
        ValueError: a projector other than vision hidden -> language hidden -> language
            hidden with biases (LLaVA's shape).
    """
    tower = {n[len(TOWER_PREFIX):]: t for n, t in state.items() if n.startswith(TOWER_PREFIX)}
    weights, _ = hf_module_weights(tower, parts.vision_path, module=parts.vision,
                                   vocab_size=None, tokenizer=None)
    family = family_of(read_hf_config(parts.vision_path), f"modules.{parts.vision}.hf_path")
    # A tower folder holds its names at the top or under vision_model. (a full CLIP /
    # SigLIP model, whose text tower stays behind).
    prefix = family.weight_map.choose_prefix(tensor_files(parts.vision_path))
    vision = {VISION_PREFIX + n[len(prefix):]: t for n, t in weights.items()
              if n.startswith(prefix)}
    projector: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        ours = next((o for o in _PROJECTOR if name.startswith(o)), None)
        if ours is not None:
            projector[PROJECTOR_PREFIX + _PROJECTOR[ours] + name[len(ours):]] = tensor
    hidden = int(text_config["hidden_size"])
    inner = projector.get(PROJECTOR_PREFIX + "linear_1.weight")
    if len(projector) != 4 or inner is None or inner.shape[0] != hidden:
        raise ValueError(f"modules.{parts.vision}: LLaVA's projector is Linear(vision hidden, "
                         f"{hidden}) -> GELU -> Linear({hidden}, {hidden}) with biases; this "
                         f"run's is {_shapes(projector)}: train with "
                         f"modules.{parts.vision}.projector_hidden_size = 0 to export it")
    return vision, projector


def _shapes(tensors: Mapping[str, torch.Tensor]) -> str:
    return ", ".join(f"{n.split('.', 1)[1]} {list(t.shape)}" for n, t in sorted(tensors.items()))


def _vision_config(config: dict[str, Any]) -> dict[str, Any]:
    """The tower's own config: a full CLIP / SigLIP model's ``vision_config``."""
    model_type = config.get("model_type")
    if model_type in _FULL_MODEL_TYPES:
        return {**config.get("vision_config", {}), "model_type": _FULL_MODEL_TYPES[model_type]}
    return config


def image_tokens(vision_config: Any, strategy: str) -> tuple[int, int]:
    """``(tokens per image, num_additional_image_tokens)`` as ``LlavaProcessor`` counts.

    The patches, plus CLIP's class token, less one for the ``default`` strategy: what
    mimotron's tower emits (:class:`~mimotron.models.hf.clip.ViTTower`).

    Args:
        vision_config: the tower's ``transformers`` config (its defaults filled in).
        strategy: ``vision_feature_select_strategy``.
    """
    side = int(vision_config.image_size) // int(vision_config.patch_size)
    extra = int(vision_config.model_type == "clip_vision_model")
    return side * side + extra - int(strategy == "default"), extra


def _llava_config(parts: LlavaParts, text_config: dict[str, Any], tokenizer: Any) -> Any:
    """The ``LlavaConfig`` of the folder (transformers builds and checks the sub-configs)."""
    from transformers import LlavaConfig  # Deferred: export only.

    def own(config: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in config.items()
                if k not in ("architectures", "transformers_version")}

    text = own(text_config)
    config = LlavaConfig(
        vision_config=_vision_config(own(read_hf_config(parts.vision_path))), text_config=text,
        image_token_index=tokenizer.placeholder_id("image"), projector_hidden_act="gelu",
        multimodal_projector_bias=True, vision_feature_layer=parts.feature_layer,
        vision_feature_select_strategy=parts.strategy,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)))
    config.image_seq_length = image_tokens(config.vision_config, parts.strategy)[0]
    config.architectures = ["LlavaForConditionalGeneration"]
    dtype = text.get("dtype", text.get("torch_dtype"))
    if dtype is not None:
        config.dtype = dtype
    return config


def _write_folder(folder: ExportFolder, parts: LlavaParts, config: Any, tokenizer: Any
                  ) -> list[Path]:
    """``config.json``, the processor and tokenizer, the generation config; the files."""
    from transformers import AutoImageProcessor, LlavaProcessor  # Deferred: export only.

    written = [folder.file(CONFIG_FILE)]
    config.to_json_file(str(written[0]))
    generation = parts.language_path / GENERATION_CONFIG
    if generation.is_file():
        written.append(folder.file(GENERATION_CONFIG))
        written[-1].write_bytes(generation.read_bytes())
    # The settings training preprocessed with (mimotron.data.media reads the same file).
    images = AutoImageProcessor.from_pretrained(str(parts.vision_path), local_files_only=True)
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer.tokenizer,
        patch_size=int(config.vision_config.patch_size),
        vision_feature_select_strategy=parts.strategy, chat_template=tokenizer.chat_template,
        num_additional_image_tokens=image_tokens(config.vision_config, parts.strategy)[1],
        image_token=tokenizer.placeholder_text("image"))
    # save_pretrained picks its own file names: saved aside, then each one recorded.
    with tempfile.TemporaryDirectory(prefix="mimotron-llava-") as temp:
        processor.save_pretrained(temp)
        for file in sorted(Path(temp).iterdir()):
            if file.is_file():
                written.append(folder.file(file.name))
                written[-1].write_bytes(file.read_bytes())
    return written
