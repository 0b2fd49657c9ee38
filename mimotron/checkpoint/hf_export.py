"""Export a checkpoint as Hugging Face folders: ``mimotron export --format hf``.

Every module that was loaded from a Hugging Face folder (``modules.<m>.hf_path`` in the
run config the checkpoint records) becomes ``OUT_DIR/<m>/``, a folder that
``transformers`` ``from_pretrained`` loads as the same architecture as the original:

- ``model.safetensors``: the original folder's tensors under their original names, with
  every tensor the module trained replaced by the checkpoint's value (names translated
  by the family's :class:`~mimotron.models.hf.weights.WeightMap`; the experts of a
  Qwen2-MoE / Qwen3-MoE layer, trained stacked, one tensor per expert again), each in the
  dtype the original stored it in. Tensors mimotron never built are copied unchanged from the
  original: CLIP layers past the LLaVA feature layer, a full ``CLIPModel``'s text tower,
  Whisper's decoder and its fixed positions (a non-persistent buffer). So the round trip
  folder -> mimotron -> checkpoint -> export, without an optimizer step, gives back the
  original tensors bit for bit. A tied output head is not written (``transformers`` ties
  it on load).
- ``config.json``: the original's, unchanged unless the vocabulary changed (placeholder
  tokens added): then ``vocab_size`` is the exported embedding's rows.
- the original folder's other files (``generation_config.json``,
  ``preprocessor_config.json``, ...); weight files are never copied.
- for the language module, the tokenizer of ``data.tokenizer``, with the modality
  placeholders training added: only its tokenizer files (:func:`is_tokenizer_file`), in
  place of the model folder's own. ``data.tokenizer`` is usually the model folder
  itself; its ``config.json`` never replaces the exported one.

The language model's embedding may carry padding rows beyond the real vocabulary (a
multiple for tensor parallelism); they are dropped. The real vocabulary is the
checkpoint meta's ``vocab_size_unpadded`` when recorded, else ``max(config.json
vocab_size, tokenizer length with placeholders)``, else every row is kept.

Modules without ``hf_path`` (toy kinds) and the projectors of HF encoders are written as
by the default export, ``OUT_DIR/<m>.safetensors``; the run config goes to
``OUT_DIR/mimotron_config.json``. ``OUT_DIR`` follows the rules of
:mod:`~mimotron.checkpoint.export_folder`: new, empty or a previous export's own (listed
by its ``.mimotron-export.json``), and neither it nor any ``OUT_DIR/<m>`` a folder the
run read (an ``hf_path``, the tokenizer, the data).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mimotron.checkpoint.export import read_full_model, split_by_module, write_module_files
from mimotron.checkpoint.export_folder import ExportFolder
from mimotron.checkpoint.state import VOCAB_SIZE_UNPADDED
from mimotron.config.hf_files import open_safetensors
from mimotron.config.hf_folder import INDEX_FILE, SINGLE_FILE, read_hf_config, tensor_files
from mimotron.config.hf_vlm import NATIVE_MODEL_TYPES, image_token_index
from mimotron.models.hf.clip import CLIP_WEIGHTS, SIGLIP_WEIGHTS
from mimotron.models.hf.llama import LLAMA_WEIGHTS, SUPPORTED_MODEL_TYPES, LlamaFamilySpec
from mimotron.models.hf.weights import WeightMap, hf_tensors_of
from mimotron.models.hf.whisper import WHISPER_WEIGHTS
from mimotron.names import LANGUAGE
from mimotron.outputs import new_file_mode

HF_PATH = "hf_path"
"""Key of ``modules.<m>`` naming the Hugging Face folder a module was loaded from."""
TOKENIZER = "tokenizer"
"""Key of ``data`` naming the Hugging Face tokenizer folder."""
TOWER_PREFIX = "encoder."
"""Where an encoder module's Hugging Face tower sits inside it (the rest: its projector)."""
EMBED, HEAD = "embed.weight", "output.weight"  # the language model's vocabulary tensors
CONFIG_FILE = "config.json"
RUN_CONFIG_FILE = "mimotron_config.json"
# Files of an original folder that hold weights: never copied (stale values, or a second
# copy transformers might prefer). Export deletes none of them anywhere.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json",
                    ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
# Tokenizer files besides tokenizer*: what the tokenizer classes of transformers read.
_TOKENIZER_NAMES = frozenset({"special_tokens_map.json", "added_tokens.json", "vocab.json",
                              "vocab.txt", "merges.txt", "chat_template.jinja",
                              "chat_template.json"})
_TEMPLATE_NAMES = frozenset({"chat_template.jinja", "chat_template.json"})
_TOKENIZER_SUFFIXES = (".model", ".tiktoken")  # spiece.model, sentencepiece.bpe.model, ...


@dataclass(frozen=True)
class HFFamily:
    """A Hugging Face architecture family mimotron builds, as export needs it.

    Attributes:
        name: the family, for messages.
        model_types: ``config.json`` ``model_type`` values of the family (tower alone or
            the full model holding it).
        weight_map: our names <-> the checkpoint's.
        language: a decoder (vocabulary rows, tied head) rather than an encoder tower.
    """

    name: str
    model_types: tuple[str, ...]
    weight_map: WeightMap
    language: bool = False


FAMILIES: tuple[HFFamily, ...] = (
    HFFamily("llama", SUPPORTED_MODEL_TYPES, LLAMA_WEIGHTS, language=True),
    HFFamily("clip", ("clip_vision_model", "clip"), CLIP_WEIGHTS),
    HFFamily("siglip", ("siglip_vision_model", "siglip"), SIGLIP_WEIGHTS),
    HFFamily("whisper", ("whisper",), WHISPER_WEIGHTS),
)


def family_of(config: Mapping[str, Any], where: str) -> HFFamily:
    """The family of a parsed ``config.json``, by its ``model_type``.

    Raises:
        ValueError: a ``model_type`` no family has (names ``where`` and what is valid).
    """
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    valid = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"{where} config.json model_type={model_type!r} cannot be exported; "
                     f"expected one of {valid}")


def check_hf_folder(path: str | os.PathLike[str] | None, module: str) -> Path:
    """The recorded ``hf_path`` of ``module``, checked to still be there.

    Raises:
        ValueError: the folder is gone (export copies its config and untrained tensors).
    """
    if path is None or not Path(path).is_dir():
        raise ValueError(
            f"modules.{module}.hf_path={str(path)!r} is not an existing directory: the Hugging "
            "Face export copies config.json and the untrained tensors from the folder the "
            "module was loaded from; restore it there"
        )
    return Path(path)


def hf_paths(run_config: Mapping[str, Any]) -> dict[str, str]:
    """Module -> ``hf_path`` of every module of a run config that has one."""
    modules = run_config.get("modules") or {}
    return {name: str(mod[HF_PATH]) for name, mod in modules.items()
            if isinstance(mod, Mapping) and mod.get(HF_PATH)}


def export_hf_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Write a checkpoint's modules as Hugging Face folders (see the module docstring).

    The output folder is checked for writing before the checkpoint is read; that it
    is this export's to write (:class:`~mimotron.checkpoint.export_folder.ExportFolder`),
    the recorded ``hf_path`` folders and the tokenizer before any tensor is read.

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        out_dir: the output folder (created): new, empty, or a previous export's own.

    Returns:
        What was written, by label: ``<m>`` -> ``OUT_DIR/<m>`` (a Hugging Face folder)
        or ``OUT_DIR/<m>.safetensors`` (no ``hf_path``); ``<m> projector`` ->
        ``OUT_DIR/<m>.safetensors`` for the projector of an HF encoder; ``run config``.

    Raises:
        ValueError: not a checkpoint path, an unwritable ``out_dir`` or one holding
            files an export did not write or a folder the run read, no module with an
            ``hf_path``, or a recorded folder that is gone or unusable (names it).
        CheckpointError: missing, incomplete or corrupted (names the file).
    """
    folder = ExportFolder(out_dir)
    found: dict[str, Any] = {}
    tensors, meta = read_full_model(checkpoint,
                                    check_meta=lambda m: check_hf_run(m, folder, found))
    written = write_hf_modules(tensors, meta, folder, found)
    folder.finish()
    return written


def check_hf_run(meta: Mapping[str, Any], folder: ExportFolder, found: dict[str, Any]) -> None:
    """What :func:`export_hf_checkpoint` checks before any tensor is read; the run's
    tokenizer goes to ``found["tokenizer"]``.

    Raises:
        ValueError: as :func:`export_hf_checkpoint`.
    """
    paths = hf_paths(meta["config"])
    if not paths:
        raise ValueError("export --format hf: no module of this checkpoint has an hf_path "
                         "(modules.<m>.hf_path); use --format mimotron")
    folder.check(meta["config"], subfolders=paths)
    for module, path in paths.items():
        config = read_hf_config(check_hf_folder(path, module))
        family_of(config, f"modules.{module}.hf_path={path!r}")
    found["tokenizer"] = run_tokenizer(meta["config"]) if LANGUAGE in paths else None


def write_hf_modules(tensors: dict[str, torch.Tensor], meta: Mapping[str, Any],
                     folder: ExportFolder, found: Mapping[str, Any],
                     skip: Collection[str] = ()) -> dict[str, Path]:
    """The files of :func:`export_hf_checkpoint` (``found``: from :func:`check_hf_run`),
    but for the modules in ``skip`` (written by the caller)."""
    paths, iteration = hf_paths(meta["config"]), int(meta["iteration"])
    written: dict[str, Path] = {}
    plain: dict[str, dict[str, torch.Tensor]] = {}
    for module, state in sorted(split_by_module(tensors).items()):
        if module in skip:
            continue
        if module not in paths:
            plain[module] = state
            continue
        tower, rest = _split_tower(module, state)
        written[module] = _write_hf_module(
            tower, paths[module], folder, module, module=module,
            vocab_size=meta.get(VOCAB_SIZE_UNPADDED) if module == LANGUAGE else None,
            tokenizer=found["tokenizer"] if module == LANGUAGE else None,
            metadata={"module": module, "iteration": str(iteration)})
        if rest:
            written[f"{module} projector"] = write_module_files({module: rest}, folder,
                                                                iteration)[module]
    written.update(write_module_files(plain, folder, iteration))
    written["run config"] = folder.file(RUN_CONFIG_FILE)
    written["run config"].write_text(json.dumps(meta["config"], indent=1) + "\n")
    return written


def _split_tower(
    module: str, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(the Hugging Face part under its own names, the rest)`` of a module's tensors."""
    if module == LANGUAGE:
        return state, {}
    tower = {n[len(TOWER_PREFIX):]: t for n, t in state.items() if n.startswith(TOWER_PREFIX)}
    rest = {n: t for n, t in state.items() if not n.startswith(TOWER_PREFIX)}
    return tower, rest


def run_tokenizer(run_config: Mapping[str, Any]) -> Any:
    """The run's Hugging Face tokenizer with its placeholders, or ``None`` if it had none.

    Built by the function training builds it with
    (:func:`~mimotron.data.run_data.run_hf_tokenizer`), from the module kinds, the
    ``data.chat_template`` and the Qwen-VL folder (its ``<|image_pad|>`` is the image
    placeholder) the run config records, so the placeholders get the ids training gave
    them and the template is the one training rendered with.
    """
    data = run_config.get("data") or {}
    path = data.get(TOKENIZER)
    if not path:
        return None
    from mimotron.data.run_data import run_hf_tokenizer  # Deferred: loads transformers.

    modules = [m for m in (run_config.get("modules") or {}).values() if isinstance(m, Mapping)]
    return run_hf_tokenizer(path, [m.get("kind") for m in modules],
                            data.get("chat_template") or "",
                            placeholder_ids=_native_placeholder_ids(modules))


def _native_placeholder_ids(modules: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """``{"image": config.json image_token_id}`` where a vision module is a Qwen-VL
    folder's tower (training's placeholder is the model's own token), else ``{}``."""
    for module in modules:
        path = module.get(HF_PATH)
        if module.get("kind") != "vit" or not path or not Path(str(path)).is_dir():
            continue
        config = read_hf_config(path)
        if config.get("model_type") in NATIVE_MODEL_TYPES:
            return {"image": image_token_index(config)}
    return {}


def export_hf_module(
    tensors: Mapping[str, torch.Tensor],
    hf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    module: str,
    vocab_size: int | None = None,
    tokenizer: Any = None,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write one module as a Hugging Face folder ``out_dir`` (see the module docstring).

    Args:
        tensors: the module's full (unsharded) tensors under our module-local names
            (``layers.0.attn.wq.weight``: the language model's, or an encoder's tower's
            without the ``encoder.`` prefix).
        hf_path: the folder the module was loaded from.
        out_dir: the folder to write (created): new, empty or a previous export's own,
            and neither ``hf_path`` nor the tokenizer's folder (see
            :class:`~mimotron.checkpoint.export_folder.ExportFolder`).
        module: the module's name, for messages.
        vocab_size: language only: the real vocabulary; rows beyond it are padding and
            dropped. ``None``: ``max(config vocab_size, len(tokenizer))`` with a
            tokenizer, else every row.
        tokenizer: language only: an :class:`~mimotron.data.hf_tokenizer.HFTokenizer`
            to write next to the weights, or ``None``.
        metadata: extra safetensors header entries (strings).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: ``out_dir`` is not this export's to write, the folder is gone or not
            a supported family, or the tensors do not belong to its checkpoint (names
            every mismatch).
    """
    folder = ExportFolder(out_dir)
    tokenizer_path = str(tokenizer.path) if tokenizer is not None else None
    folder.check({"modules": {module: {HF_PATH: str(hf_path)}},
                  "data": {TOKENIZER: tokenizer_path}})
    out = _write_hf_module(tensors, hf_path, folder, "", module=module, vocab_size=vocab_size,
                           tokenizer=tokenizer, metadata=metadata)
    folder.finish()
    return out


def _write_hf_module(
    tensors: Mapping[str, torch.Tensor],
    hf_path: str | os.PathLike[str],
    target: ExportFolder,
    subfolder: str,
    *,
    module: str,
    vocab_size: int | None,
    tokenizer: Any,
    metadata: Mapping[str, str] | None,
) -> Path:
    """:func:`export_hf_module` into ``subfolder`` (``""``: the top) of a checked folder."""
    folder = check_hf_folder(hf_path, module)
    weights, config = hf_module_weights(tensors, hf_path, module=module, vocab_size=vocab_size,
                                        tokenizer=tokenizer)
    prefix = f"{subfolder}/" if subfolder else ""
    # With a run tokenizer, the folder's own tokenizer files (when it ships one) give way
    # to it: the tokenizer training used, placeholders included, is written below.
    written = copy_files(folder, target, prefix,
                          keep=lambda name: tokenizer is None or not is_tokenizer_file(name))
    if config != read_hf_config(folder):
        written.append(target.file(prefix + CONFIG_FILE))
        written[-1].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        written += write_tokenizer(tokenizer, target, prefix)
    written.append(target.file(prefix + SINGLE_FILE))
    # transformers refuses a safetensors file without format=pt in its header.
    save_file(weights, str(written[-1]), metadata={**(metadata or {}), "format": "pt"})
    set_file_modes(written)
    return written[-1].parent


def set_file_modes(files: Sequence[Path]) -> None:
    """Give written files the mode any new file gets in their folder (0o666 less umask).

    safetensors writes 0600 (a temp file renamed), ``save_pretrained`` its own modes.
    """
    for file in files:
        os.chmod(file, new_file_mode(file.parent))


def hf_module_weights(
    tensors: Mapping[str, torch.Tensor],
    hf_path: str | os.PathLike[str],
    *,
    module: str,
    vocab_size: int | None,
    tokenizer: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A module's tensors as its original folder holds them, and its ``config.json``.

    Args:
        tensors: the module's full tensors under our module-local names (see
            :func:`export_hf_module`).
        hf_path: the folder the module was loaded from.
        module: the module's name, for messages.
        vocab_size: language only: the real vocabulary (see :func:`export_hf_module`).
        tokenizer: language only: the run's ``HFTokenizer`` (its length bounds the
            vocabulary when ``vocab_size`` is ``None``), or ``None``.

    Returns:
        ``(every tensor of the folder under its original name and dtype, ours in place;
        config.json with vocab_size set to the exported rows)``. A tied output head is
        left out (transformers ties it on load).

    Raises:
        ValueError: the folder is gone or not a supported family, or the tensors do not
            belong to its checkpoint (names every mismatch).
    """
    folder = check_hf_folder(hf_path, module)
    config = read_hf_config(folder)
    family = family_of(config, f"modules.{module}.hf_path={str(hf_path)!r}")
    ours = dict(tensors)
    dropped: set[str] = set()
    if family.language:
        ours, dropped, config = fit_decoder(ours, config, vocab_size, tokenizer, module)
    weights = merge_into_folder(ours, dropped, tensor_files(folder), family.weight_map, module)
    return weights, config


def fit_decoder(ours: dict[str, torch.Tensor], config: dict[str, Any], vocab_size: int | None,
                tokenizer: Any, module: str
                ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, Any]]:
    """A decoder's tensors as its folder keeps them: a tied head left out (transformers
    ties it on load), the vocabulary tables cut to the real vocabulary.

    Args:
        ours: the decoder's full tensors under our names.
        config: its config.json (a decoder's, or a vision-language folder's text part).
        vocab_size: the real vocabulary (``None``: ``max(config's, len(tokenizer))`` with
            a tokenizer, else every row).
        tokenizer: the run's ``HFTokenizer`` or ``None``.
        module: the module's name, for messages.

    Returns:
        ``(the tensors, the names left out, config with vocab_size set)``.

    Raises:
        ValueError: as :func:`fit_vocab`.
    """
    dropped: set[str] = set()
    if LlamaFamilySpec.from_hf_config(config).tie_word_embeddings and EMBED in ours:
        ours = {n: t for n, t in ours.items() if n != HEAD}
        dropped.add(HEAD)
    if vocab_size is None and tokenizer is not None:
        vocab_size = max(int(config["vocab_size"]), int(tokenizer.vocab_size))
    ours, config = fit_vocab(ours, config, vocab_size, module)
    return ours, dropped, config


def fit_vocab(
    ours: dict[str, torch.Tensor], config: dict[str, Any], vocab_size: int | None, module: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Drop the padding rows of the embedding / head; ``vocab_size`` set to the rows."""
    present = [n for n in (EMBED, HEAD) if n in ours]
    if not present:
        return ours, config
    rows = int(ours[present[0]].shape[0])
    keep = rows if vocab_size is None else int(vocab_size)
    if not 0 < keep <= rows:
        raise ValueError(
            f"module {module!r}: a vocabulary of {keep} (the checkpoint meta's "
            f"{VOCAB_SIZE_UNPADDED}, else max(config.json vocab_size, tokenizer length)) does "
            f"not fit its embedding of {rows} rows: expected 1..{rows}")
    ours = {n: (t[:keep] if n in present else t) for n, t in ours.items()}
    if keep != config.get("vocab_size"):
        config = {**config, "vocab_size": keep}
    return ours, config


def merge_into_folder(
    ours: Mapping[str, torch.Tensor],
    dropped: set[str],
    files: Mapping[str, Path],
    weight_map: WeightMap,
    module: str,
) -> dict[str, torch.Tensor]:
    """The original checkpoint with our tensors in place (original names and dtypes)."""
    prefix = weight_map.choose_prefix(files)
    renamed: dict[str, torch.Tensor] = {}
    unnamed = []
    for name, tensor in ours.items():
        try:
            # MoE experts trained stacked ([experts, ...]) are stored one tensor each.
            split = hf_tensors_of(name, tensor, weight_map)
        except ValueError:
            unnamed.append(name)
            continue
        renamed.update({prefix + hf: value for hf, value in split.items()})
    skip = set(renamed) | {prefix + weight_map.to_hf(n) for n in dropped}
    absent = sorted(set(renamed) - set(files))
    problems = []
    if unnamed:
        problems.append(f"parameters with no Hugging Face name: {_few(unnamed)}")
    if absent:
        problems.append(f"tensors the folder does not hold: {_few(absent)}")
    out: dict[str, torch.Tensor] = {}
    grouped: dict[Path, list[str]] = {}
    for name, file in files.items():
        grouped.setdefault(file, []).append(name)
    wrong = []
    for file, names in grouped.items():
        with open_safetensors(file) as handle:
            for name in names:
                if name not in skip:
                    out[name] = handle.get_tensor(name)
                elif name in renamed:
                    value, like = renamed[name], handle.get_slice(name)
                    shape, vocab = tuple(like.get_shape()), _is_vocab(name, prefix, weight_map)
                    if tuple(value.shape) != shape and not (vocab and value.shape[1:] == shape[1:]):
                        wrong.append(f"{name} {list(value.shape)} (folder {list(shape)})")
                    out[name] = value.to(_dtype(like.get_dtype())).contiguous()
    if wrong:
        problems.append(f"wrong shapes: {_few(wrong)}")
    if problems:
        raise ValueError(f"module {module!r} does not match its hf_path checkpoint: "
                         + "; ".join(problems))
    return out


def _is_vocab(hf_name: str, prefix: str, weight_map: WeightMap) -> bool:
    return weight_map.from_hf(hf_name[len(prefix):]) in (EMBED, HEAD)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}


def _dtype(safetensors_dtype: str) -> torch.dtype:
    """A safetensors header dtype (``"BF16"``) as a torch dtype."""
    if safetensors_dtype not in _DTYPES:
        raise ValueError(f"a Hugging Face tensor of dtype {safetensors_dtype} cannot be "
                         f"exported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[safetensors_dtype]


def _few(names: Sequence[str], shown: int = 8) -> str:
    names = sorted(names)
    more = f", ... and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in (SINGLE_FILE, INDEX_FILE)


def is_tokenizer_file(name: str) -> bool:
    """Whether a top-level file of a Hugging Face folder belongs to its tokenizer.

    ``tokenizer.json``, ``tokenizer_config.json``, ``tokenizer.model``, vocabularies and
    merges, added and special tokens, chat templates, SentencePiece / tiktoken models.
    """
    return (name.startswith("tokenizer") or name in _TOKENIZER_NAMES
            or name.endswith(_TOKENIZER_SUFFIXES))


def copy_files(source: Path, target: ExportFolder, prefix: str,
                keep: Callable[[str], bool] = lambda name: True) -> list[Path]:
    """Copy the top-level non-weight files of ``source`` (config, generation config, ...)
    that ``keep`` accepts to ``prefix<name>`` in the export folder; the files written."""
    written = []
    for file in sorted(source.iterdir()):
        if file.is_file() and not _is_weight_file(file.name) and keep(file.name):
            written.append(target.file(prefix + file.name))
            shutil.copyfile(file, written[-1])
    return written


def write_tokenizer(tokenizer: Any, target: ExportFolder, prefix: str) -> list[Path]:
    """The tokenizer folder's tokenizer files, then (placeholders added) the tokenizer as
    trained; the files written.

    Only tokenizer files (:func:`is_tokenizer_file`): ``data.tokenizer`` is often the
    language model's own folder, whose ``config.json`` must not replace the export's.
    A template that replaced the folder's (``data.chat_template``) is saved with the
    tokenizer, and the folder's template files are not copied: a processor would read a
    stale ``chat_template.json`` before the saved ``chat_template.jinja``.
    """
    replaced = bool(getattr(tokenizer, "template_replaced", False))
    written = copy_files(Path(tokenizer.path), target, prefix, keep=lambda name: (
        is_tokenizer_file(name) and not (replaced and name in _TEMPLATE_NAMES)))
    if tokenizer.num_added or replaced:
        # save_pretrained picks its own file names: saved aside, then each one recorded.
        with tempfile.TemporaryDirectory(prefix="mimotron-tokenizer-") as temp:
            tokenizer.tokenizer.save_pretrained(temp)
            for file in copy_files(Path(temp), target, prefix, keep=is_tokenizer_file):
                if file not in written:
                    written.append(file)
    return written
