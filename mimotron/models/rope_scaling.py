"""Rotary-embedding frequencies of the Hugging Face decoders: default, linear, llama3.

A scaling is a plain dict in the shape of a ``transformers`` ``rope_parameters`` entry
(``{"rope_type": "llama3", "factor": 8.0, ...}``), so a later TOML key or a
``config.json`` maps onto it directly. The formulas follow ``transformers``'
``modeling_rope_utils`` (``ROPE_INIT_FUNCTIONS`` and the models' default) operation by
operation, on the CPU in fp32, so a model built from a Hugging Face config rotates
exactly like the ``transformers`` one. The three types supported all have an attention
scaling of 1 (``dynamic``, ``yarn``, ``longrope`` and others change ``cos``/``sin`` by
position or length and are refused, not approximated).

The toy model does not use this module: its ``rope_scaling`` is ``None`` and it keeps
:func:`mimotron.models.blocks.rope_cache`'s own formula bitwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mimotron.config.rope_scaling import validate_rope_scaling


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32, CPU) as ``transformers`` computes them.

    Args:
        head_dim: per-head width (even).
        theta: RoPE base (``rope_theta``).
        scaling: a dict accepted by :func:`validate_rope_scaling`.

    Returns:
        The inverse frequencies.

    Raises:
        ValueError: on an odd ``head_dim`` or an unsupported scaling.
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    params = validate_rope_scaling(scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (float(theta) ** exponents)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3(inv_freq, params)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (long wavelengths / factor, smooth between)."""
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
