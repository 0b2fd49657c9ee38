"""Export a checkpoint as plain weights: one safetensors file per module, plus the config.

The export runs in one process without ``torch.distributed``: DCP assembles every
tensor at its full (unsharded) shape whatever layout wrote it. Each module's file holds
the names the module has on its own (``encoder.layers.0...`` for an encoder with its
projector, ``layers.0...`` for the language model), so a module can be reused alone;
:func:`load_exported` rebuilds the whole ``MimoModel`` from the folder.

Output folder::

    <module>.safetensors   one per module (header metadata: module, iteration)
    config.json            the resolved run config the checkpoint was written with
    .mimotron-export.json  the files this export wrote (see :mod:`.export_folder`)

The folder must be new, empty, or a previous export's own; never a folder the run read.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.files import CheckpointError, read_manifest, resolve_checkpoint
from mimotron.checkpoint.load import SafeLoadPlanner, read_metadata, verify_share
from mimotron.checkpoint.lora_base import BASE_KEY, with_base
from mimotron.checkpoint.safe_metadata import SafeFileSystemReader
from mimotron.checkpoint.state import META, MODEL
from mimotron.config.hf_files import read_safetensors
from mimotron.config.load import config_from_dict
from mimotron.config.schema import MimoConfig
from mimotron.config.validation import validate_config
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data.run_data import build_tokenizer
from mimotron.models.build import build_mimo_model
from mimotron.models.mimo import MimoModel
from mimotron.names import ENCODER_PREFIX, LANGUAGE, LANGUAGE_MODEL_PREFIX
from mimotron.outputs import new_file_mode

CONFIG_FILE = "config.json"


def split_module(name: str) -> tuple[str, str]:
    """``modality_submodules.vision.x`` -> ``("vision", "x")``; ``language_model.x`` ->
    ``("language", "x")``.

    Raises:
        CheckpointError: a name outside both (not a ``MimoModel`` parameter).
    """
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return LANGUAGE, name[len(LANGUAGE_MODEL_PREFIX) :]
    if name.startswith(ENCODER_PREFIX):
        module, _, rest = name[len(ENCODER_PREFIX) :].partition(".")
        return module, rest
    raise CheckpointError(f"checkpoint entry model.{name} belongs to no MimoModel module")


def read_full_model(
    checkpoint: str | Path, check_meta: Callable[[dict[str, Any]], None] | None = None,
    base: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every model tensor of a checkpoint at full shape, and its ``meta``; one process.

    Every file is checked against the manifest first.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        check_meta: called with the ``meta`` before any tensor is read, so a problem it
            can see there (a folder the export needs is gone) costs no tensor read.
        base: add the base of each LoRA module that checkpointed its adapters only,
            read from its folder (:func:`~mimotron.checkpoint.lora_base.with_base`).

    Returns:
        ``({"<name inside MimoModel>": tensor}, meta)``.

    Raises:
        ValueError: not a checkpoint path.
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    path = resolve_checkpoint(checkpoint)
    manifest = read_manifest(path)
    metadata = read_metadata(path, manifest)
    problems = verify_share(path, manifest, 0, 1)
    if problems:
        raise CheckpointError(f"cannot export {path}:\n  " + "\n  ".join(problems))
    box: dict[str, Any] = {META: ""}
    _dcp_read(path, box)
    meta = json.loads(box[META])
    if check_meta is not None:
        check_meta(meta)
    template: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata):
            template[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    _dcp_read(path, template)
    tensors = {k[len(MODEL) :]: v for k, v in template.items()}
    return (with_base(tensors, meta["config"], meta.get(BASE_KEY)) if base else tensors), meta


def _dcp_read(path: Path, template: dict[str, Any]) -> None:
    """Fill ``template`` from the checkpoint at ``path``, in this one process."""
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=SafeFileSystemReader(str(path)),
                 planner=SafeLoadPlanner(), no_dist=True)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Write ``<module>.safetensors`` per module and ``config.json`` into ``out_dir``.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        out_dir: output folder (created): new, empty, or holding only a previous export
            (:class:`~mimotron.checkpoint.export_folder.ExportFolder`). Checked before
            any tensor is read. The files get the mode any new file gets there (0o666
            less the umask), the safetensors files too.

    Returns:
        Module name -> the file written.

    Raises:
        ValueError: not a checkpoint path, or ``out_dir`` cannot be written, holds files
            an export did not write, or is a folder the run read (names it).
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    folder = ExportFolder(out_dir)
    tensors, meta = read_full_model(checkpoint, check_meta=lambda m: folder.check(m["config"]))
    written = write_module_files(split_by_module(tensors), folder, meta["iteration"])
    folder.file(CONFIG_FILE).write_text(json.dumps(meta["config"], indent=1) + "\n")
    folder.finish()
    return written


def split_by_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``{"<name inside MimoModel>": t}`` -> ``{module: {"<name inside the module>": t}}``."""
    per_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, rest = split_module(name)
        per_module.setdefault(module, {})[rest] = tensor.contiguous()
    return per_module


def write_module_files(
    per_module: dict[str, dict[str, torch.Tensor]], folder: ExportFolder, iteration: int
) -> dict[str, Path]:
    """Write ``OUT_DIR/<module>.safetensors`` per module into an export folder; the files."""
    written = {}
    for module, state in sorted(per_module.items()):
        file = folder.file(f"{module}.safetensors")
        mode = new_file_mode(file.parent)
        save_file(
            state,
            str(file),
            metadata={"format": "mimotron", "module": module, "iteration": str(iteration)},
        )
        # safetensors writes a 0600 temp file and renames it: give it the usual mode.
        os.chmod(file, mode)
        written[module] = file
    return written


def load_exported(
    out_dir: str | Path, device: str | torch.device = "cpu"
) -> tuple[MimoConfig, MimoModel]:
    """Rebuild the whole model from an export folder (no ``torch.distributed`` needed).

    A run trained from Hugging Face folders or on LLaVA data loads too: its
    architectures are read from the ``modules.<m>.hf_path`` folders and its vocabulary
    and placeholder ids from the tokenizer (``data.tokenizer``), exactly as training
    built them, so those folders must still be where the run config names them (the
    data files need not be). Each module is built as training builds it (a Hugging Face
    module also reads its folder, which fills the fixed buffers no export holds, such as
    Whisper's positions), then every parameter is loaded from the export, strictly.

    Args:
        out_dir: a folder written by :func:`export_checkpoint`.
        device: where to put the model.

    Returns:
        ``(config, model)`` with every module's weights loaded (strict).

    Raises:
        ValueError: the folder lacks the config or a module's file, they disagree, or a
            folder the run config names (an ``hf_path``, the tokenizer) is gone.
    """
    out = Path(out_dir)
    if not (out / CONFIG_FILE).is_file():
        raise ValueError(f"export folder {str(out)!r} is invalid: {CONFIG_FILE} is missing")
    cfg = config_from_dict(json.loads((out / CONFIG_FILE).read_text()))
    if cfg.data.dataset != "llava":
        # A LLaVA run's validation checks its training files (data.path), which the
        # weights do not need; the folders the model needs are read when it is built.
        validate_config(cfg)
    tokenizer = build_tokenizer(cfg)
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    # The same (padded) vocabulary as training (see setup_mimo).
    model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders)
    for name in cfg.modules:
        file = out / f"{name}.safetensors"
        if not file.is_file():
            raise ValueError(f"export folder {str(out)!r} is invalid: {file.name} is missing")
        part = model.language_model if name == LANGUAGE else model.modality_submodules[name]
        part.load_state_dict(read_safetensors(file), strict=True)  # a damaged file named
    return cfg, model.to(device)
