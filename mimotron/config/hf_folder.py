"""A local Hugging Face model folder: its ``config.json`` and where each tensor is stored.

Only local folders are read, never a hub id: a path that is not an existing directory
is an error naming it, so a typo can never turn into a download. Weights must be
safetensors, either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file).
Nothing here reads tensor data; :mod:`mimotron.models.hf.weights` does, slice by slice.
Before any rank starts, :func:`check_hf_weight_files` checks the header of every weight
file a folder holds (:mod:`mimotron.config.hf_files`).

The helpers at the end read the parsed ``config.json`` dict the way every family needs:
pick a tower's part of a full model's config, apply ``transformers``' defaults, and
refuse options mimotron does not implement.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from mimotron.config.hf_files import check_safetensors, open_safetensors
from mimotron.config.schema import MimoConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def hf_folder(path: str | Path) -> Path:
    """The folder as a ``Path``, checked to exist locally.

    Args:
        path: a local directory holding a Hugging Face checkpoint.

    Returns:
        The path.

    Raises:
        ValueError: if ``path`` is not an existing directory.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"hf_path {str(path)!r} is not an existing directory; mimotron reads local "
            "Hugging Face folders only (config.json + *.safetensors) and never downloads"
        )
    return folder


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a local Hugging Face folder.

    Raises:
        ValueError: missing folder, missing or unparsable ``config.json``.
    """
    file = hf_folder(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"hf_path {str(path)!r} has no config.json")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


class HFConfigs:
    """Each Hugging Face folder's ``config.json``, read once per instance.

    One instance per config load (:func:`mimotron.config.load_config`), handed to every
    check that reads a folder's config.json; nothing is kept between loads (a folder
    changed since is read afresh next time). Callers get a copy they may change.
    """

    def __init__(self) -> None:
        self._by_path: dict[str, dict[str, Any]] = {}

    def read(self, path: str | Path) -> dict[str, Any]:
        """:func:`read_hf_config` of ``path``, from the file the first time only.

        Raises:
            ValueError: as :func:`read_hf_config` (not kept: asked again, read again).
        """
        key = str(path)
        if key not in self._by_path:
            self._by_path[key] = read_hf_config(path)
        return copy.deepcopy(self._by_path[key])


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the safetensors file holding it.

    Reads only file headers (the index, or the single file's tensor names).

    Args:
        path: the local folder.

    Returns:
        ``{tensor name: file}``.

    Raises:
        ValueError: no safetensors weights, an unreadable index, or an index that names
            a shard file which is not there.
    """
    folder = hf_folder(path)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index with a weight_map") from exc
        files = {name: folder / shard for name, shard in weight_map.items()}
        absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if absent:
            raise ValueError(f"{index} names shard files that are not in the folder: {absent}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        with open_safetensors(single) as handle:
            return {name: single for name in handle.keys()}  # noqa: SIM118 - not a dict
    raise ValueError(
        f"hf_path {str(path)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; only "
        "safetensors weights are read (convert pytorch_model.bin with transformers first)"
    )


def check_weight_files(folder: str | Path) -> None:
    """Check every safetensors file a Hugging Face folder names (headers only).

    The single ``model.safetensors``, or each shard the index lists. A folder with
    neither is left to the weight loader, which says what it expects.

    Args:
        folder: the ``hf_path`` folder.

    Raises:
        ValueError: the first malformed file, or an unreadable index, named.
    """
    root = hf_folder(folder)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError,
                UnicodeDecodeError) as exc:
            raise ValueError(f"{index} is not a safetensors index with a weight_map") from exc
        files = [root / str(s) for s in shards]
    else:
        files = [root / SINGLE_FILE]
    for file in files:
        if file.is_file():  # A missing shard is named by the loader's own check.
            check_safetensors(file)


def check_hf_weight_files(cfg: MimoConfig) -> None:
    """:func:`check_weight_files` for every module with an ``hf_path``, before launch.

    Raises:
        ValueError: ``modules.<m>: <file> is not a valid safetensors file: ...``.
    """
    for name, mod in cfg.modules.items():
        if mod.hf_path:
            try:
                check_weight_files(mod.hf_path)
            except ValueError as exc:
                raise ValueError(f"modules.{name}: {exc}") from None


def select_config(
    config: dict[str, Any], own_types: tuple[str, ...], full_types: tuple[str, ...], sub_key: str
) -> dict[str, Any]:
    """The tower's own config: ``config`` itself, or ``config[sub_key]`` of a full model.

    Args:
        config: the parsed ``config.json``.
        own_types: ``model_type`` values of the tower's own config (``clip_vision_model``).
        full_types: ``model_type`` values of a full model holding it (``clip``).
        sub_key: the key of the nested tower config in a full model (``vision_config``).

    Returns:
        The tower's config dict.

    Raises:
        ValueError: a ``model_type`` of another family.
    """
    model_type = config.get("model_type")
    if model_type in own_types:
        return config
    if model_type in full_types:
        sub = config.get(sub_key)
        if not isinstance(sub, dict):
            raise ValueError(f"config.json of model_type={model_type!r} has no {sub_key!r} dict")
        return sub
    raise ValueError(
        f"config.json model_type={model_type!r} is not supported here; expected one of "
        f"{sorted(own_types + full_types)}"
    )


def read_keys(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` overridden by the values ``config`` sets (the ``transformers`` defaults).

    Args:
        config: the tower's config dict.
        defaults: key -> the value ``transformers`` uses when the key is absent.

    Returns:
        key -> value for every key of ``defaults``.
    """
    return {key: config.get(key, default) for key, default in defaults.items()}


def reject_set(config: dict[str, Any], keys: tuple[str, ...], why: str) -> None:
    """Raise ``ValueError`` naming the first of ``keys`` that ``config`` sets to a truthy value.

    Args:
        config: the tower's config dict.
        keys: options mimotron does not implement (dropout rates, layer drop, ...).
        why: what would be valid, for the message.

    Raises:
        ValueError: one of ``keys`` is set (non-zero, non-empty, True).
    """
    for key in keys:
        if config.get(key):
            raise ValueError(f"config.json {key}={config[key]!r} is not supported; {why}")


PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"


def preprocessor_file(path: str | Path) -> Path | None:
    """The file holding a folder's input preprocessing, or ``None``.

    ``preprocessor_config.json``, or else ``processor_config.json``: transformers 5
    saves a multimodal processor (``LlavaProcessor``) as that one file, with the image
    processor's settings under ``"image_processor"``.
    """
    for name in (PREPROCESSOR_FILE, PROCESSOR_FILE):
        file = Path(path) / name
        if file.is_file():
            return file
    return None


def read_preprocessor_config(path: str | Path) -> dict[str, Any]:
    """The image (or audio) preprocessing settings of a local folder
    (:func:`preprocessor_file`; of a ``processor_config.json``, its ``image_processor``
    or ``feature_extractor`` table).

    Raises:
        ValueError: neither file, a file that is not a JSON object, or a processor file
            without such a table (each names the file).
    """
    file = preprocessor_file(path)
    if file is None:
        raise ValueError(f"{str(Path(path) / PREPROCESSOR_FILE)!r} is missing: expected a "
                         "local Hugging Face preprocessor_config.json (or a transformers 5 "
                         "processor_config.json; nothing is downloaded)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{str(file)!r} is not a JSON object: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} is not a JSON object")
    if file.name == PREPROCESSOR_FILE:
        return config
    for key in ("image_processor", "feature_extractor"):
        if isinstance(config.get(key), dict):
            return dict(config[key])
    raise ValueError(f"{str(file)!r} holds no 'image_processor' or 'feature_extractor' table")

