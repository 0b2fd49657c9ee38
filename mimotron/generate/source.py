"""Where generation reads a trained model from, and the model built on one process.

:func:`find_source` accepts what a run leaves on disk:

* a **run directory** (``log.dir``) holding ``checkpoints/``: its latest checkpoint;
* a **checkpoint**: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` folder;
* an **export folder** of ``mimotron export``: ``config.json`` + ``<module>.safetensors``
  (``--format mimotron``), or ``mimotron_config.json`` + a Hugging Face folder per
  ``hf_path`` module + ``<module>.safetensors`` for the projectors and the other
  modules (``--format hf``).

A ``--format hf-llava`` folder is one ``transformers`` model, not mimotron's modules: it
is refused, naming what to pass instead.

:func:`load_model` reads the run config recorded there, builds the tokenizer as training
built it (:func:`~mimotron.data.run_data.run_hf_tokenizer`: the placeholders get the
ids training gave them), builds every module whole on one device and fills it with the
trained weights. A checkpoint's files are checked against its manifest first and read
in place into the model (one copy of the weights in memory). Module sizes of an
``hf_path`` module come from that folder's ``config.json``, as in training, so a
checkpoint or a ``--format mimotron`` export needs the folders the run read; a
``--format hf`` export holds its own. Every problem is one ``ValueError`` (or a
:class:`~mimotron.checkpoint.files.CheckpointError` for damaged checkpoint files)
naming the path, before any weight is read.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.checkpoint.export import CONFIG_FILE
from mimotron.checkpoint.files import CheckpointError, read_manifest, resolve_checkpoint
from mimotron.checkpoint.hf_export import RUN_CONFIG_FILE, TOWER_PREFIX
from mimotron.checkpoint.llava_export import FORMAT as LLAVA_FORMAT
from mimotron.checkpoint.load import SafeLoadPlanner, read_metadata, verify_share
from mimotron.checkpoint.lora_base import BASE_KEY, adapters_only_prefixes, check_folder_bases
from mimotron.checkpoint.safe_metadata import SafeFileSystemReader
from mimotron.checkpoint.state import META, MODEL, model_state
from mimotron.config.hf_files import read_safetensors
from mimotron.config.load import config_from_dict
from mimotron.config.lora import base_in_folder
from mimotron.config.schema import MimoConfig
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.run_data import native_placeholder_ids, run_hf_tokenizer
from mimotron.models.build import build_module, module_prefix
from mimotron.models.lora import attach_lora
from mimotron.models.mimo import MimoModel
from mimotron.names import LANGUAGE, LANGUAGE_MODEL_PREFIX
from mimotron.runtime import device_for
from mimotron.training.model_setup import build_hf_part

LLAVA_MODEL_TYPE = "llava"
"""``model_type`` in the ``config.json`` of a ``--format hf-llava`` folder."""
CHECKPOINTS = "checkpoints"
"""The checkpoint folder inside a run directory (``checkpoint.dir``'s default)."""
_SHOWN = 5  # names listed in a message before "..."


@dataclass(frozen=True)
class ModelSource:
    """A trained model on disk.

    Attributes:
        kind: ``"checkpoint"``, ``"export"`` (``--format mimotron``) or ``"hf-export"``.
        path: the checkpoint's ``iter_NNNNNNN`` folder, or the export folder.
        run_config: the run config recorded there (``MimoConfig.to_dict()``); for an
            ``hf-export`` its ``hf_path`` entries (and the tokenizer, when the language
            model is one) point into the export folder.
    """

    kind: str
    path: Path
    run_config: dict[str, Any]

    def describe(self) -> str:
        """For messages: ``checkpoint runs/x/checkpoints/iter_0000100``."""
        return f"{self.kind} {self.path}"


@dataclass
class LoadedModel:
    """A trained model ready to generate, on one device.

    Attributes:
        cfg: the run config.
        model: every module, whole, in eval mode, without gradients.
        tokenizer: the run's tokenizer with its placeholders.
        source: where the weights came from.
        device: where the model is.
    """

    cfg: MimoConfig
    model: MimoModel
    tokenizer: HFTokenizer
    source: ModelSource
    device: torch.device


def find_source(path: str | Path) -> ModelSource:
    """The trained model ``path`` holds (see the module docstring).

    Raises:
        ValueError: ``path`` is none of them (the message says what is valid).
        CheckpointError: ``latest`` names a missing or incomplete checkpoint, or the
            checkpoint is incomplete or damaged.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{str(path)!r} does not exist: expected a run directory, a "
                         "checkpoint or an export folder")
    if (path / RUN_CONFIG_FILE).is_file():
        _refuse_llava_folder(path)
        return ModelSource("hf-export", path, _hf_export_config(path))
    if (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors")):
        return ModelSource("export", path, _read_json(path / CONFIG_FILE))
    root = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
    try:
        checkpoint = resolve_checkpoint(root)
    except ValueError:
        raise ValueError(
            f"{str(path)!r} is not a trained model: expected a run directory holding "
            f"{CHECKPOINTS}/, a checkpoint directory holding 'latest' or an iter_NNNNNNN "
            f"directory, or an export folder ({CONFIG_FILE} or {RUN_CONFIG_FILE} with "
            "safetensors files)") from None
    manifest = read_manifest(checkpoint)
    problems = verify_share(checkpoint, manifest, 0, 1)
    if problems:
        raise CheckpointError(f"cannot read {checkpoint}:\n  " + "\n  ".join(problems))
    box: dict[str, Any] = {META: ""}
    _dcp_read(checkpoint, box)
    meta = json.loads(box[META])
    # Adapters saved without their base go onto the base they were trained on only.
    check_folder_bases(meta.get(BASE_KEY), f"checkpoint {checkpoint}")
    return ModelSource("checkpoint", checkpoint, meta["config"])


def _refuse_llava_folder(path: Path) -> None:
    """A one-line refusal of a ``--format hf-llava`` folder (it also holds the run config,
    but one ``transformers`` LLaVA model instead of a folder per module)."""
    config = path / CONFIG_FILE
    if config.is_file() and _read_json(config).get("model_type") == LLAVA_MODEL_TYPE:
        raise ValueError(
            f"{str(path)!r} is a 'mimotron export --format {LLAVA_FORMAT}' folder, which "
            "transformers loads (LlavaForConditionalGeneration): pass the run directory or "
            "checkpoint it was exported from, or a 'mimotron export' folder of --format "
            "mimotron or hf")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file} is unreadable: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} is invalid: expected a JSON object (a run config)")
    return value


def _hf_export_config(path: Path) -> dict[str, Any]:
    """The run config of a ``--format hf`` export, pointed at the export's own folders."""
    raw = _read_json(path / RUN_CONFIG_FILE)
    for name, module in (raw.get("modules") or {}).items():
        if isinstance(module, dict) and module.get("hf_path"):
            module["hf_path"] = str(path / name)
    language = (raw.get("modules") or {}).get(LANGUAGE) or {}
    if language.get("hf_path") and (path / LANGUAGE / "tokenizer_config.json").is_file():
        raw.setdefault("data", {})["tokenizer"] = str(path / LANGUAGE)  # written there
    return raw


def _dcp_read(path: Path, template: dict[str, Any]) -> None:
    """Fill ``template`` from the checkpoint at ``path``, in this one process."""
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: that is the point here.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, storage_reader=SafeFileSystemReader(str(path)),
                 planner=SafeLoadPlanner(), no_dist=True)


def load_model(path: str | Path, device: str | torch.device | None = None) -> LoadedModel:
    """Build a trained model on one device from a run, checkpoint or export folder.

    Args:
        path: see :func:`find_source`.
        device: where to put it; ``None`` = the runtime's device (an accelerator when one
            is available, else the CPU: :func:`mimotron.runtime.device_for`).

    Returns:
        The model, its config and tokenizer.

    Raises:
        ValueError: not a trained model; a run not trained on LLaVA data (no chat
            tokenizer); weights without a language model; a folder the run read that is
            gone; weights that do not fit the model (names them).
        CheckpointError: a damaged or incomplete checkpoint (names the file).
    """
    source = find_source(path)
    cfg = _run_config(source)
    _check_language(source)
    tokenizer = run_hf_tokenizer(cfg.data.tokenizer, [m.kind for m in cfg.modules.values()],
                                 cfg.data.chat_template,  # the template training used
                                 native_placeholder_ids(cfg))  # a Qwen-VL folder's own
    target = device_for(0) if device is None else torch.device(device)
    vocab = padded_vocab_size(tokenizer.vocab_size)  # as training sized it (setup_mimo)
    # A --format hf export holds the Hugging Face modules as folders: read from there; so
    # does a checkpoint of adapters only (checkpoint/lora_base) for those modules' base.
    from_folder = {n: source.kind == "hf-export" or (source.kind == "checkpoint"
                                                     and base_in_folder(cfg, n))
                   for n in cfg.modules}
    # A --format hf export holds the adapters merged into the weights: none to attach.
    parts = {name: _build_part(cfg, name, vocab, target, from_folder[name],
                               adapters=source.kind != "hf-export")
             for name in cfg.modules}
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    language = parts.pop(LANGUAGE)
    modality_of = {n: str(cfg.modules[n].modality) for n in cfg.encoder_names}
    model = MimoModel(parts, language, placeholders, modality_of)  # type: ignore[arg-type]
    if source.kind == "checkpoint":
        model.adapters_only = adapters_only_prefixes(cfg)
        _read_checkpoint(source.path, model)
    else:
        _read_export(source, cfg, model)
    model.eval().requires_grad_(False)
    return LoadedModel(cfg, model, tokenizer, source, target)


def _run_config(source: ModelSource) -> MimoConfig:
    """The recorded run config, its ``hf_path`` modules sized from their folders."""
    try:
        cfg = config_from_dict(source.run_config)
    except ValueError as exc:
        raise ValueError(f"{source.describe()}: its run config cannot be rebuilt: {exc}") from None
    if cfg.data.dataset != "llava" or LANGUAGE not in cfg.modules:
        raise ValueError(
            f"{source.describe()} was trained with data.dataset={cfg.data.dataset!r}: "
            "generate needs a run trained on LLaVA data (data.dataset = \"llava\"), whose "
            "tokenizer and chat template give the prompt")
    return cfg


def _check_language(source: ModelSource) -> None:
    """A one-line error, before anything is built, when the weights lack the language model."""
    if source.kind == "checkpoint":
        found = any(k.startswith(MODEL + LANGUAGE_MODEL_PREFIX) for k in _stored(source.path))
        what = f"no {MODEL}{LANGUAGE_MODEL_PREFIX}* tensors"
    else:
        found = (source.path / f"{LANGUAGE}.safetensors").is_file() or (
            source.kind == "hf-export" and (source.path / LANGUAGE).is_dir())
        what = f"no {LANGUAGE}.safetensors" + (f" nor {LANGUAGE}/" if source.kind == "hf-export"
                                               else "")
    if not found:
        raise ValueError(f"{source.describe()} holds no language model ({what}): generate "
                         "needs the language model's weights")


def _build_part(cfg: MimoConfig, name: str, vocab_size: int, device: torch.device,
                from_folder: bool, adapters: bool = True) -> nn.Module:
    """Module ``name`` whole on ``device``, its values still to be read.

    Built on the meta device and allocated without initialisation, unless its values
    come from its ``hf_path`` folder (``from_folder``) or it has buffers no checkpoint
    holds (Whisper's fixed positions): then it is built as training builds it, so those
    buffers hold what training used.
    """
    with torch.device("meta"):
        part = build_module(cfg, name, vocab_size, init=False)
    unsaved = {n for n, _ in part.named_buffers()} - set(part.state_dict())
    hf_path = bool(cfg.modules[name].hf_path)
    if (from_folder and hf_path) or unsaved:
        whole = {"layer_ids": None, "pre_process": True, "post_process": True}
        part = (build_hf_part(cfg, name, vocab_size, whole, None, device) if hf_path
                else build_module(cfg, name, vocab_size).to(device))
    else:
        part.to_empty(device=device)
        if getattr(part, "tie_word_embeddings", False):
            part.tie_weights()  # to_empty allocates each reference separately
    lora = cfg.modules[name].lora
    if lora.rank and adapters:  # the run's adapters (their values from the checkpoint)
        attach_lora(part, lora, cfg.train.seed, module_prefix(cfg, name))
    return part


def _read_checkpoint(path: Path, model: MimoModel) -> None:
    """Read the checkpoint's model tensors into ``model`` in place (keys and shapes checked)."""
    template = model_state(model)
    stored = _stored(path)
    missing = sorted(set(template) - set(stored))
    unexpected = sorted(set(stored) - set(template))
    wrong = sorted(k for k in set(template) & set(stored)
                   if tuple(stored[k].size) != tuple(template[k].shape))
    problems = [f"{label} {_few(keys)}" for label, keys in
                (("missing", missing), ("unexpected", unexpected), ("mis-shaped", wrong)) if keys]
    if problems:
        raise ValueError(f"checkpoint {path} does not fit the model its run config builds: "
                         + "; ".join(problems))
    _dcp_read(path, template)


def _stored(path: Path) -> dict[str, TensorStorageMetadata]:
    """The model tensors a checkpoint holds (``model.<name>``), from DCP's metadata."""
    metadata = read_metadata(path, read_manifest(path)).state_dict_metadata
    return {k: md for k, md in metadata.items()
            if k.startswith(MODEL) and isinstance(md, TensorStorageMetadata)}


def _read_export(source: ModelSource, cfg: MimoConfig, model: MimoModel) -> None:
    """Read ``<module>.safetensors`` of an export folder into ``model``.

    In a ``--format hf`` export an ``hf_path`` module's tower was read from its folder
    already (:func:`_build_part`); its file holds the projector only.
    """
    for name in cfg.modules:
        part = model.language_model if name == LANGUAGE else model.modality_submodules[name]
        file = source.path / f"{name}.safetensors"
        in_folder = source.kind == "hf-export" and bool(cfg.modules[name].hf_path)
        if not file.is_file():
            if in_folder and name == LANGUAGE:
                continue  # the whole language model is its Hugging Face folder
            raise ValueError(f"{source.describe()} is incomplete: {file.name} is missing")
        try:
            result = part.load_state_dict(read_safetensors(file), strict=False)
        except RuntimeError as exc:  # a mis-shaped tensor
            raise ValueError(f"{file} does not fit modules.{name}: "
                             f"{' '.join(str(exc).split())}") from None
        # The tower of an hf_path module came from its folder (in_folder).
        missing = [k for k in result.missing_keys
                   if not (in_folder and k.startswith(TOWER_PREFIX))]
        if missing or result.unexpected_keys:
            raise ValueError(f"{file} does not fit modules.{name}: missing {_few(missing)}, "
                             f"unexpected {_few(result.unexpected_keys)}")


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return f"[{shown}{', ...' if len(names) > _SHOWN else ''}] ({len(names)})"
