"""Run configuration: dataclasses, TOML loading, ``key=value`` overrides, validation.

One TOML file describes a run (docs/design.md, "Configuration"). Overrides are dotted
paths whose values are parsed as TOML (``train.iters=5``,
``optimizer.betas=[0.9,0.95]``); a value that is not valid TOML is taken as a string
(``train.precision=bf16``). Unknown keys are rejected with the list of valid ones.
Every check is :func:`mimotron.config.validation.validate_config` (the layer above this
module's schema and the models), which raises ``ValueError`` naming the field, the bad
value and what would be valid; :func:`load_config` runs it, reading each Hugging Face
folder's ``config.json`` once. Layout rules that involve several modules live in
:mod:`mimotron.parallel.layout`.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from mimotron.config.hf_vlm import expand_vlm_modules
from mimotron.config.schema import (
    MimoConfig,
    ModuleConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from mimotron.config.validation import (
    HFConfigs,
    resolve_module,
    validate_config,
)
from mimotron.names import LANGUAGE

__all__ = [
    "apply_override",
    "config_from_dict",
    "load_config",
    "parse_override",
]


# ---- loading ----------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> MimoConfig:
    """Read a TOML file (or start from defaults), apply ``key=value`` overrides, validate.

    Args:
        path: TOML file; ``None`` starts from an empty table (defaults only).
        overrides: dotted ``key=value`` strings; values are parsed as TOML.

    Returns:
        The validated config.

    Raises:
        ValueError: unknown key, wrong type, or an invalid value (the message names it).
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_toml(Path(path))
    for item in overrides or []:
        apply_override(raw, item)
    hf = HFConfigs()  # each Hugging Face folder's config.json read once for this load
    return validate_config(config_from_dict(raw, hf), hf)


def _read_toml(path: Path) -> dict[str, Any]:
    """The table of a TOML file; ValueError saying what is wrong with the path or text."""
    name = repr(str(path))
    if path.is_dir():
        raise ValueError(f"config file {name} is a directory: expected a TOML file")
    if not path.exists():
        raise ValueError(f"config file {name} does not exist")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"config file {name} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(f"config file {name} is not UTF-8 text (TOML must be): byte "
                         f"0x{data[exc.start]:02x} on line {line}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {name} is not valid TOML: {exc}") from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into the key path and the TOML-parsed value."""
    if "=" not in item:
        raise ValueError(f"override {item!r} is invalid: expected key=value, e.g. train.iters=10")
    key, text = item.split("=", 1)
    keys = key.strip().split(".")
    if not all(keys):
        raise ValueError(f"override {item!r} is invalid: empty key segment in {key!r}")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # Not TOML: take it as a string (train.precision=bf16).
    return keys, value


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set one dotted ``key=value`` into a raw config dict, creating tables as needed."""
    keys, value = parse_override(item)
    node = raw
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {item!r} is invalid: {k!r} is not a table")
    node[keys[-1]] = value


def config_from_dict(raw: dict[str, Any], hf: HFConfigs | None = None) -> MimoConfig:
    """Build a ``MimoConfig`` from a nested dict, rejecting unknown keys and wrong types.

    Args:
        raw: the TOML table with overrides applied.
        hf: the config.json reader of this load (``None``: a fresh one); a Hugging Face
            module's sizes are filled in from its folder.
    """
    hf = hf if hf is not None else HFConfigs()
    raw = copy.deepcopy(raw)
    if raw.get("hf_path"):  # one vision-language folder: its modules' tables
        path = raw["hf_path"]
        if not isinstance(path, str):
            raise ValueError(f"hf_path={path!r} is invalid: expected a folder path (a string)")
        expand_vlm_modules(raw, hf.read(path).get("model_type"))
    modules = raw.pop("modules", {})
    if not isinstance(modules, dict):
        raise ValueError("modules is invalid: expected tables [modules.<name>]")
    cfg = _build(MimoConfig, raw, "")
    for name, table in modules.items():
        if not isinstance(table, dict):
            raise ValueError(f"modules.{name} is invalid: expected a table")
        cfg.modules[name] = _build(ModuleConfig, table, f"modules.{name}.")
        resolve_module(name, cfg.modules[name], table, hf)
        _check_override_keys(cfg.modules[name].optimizer, f"modules.{name}.optimizer")
    _data_defaults(cfg, raw.get("data") or {})
    return cfg


def _data_defaults(cfg: MimoConfig, table: dict[str, Any]) -> None:
    """Defaults that depend on other keys, filled in once so the recorded config has them.

    A LLaVA run without ``data.tokenizer`` reads the language model's folder
    (``modules.language.hf_path``); with ``data.valid_path`` and no ``data.train_fraction``
    the whole of ``data.path`` trains (1.0 instead of 0.8).
    """
    d = cfg.data
    language = cfg.modules.get(LANGUAGE)
    if d.dataset == "llava" and not d.tokenizer and language is not None:
        d.tokenizer = getattr(language, "hf_path", "") or ""
    if d.valid_path and "train_fraction" not in table:
        d.train_fraction = 1.0


def _check_override_keys(over: dict[str, Any], p: str) -> None:
    valid = {f.name for f in dataclasses.fields(OptimizerConfig)}
    valid |= {f.name for f in dataclasses.fields(SchedulerConfig)} - {"min_lr"}
    for key in over:
        if key not in valid:
            raise ValueError(f"unknown key {p}.{key}; valid keys: {', '.join(sorted(valid))}")
        # Type-check through the dataclass that owns the key.
        optimizer_keys = {f.name for f in dataclasses.fields(OptimizerConfig)}
        owner = OptimizerConfig if key in optimizer_keys else SchedulerConfig
        _build(owner, {key: over[key]}, f"{p}.")


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            raise ValueError(
                f"unknown key {prefix}{key}; valid keys: {', '.join(sorted(fields))}"
            )
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is invalid: expected a table")
        return _build(hint, value, f"{name}.")
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if isinstance(value, list | dict) or value not in choices:
            raise ValueError(f"{name}={value!r} is invalid: expected one of {choices}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        # The first alternative that takes the value (``int | list[int]``, ``bool |
        # Literal[...]``); else the first alternative's error, naming the choices too.
        for alt in args[1:]:
            cls = typing.get_origin(alt) or alt
            if cls is typing.Literal:
                if isinstance(value, str) and value in typing.get_args(alt):
                    return value
            elif isinstance(cls, type) and isinstance(value, cls):
                return _coerce(alt, value, name)
        choices = [c for alt in args if typing.get_origin(alt) is typing.Literal
                   for c in typing.get_args(alt)]
        try:
            return _coerce(args[0], value, name)
        except ValueError as exc:
            if not choices:
                raise
            raise ValueError(f"{exc} or one of {tuple(choices)}") from None
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name}={value!r} is invalid: expected a list")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, name) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} is invalid: expected a table")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{name}={value!r} is invalid: expected a finite number "
                             "(not inf or nan)") from None
    if hint in (int, str, bool, float) and (
        not isinstance(value, hint) or (hint is int and isinstance(value, bool))
    ):
        raise ValueError(f"{name}={value!r} is invalid: expected {hint.__name__}")
    return value
