"""Types and ranges of the ``config.json`` values the Hugging Face families read.

The family readers (:mod:`~mimotron.config.hf_specs`) convert with ``int()`` /
``float()``, which would take ``"128"``, truncate ``128.5`` and keep ``NaN``; a zero head
count divides by zero later, and a size of ten million layers only shows as a hang. So
before a family reads a folder, :func:`check_hf_config` checks every value it will read:
sizes are positive integers (JSON booleans and floats are not), epsilons and RoPE bases
are finite positive numbers, head counts divide the width and key/value heads divide the
query heads. The first bad value is one line naming the file, the key, the value and what
is valid.
Sizes are bounded only loosely here (:data:`MAX_SIZE`); the model's parameter count is
bounded against the machine by :mod:`mimotron.config.limits`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mimotron.config.hf_specs import SUPPORTED_MODEL_TYPES

MAX_SIZE = 2**40
"""No size in any real checkpoint comes near this; beyond it the arithmetic is the risk."""

# Keys that must be positive integers when present, per family (after defaults).
_LLAMA_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size")
_LLAMA_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings",
                   "moe_intermediate_size", "decoder_sparse_step", "num_experts_per_tok")
_LLAMA_COUNTS = ("num_experts", "num_local_experts", "shared_expert_intermediate_size")
_VISION_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_channels", "image_size", "patch_size")
_WHISPER_SIZES = ("d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
                  "num_mel_bins", "max_source_positions")
_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta")
_VISION_TYPES = {"clip": "clip", "siglip": "siglip"}


def _fail(file: Path, key: str, value: Any, valid: str) -> None:
    raise ValueError(f"{file}: {key}={value!r} is invalid: expected {valid}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(file: Path, table: dict[str, Any], key: str, prefix: str = "") -> None:
    value = table.get(key)
    if value is None:
        return  # Absent: the family's default applies (or it reports the missing key).
    if not _is_int(value) or not 1 <= value <= MAX_SIZE:
        _fail(file, f"{prefix}{key}", value, f"an integer in [1, {MAX_SIZE}]")


def _count(file: Path, table: dict[str, Any], key: str) -> None:
    value = table.get(key)
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_SIZE):
        _fail(file, key, value, f"an integer in [0, {MAX_SIZE}]")


def _positive_float(file: Path, table: dict[str, Any], key: str, prefix: str = "") -> None:
    value = table.get(key)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        _fail(file, f"{prefix}{key}", value, "a finite number > 0")


def _divides(file: Path, table: dict[str, Any], part: str, whole: str, prefix: str = ""
             ) -> None:
    """``table[part]`` divides ``table[whole]`` (both already checked, when present)."""
    p, w = table.get(part), table.get(whole)
    if p is not None and w is not None and w % p:
        _fail(file, f"{prefix}{part}", p, f"a divisor of {whole}={w}")


def _check_llama(file: Path, config: dict[str, Any]) -> None:
    for key in (*_LLAMA_SIZES, *_LLAMA_OPTIONAL):
        _positive_int(file, config, key)
    for key in _LLAMA_COUNTS:
        _count(file, config, key)
    for key in _POSITIVE_FLOATS:
        _positive_float(file, config, key)
    # Without head_dim the head width is hidden_size // heads: it must be exact.
    if config.get("head_dim") is None and config.get("model_type") != "qwen3":
        _divides(file, config, "num_attention_heads", "hidden_size")
    _divides(file, config, "num_key_value_heads", "num_attention_heads")
    top_k, experts = config.get("num_experts_per_tok"), (
        config.get("num_local_experts") or config.get("num_experts"))
    if top_k is not None and experts and top_k > experts:
        _fail(file, "num_experts_per_tok", top_k, f"<= the number of experts ({experts})")
    dense = config.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or not all(map(_is_int, dense))):
        _fail(file, "mlp_only_layers", dense, "a list of layer indices")
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if isinstance(params, dict):
            for name in ("rope_theta", "factor"):
                _positive_float(file, params, name, prefix=f"{key}.")


def _check_vision(file: Path, config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    sub, prefix = config, ""
    if model_type in _VISION_TYPES and isinstance(config.get("vision_config"), dict):
        sub, prefix = config["vision_config"], "vision_config."
    for key in _VISION_SIZES:
        _positive_int(file, sub, key, prefix)
    _positive_float(file, sub, "layer_norm_eps", prefix)
    _divides(file, sub, "num_attention_heads", "hidden_size", prefix)
    _divides(file, sub, "patch_size", "image_size", prefix)


def _check_whisper(file: Path, config: dict[str, Any]) -> None:
    for key in _WHISPER_SIZES:
        _positive_int(file, config, key)
    _divides(file, config, "encoder_attention_heads", "d_model")


def check_hf_config(folder: str | Path, config: dict[str, Any]) -> None:
    """Check the values a family will read from a folder's parsed ``config.json``.

    The family is chosen by ``model_type``; an unknown one is left to the family lookup
    (which names the types it takes).

    Args:
        folder: the ``hf_path`` folder (for the message).
        config: its parsed ``config.json``.

    Raises:
        ValueError: ``<folder>/config.json: <key>=<value> is invalid: expected ...``.
    """
    file = Path(folder) / "config.json"
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        _check_llama(file, config)
    elif model_type == "whisper":
        _check_whisper(file, config)
    elif isinstance(model_type, str) and model_type.split("_")[0] in _VISION_TYPES:
        _check_vision(file, config)
