"""Export a run of one vision-language folder back as one folder of the same class.

A run whose modules were split from one vision-language folder (``hf_path`` at the top
of the config, :mod:`mimotron.config.hf_vlm`) exports with ``mimotron export --format
hf`` as one folder that ``transformers``' Auto classes load as the class the original
was (``LlavaForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen3VLForConditionalGeneration``), with no missing or unexpected keys:

- ``model.safetensors``: every tensor of the original folder under its original name
  and dtype (its layout kept: LLaVA's hub or ``model.language_model.*``; Qwen-VL's
  ``model.*`` + ``visual.*`` or ``model.language_model.*`` + ``model.visual.*``), the
  trained ones in place: the vision tower, the projector (a Qwen-VL tower's patch
  mergers are the tower's) and the decoder. Tensors the run never built (LLaVA tower
  layers past the feature layer, the final LayerNorm) are the original's. The
  vocabulary tables keep the real vocabulary's rows (padding dropped), and a tied head
  is not written.
- ``config.json``: the original, with the text part's ``vocab_size`` (in
  ``text_config``, or at the top of a Qwen2.5-VL hub config) the trained vocabulary and
  the image token id (LLaVA's ``image_token_index``, Qwen-VL's ``image_token_id``) the
  run tokenizer's image placeholder (both unchanged unless training added tokens; a
  Qwen-VL run's placeholder is the folder's own ``<|image_pad|>``).
- the original's other files (processor, chat template, generation config), the run's
  tokenizer in place of the folder's, and ``mimotron_config.json``;
- the run's other modules (an audio encoder) as ``--format hf`` writes them:
  ``OUT_DIR/<m>/`` for a Hugging Face module, ``OUT_DIR/<m>.safetensors`` otherwise.

Everything that can be checked before tensors are read is (the output folder, the
modules, the recorded folder, the tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import read_full_model, split_by_module
from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.hf_export import (
    CONFIG_FILE,
    EMBED,
    TOWER_PREFIX,
    check_hf_folder,
    check_hf_run,
    copy_files,
    family_of,
    fit_decoder,
    hf_paths,
    is_tokenizer_file,
    merge_into_folder,
    run_tokenizer,
    set_file_modes,
    write_hf_modules,
    write_tokenizer,
)
from mimotron.checkpoint.lora_merge import merge_adapters
from mimotron.checkpoint.state import VOCAB_SIZE_UNPADDED
from mimotron.config.hf_folder import SINGLE_FILE, read_hf_config, tensor_files
from mimotron.config.hf_vlm import is_native_config, is_vlm_config, vlm_part_config
from mimotron.models.hf.clip import CLIP_WEIGHTS, SIGLIP_WEIGHTS
from mimotron.models.hf.llama import LLAMA_WEIGHTS
from mimotron.models.hf.qwen_vl import QWEN_VL_TOWERS
from mimotron.models.hf.vlm_weights import LLAVA_PROJECTOR_WEIGHTS, part_weight_map
from mimotron.models.hf.weights import WeightMap
from mimotron.names import LANGUAGE

__all__ = ["export_hf", "vlm_folder", "write_vlm_folder"]

_PROJECTOR_PREFIX = "projector."


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """``mimotron export --format hf``: the run's one VLM folder (this module), or a
    folder per Hugging Face module
    (:func:`~mimotron.checkpoint.hf_export.export_hf_checkpoint`) for a run of separate
    folders.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        out_dir: the output folder (created): new, empty, or a previous export's own.

    Returns:
        What was written, by label.

    Raises:
        ValueError: as :func:`vlm_folder` and
            :func:`~mimotron.checkpoint.hf_export.export_hf_checkpoint`.
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    target = ExportFolder(out_dir)
    found: dict[str, Any] = {}

    def check(meta: dict[str, Any]) -> None:
        found["vlm"] = vlm_folder(meta["config"])
        if found["vlm"] is None:
            check_hf_run(meta, target, found)
            return
        others = {m: p for m, p in hf_paths(meta["config"]).items()
                  if m not in (LANGUAGE, found["vlm"][1])}
        target.check(meta["config"], subfolders=others)
        for module, path in others.items():
            family_of(read_hf_config(check_hf_folder(path, module)),
                      f"modules.{module}.hf_path={path!r}")
        run_tokenizer(meta["config"])  # a tokenizer that is gone: before any tensor

    tensors, meta = read_full_model(checkpoint, check_meta=check)
    tensors = merge_adapters(tensors, meta["config"])  # the adapted model, as plain weights
    written: dict[str, Path] = {}
    if found["vlm"] is not None:
        written = write_vlm_folder(tensors, meta, target, *found["vlm"])
    skip = () if found["vlm"] is None else (LANGUAGE, found["vlm"][1])
    written.update(write_hf_modules(tensors, meta, target, found, skip=skip))
    target.finish()
    return written


def vlm_folder(run_config: Mapping[str, Any]) -> tuple[Path, str] | None:
    """``(the folder, its vision module)`` of a run split from one VLM folder, else ``None``.

    The run's other modules (an audio encoder) are exported beside it as
    ``--format hf`` writes them.

    Raises:
        ValueError: a module that takes a part of a VLM folder without its other part
            (one line naming the module).
    """
    paths = hf_paths(run_config)
    vlm = {name: path for name, path in paths.items()
           if Path(path).is_dir() and is_vlm_config(read_hf_config(path))}
    if not vlm:
        return None
    modules = run_config.get("modules") or {}
    vision = [n for n in vlm if isinstance(modules.get(n), Mapping)
              and modules[n].get("kind") == "vit"]
    folder = vlm.get(LANGUAGE)
    if folder is None or len(vlm) != 2 or len(vision) != 1 or vlm[vision[0]] != folder:
        name = sorted(vlm)[0]
        raise ValueError(f"export --format hf: modules.{name}.hf_path={vlm[name]!r} is a part "
                         "of a vision-language folder, and only a run holding both its vision "
                         "module and its language model exports as that folder; use "
                         "--format mimotron")
    return check_hf_folder(folder, LANGUAGE), vision[0]


def _placed(weight_map: WeightMap, names: list[str], ours_prefix: str = "") -> WeightMap:
    """``weight_map`` with its folder prefix written into the rules: one map per part,
    so the three parts' maps join into one (prefix ``""``)."""
    prefix = weight_map.choose_prefix(names)
    return WeightMap(
        rules=tuple((ours_prefix + o, prefix + h) for o, h in weight_map.rules),
        reshaped=frozenset(ours_prefix + r for r in weight_map.reshaped),
        stacked=tuple((ours_prefix + o, prefix + h) for o, h in weight_map.stacked))


def joined_weight_map(config: dict[str, Any], names: list[str]) -> WeightMap:
    """One map of the folder's parts: the decoder under its own names, the tower under
    ``encoder.`` and LLaVA's projector under ``projector.`` (a vision module's names; a
    Qwen-VL tower holds its mergers)."""
    if is_native_config(config):
        tower = QWEN_VL_TOWERS[str(config["model_type"])].weight_map
        projector = ()
    else:
        vision_type = vlm_part_config(config, "vit")["model_type"]
        tower = CLIP_WEIGHTS if vision_type == "clip_vision_model" else SIGLIP_WEIGHTS
        projector = (_placed(LLAVA_PROJECTOR_WEIGHTS, names, _PROJECTOR_PREFIX),)
    parts = (_placed(part_weight_map(LLAMA_WEIGHTS, config, LANGUAGE, names), names),
             _placed(part_weight_map(tower, config, "vit", names), names, TOWER_PREFIX),
             *projector)
    return WeightMap(rules=tuple(r for p in parts for r in p.rules),
                     reshaped=frozenset().union(*(p.reshaped for p in parts)),
                     stacked=tuple(s for p in parts for s in p.stacked))


def _fit_config(config: dict[str, Any], vocab_size: int, image_id: int | None) -> None:
    """Set, in place, the text part's ``vocab_size`` and the image token id
    (``image_id``: the run tokenizer's placeholder, ``None``: kept) where the family's
    ``transformers`` config reads them.

    A Qwen2.5-VL ``config.json`` may hold its text keys at the top (as the hub folders
    do) or in ``text_config`` (as transformers 5 saves); a top-level ``vocab_size`` next
    to a ``text_config`` is set too, so no stale copy is left.
    """
    text = config.get("text_config")
    if isinstance(text, dict):
        text["vocab_size"] = vocab_size
    if not isinstance(text, dict) or "vocab_size" in config:
        config["vocab_size"] = vocab_size
    if image_id is not None:
        config["image_token_id" if is_native_config(config) else "image_token_index"] = image_id


def write_vlm_folder(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                     target: ExportFolder, folder: Path, vision: str) -> dict[str, Path]:
    """Write the run as one folder of the original's class (see the module docstring).

    Args:
        tensors: the checkpoint's full model (``read_full_model``).
        meta: its metadata (the run config, the iteration, the real vocabulary).
        target: the checked output folder.
        folder: the original folder (:func:`vlm_folder`).
        vision: the vision module's name.

    Returns:
        ``{"model": OUT_DIR}`` (the run config is written with the other modules).

    Raises:
        ValueError: the tensors do not belong to the folder (names every mismatch).
    """
    config, files = read_hf_config(folder), tensor_files(folder)  # a fresh dict to change
    tokenizer = run_tokenizer(meta["config"])
    state = split_by_module(dict(tensors))
    ours, dropped, text = fit_decoder(state[LANGUAGE], vlm_part_config(config, LANGUAGE),
                                      meta.get(VOCAB_SIZE_UNPADDED), tokenizer, LANGUAGE)
    assert EMBED in ours, sorted(ours)[:5]
    # "encoder.*" (and LLaVA's "projector.*"): no clash with the decoder's names.
    ours.update(state[vision])
    weights = merge_into_folder(ours, dropped, files, joined_weight_map(config, list(files)),
                                "model")
    image_id = (tokenizer.placeholder_id("image")
                if tokenizer is not None and "image" in tokenizer.modalities else None)
    _fit_config(config, int(text["vocab_size"]), image_id)
    written = copy_files(folder, target, "", keep=lambda name: name != CONFIG_FILE and (
        tokenizer is None or not is_tokenizer_file(name)))
    written.append(target.file(CONFIG_FILE))
    written[-1].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        written += write_tokenizer(tokenizer, target, "")
    written.append(target.file(SINGLE_FILE))
    save_file(weights, str(written[-1]), metadata={
        "format": "pt", "iteration": str(meta["iteration"]), "mimotron_export": "hf"})
    set_file_modes(written)
    return {"model": target.root}
