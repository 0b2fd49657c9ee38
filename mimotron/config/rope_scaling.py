"""Which rotary-embedding scalings a Hugging Face decoder may use, checked from its
config.json: ``default``, ``linear`` and ``llama3`` (the formulas are in
:mod:`mimotron.models.rope_scaling`; ``dynamic``, ``yarn``, ``longrope`` and others are
refused, not approximated)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# rope_type -> keys it needs besides rope_type.
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
SUPPORTED_ROPE_TYPES = tuple(_REQUIRED)


def validate_rope_scaling(scaling: Mapping[str, Any], where: str = "rope_scaling") -> dict:
    """Check a scaling dict and return a normalised copy (``rope_type`` always set).

    Args:
        scaling: ``{"rope_type": ..., <its parameters>}``; the legacy key ``type`` is
            accepted for ``rope_type``. Other keys (``rope_theta``) are kept unchanged.
        where: the config key named in error messages.

    Returns:
        A new dict with ``rope_type`` set and the numeric parameters as floats/ints.

    Raises:
        ValueError: an unsupported ``rope_type``, a missing parameter, or a
            ``partial_rotary_factor`` other than 1.
    """
    out = dict(scaling)
    legacy = out.pop("type", None)
    rope_type = out.get("rope_type") or legacy or "default"
    out["rope_type"] = rope_type
    if rope_type not in _REQUIRED:
        raise ValueError(
            f"{where}.rope_type={rope_type!r} is not supported; expected one of "
            f"{list(SUPPORTED_ROPE_TYPES)}"
        )
    missing = [k for k in _REQUIRED[rope_type] if out.get(k) is None]
    if missing:
        raise ValueError(f"{where} of rope_type {rope_type!r} lacks {missing}")
    partial = out.get("partial_rotary_factor", 1.0)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(
            f"{where}.partial_rotary_factor={partial} is not supported; expected 1.0"
        )
    return out
