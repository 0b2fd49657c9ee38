"""A ``[modules.<m>]`` table with ``hf_path``: its family and sizes, read from config.json.

Config validation calls :func:`resolve_hf_module` for every module with an ``hf_path``:
it reads the folder's ``config.json`` (headers only, no tensor data), picks the family
from ``model_type`` (``language`` -> Llama / Qwen2 / Qwen3, ``vit`` -> CLIP / SigLIP,
``audio`` -> Whisper) and writes the checkpoint's sizes into the module's size keys, so
everything that reads them before any model exists (layout checks, the data's input
shapes and placeholder counts, ``mimotron plan``, FLOP and memory estimates) sees the
real model. A size key that contradicts ``config.json`` is a ``ValueError`` naming both
values. A folder's config.json is read once per config load: the checks pass an
:class:`~mimotron.config.hf_folder.HFConfigs` (or the parsed ``config``) down; a call
without one reads the file. The family readers come from the model-free
:mod:`~mimotron.config.hf_specs`: this runs in the launcher of ``mimotron train``, which
never imports the models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from mimotron.config.hf_check import check_hf_config
from mimotron.config.hf_folder import HFConfigs, read_hf_config
from mimotron.config.hf_specs import (
    SUPPORTED_MODEL_TYPES,
    LlamaFamilySpec,
    clip_tower_args,
    siglip_tower_args,
    used_layers,
    whisper_tower_args,
)
from mimotron.config.hf_vlm import (
    NATIVE_MODEL_TYPES,
    is_native_config,
    is_vlm_config,
    vlm_module_options,
    vlm_part_config,
)
from mimotron.config.native_vision import native_vision
from mimotron.config.qwen_vl_vision import qwen3_vision_args, qwen25_vision_args
from mimotron.config.schema import ModuleConfig

# model_type -> family, per module kind.
_FAMILIES: dict[str, dict[str, str]] = {
    "language": {t: "llama" for t in SUPPORTED_MODEL_TYPES},
    "vit": {"clip": "clip", "clip_vision_model": "clip", "siglip": "siglip",
            "siglip_vision_model": "siglip", "qwen2_5_vl_vision": "qwen2_5_vl",
            "qwen3_vl_vision": "qwen3_vl"},
    "audio": {"whisper": "whisper"},
}
_NATIVE_ARGS = {"qwen2_5_vl": qwen25_vision_args, "qwen3_vl": qwen3_vision_args}


def module_hf_config(mod: ModuleConfig) -> dict[str, Any]:
    """``mod.hf_path``'s config.json (the module's part of it, for a vision-language
    folder: :func:`~mimotron.config.hf_vlm.vlm_part_config`): the one recorded when the
    module was resolved (:func:`resolve_hf_module`), else read from the file.

    Raises:
        ValueError: as :func:`~mimotron.config.hf_folder.read_hf_config`.
    """
    recorded = mod.hf_config
    if recorded is not None and recorded[0] == mod.hf_path:
        return recorded[1]
    return part_config(read_hf_config(mod.hf_path), mod.kind)


def part_config(config: dict[str, Any], kind: str) -> dict[str, Any]:
    """``config`` itself, or a module of ``kind``'s part of a vision-language folder's.

    Raises:
        ValueError: as :func:`~mimotron.config.hf_vlm.vlm_part_config`.
    """
    return vlm_part_config(config, kind) if is_vlm_config(config) else config


def hf_family(mod: ModuleConfig, where: str = "module", config: dict[str, Any] | None = None
              ) -> str:  # fmt: skip
    """``"llama"``, ``"clip"``, ``"siglip"`` or ``"whisper"``: the family of ``mod.hf_path``.

    Args:
        mod: a module with ``hf_path``.
        where: the module's key prefix, for messages.
        config: its parsed config.json (``None``: :func:`module_hf_config`).

    Raises:
        ValueError: missing folder or config.json, or a ``model_type`` the kind cannot take.
    """
    config = module_hf_config(mod) if config is None else config
    families = _FAMILIES.get(mod.kind, {})
    model_type = config.get("model_type")
    if model_type not in families:
        raise ValueError(
            f"{where}.hf_path={mod.hf_path!r} holds model_type={model_type!r}, which "
            f"kind={mod.kind!r} cannot load; expected one of {sorted(families)}"
        )
    return families[model_type]


def language_spec(mod: ModuleConfig, config: dict[str, Any] | None = None) -> LlamaFamilySpec:
    """The decoder spec of a ``language`` module's ``hf_path`` (``config``: its parsed
    config.json, ``None``: :func:`module_hf_config`)."""
    return LlamaFamilySpec.from_hf_config(module_hf_config(mod) if config is None
                                          else config)  # fmt: skip


def tower_kwargs(mod: ModuleConfig, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constructor arguments of an encoder tower (architecture + the module's options;
    ``config``: its parsed config.json, ``None``: :func:`module_hf_config`)."""
    config = module_hf_config(mod) if config is None else config
    family = hf_family(mod, config=config)
    if family == "whisper":
        return {**whisper_tower_args(config),
                "downsample_factor": mod.downsample_factor,
                "downsample_mode": mod.downsample_mode}
    if family in NATIVE_MODEL_TYPES:  # the merger is the tower's: no feature selection
        return dict(_NATIVE_ARGS[family](config))
    read = clip_tower_args if family == "clip" else siglip_tower_args
    return {**read(config), "vision_feature_layer": mod.vision_feature_layer,
            "vision_feature_select_strategy": mod.vision_feature_select_strategy}


def has_class_token(path: str, config: dict[str, Any] | None = None) -> bool:
    """Whether the vision tower at ``path`` has a class token (CLIP does, SigLIP not;
    ``config``: its parsed config.json, ``None``: read here)."""
    config = read_hf_config(path) if config is None else config
    return config.get("model_type") in ("clip", "clip_vision_model")


def head_counts(mod: ModuleConfig) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)`` of an HF module (encoders: kv = query heads)."""
    if mod.is_language:
        spec = language_spec(mod)
        return spec.num_heads, spec.num_kv_heads
    return mod.num_heads, mod.num_heads


def tied_embeddings(mod: ModuleConfig) -> bool:
    """Whether an HF language model ties its output head to the embedding."""
    return mod.is_language and language_spec(mod).tie_word_embeddings


def hf_sizes(mod: ModuleConfig, config: dict[str, Any] | None = None) -> dict[str, int]:
    """The module's size keys as the folder's config.json gives them (``config``: parsed,
    ``None``: :func:`module_hf_config`).

    Raises:
        ValueError: as :func:`hf_family`, or an unsupported / inconsistent config.json.
    """
    config = module_hf_config(mod) if config is None else config
    if mod.is_language:
        spec = language_spec(mod, config)
        return {"hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                "num_heads": spec.num_heads, "ffn_hidden_size": spec.intermediate_size}
    args = tower_kwargs(mod, config)
    if mod.kind == "audio":
        positions = int(args["max_source_positions"])
        if mod.downsample_factor < 1 or positions % mod.downsample_factor:
            raise ValueError(f"downsample_factor={mod.downsample_factor} is invalid: expected a "
                             f"divisor of max_source_positions={positions}")
        return {"hidden_size": args["d_model"], "num_layers": args["encoder_layers"],
                "num_heads": args["encoder_attention_heads"],
                "ffn_hidden_size": args["encoder_ffn_dim"],
                "num_freq_bins": args["num_mel_bins"], "num_frames": 2 * positions,
                "num_audio_tokens": positions // mod.downsample_factor}
    if hf_family(mod, config=config) in NATIVE_MODEL_TYPES:
        return {"hidden_size": args["hidden_size"], "num_layers": args["depth"],
                "num_heads": args["num_heads"], "ffn_hidden_size": args["intermediate_size"],
                "patch_size": args["patch_size"], "in_channels": args["in_channels"]}
    return {"hidden_size": args["hidden_size"],
            "num_layers": used_layers(args["num_hidden_layers"], mod.vision_feature_layer),
            "num_heads": args["num_attention_heads"], "ffn_hidden_size": args["intermediate_size"],
            "image_size": args["image_size"], "patch_size": args["patch_size"],
            "in_channels": args["num_channels"]}


def resolve_hf_module(name: str, mod: ModuleConfig, explicit: Iterable[str] | None = None,
                      configs: HFConfigs | None = None) -> None:
    """Check ``mod``'s size keys against its ``hf_path`` and fill them in, in place.

    Args:
        name: the module name (for messages).
        mod: a module config with ``hf_path`` set.
        explicit: keys the TOML table set; ``None`` = every key whose value differs from
            its default (a config built in code).
        configs: the config.json reader of this load (``None``: read the file).

    Raises:
        ValueError: missing folder, a family the kind cannot take, an invalid option, or
            a size key contradicting config.json (both values named).
    """
    where = f"modules.{name}"
    try:
        folder_config = (configs or HFConfigs()).read(mod.hf_path)
        config = part_config(folder_config, mod.kind)
        check_hf_config(mod.hf_path, config)  # Before any int() of it.
        hf_family(mod, where, config)
        if is_vlm_config(folder_config) and mod.kind == "vit":
            # The folder fixes the feature selection and the projector: set them before
            # the sizes are read (the tower's layer count follows the feature layer).
            _fill(where, mod, vlm_module_options(folder_config), explicit)
        sizes = hf_sizes(mod, config)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") from exc
    _fill(where, mod, sizes, explicit)
    mod.hf_config = (mod.hf_path, config)  # later readers use it, not the file
    if mod.kind == "vit":
        mod.hf_class_token = has_class_token(mod.hf_path, config)
    if mod.kind == "vit" and is_native_config(config):
        mod.hf_native = native_vision(str(folder_config["model_type"]), tower_kwargs(mod, config),
                                      mod.hf_path, mod.max_pixels, where)


def _fill(where: str, mod: ModuleConfig, values: dict[str, Any],
          explicit: Iterable[str] | None) -> None:
    """Set ``mod``'s keys to the folder's ``values``; a key the config set to another
    value is a ``ValueError`` naming both (``explicit``: as :func:`resolve_hf_module`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(mod)}
    given = set(explicit) if explicit is not None else {
        k for k in values if getattr(mod, k) != defaults[k]}
    for key, value in values.items():
        current = getattr(mod, key)
        if key in given and current != value:
            raise ValueError(
                f"{where}.{key}={current!r} contradicts config.json in hf_path "
                f"{mod.hf_path!r}, which gives {value!r}; remove the key or set it to {value!r}"
            )
        setattr(mod, key, value)
