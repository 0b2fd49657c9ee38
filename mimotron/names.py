"""Names shared across layers: one definition for each, imported everywhere.

A string that two files must agree on lives here: the module every model has, the
parameter-name prefixes of ``MimoModel`` (checkpoints and exports key on them), and the grid
axes in Megatron's rank order.
"""

from __future__ import annotations

LANGUAGE = "language"
"""The language module's name: every config has exactly one module of this name."""

LANGUAGE_MODEL_PREFIX = "language_model."
"""Prefix of the language model's parameter names inside ``MimoModel``."""

ENCODER_PREFIX = "modality_submodules."
"""Prefix of an encoder's parameter names inside ``MimoModel`` (then ``<module>.``)."""

TP_AXIS, CP_AXIS, DP_AXIS, PP_AXIS = "tp", "cp", "dp", "pp"
GRID_AXES = (TP_AXIS, CP_AXIS, DP_AXIS, PP_AXIS)
"""A module's grid axes, fastest first: neighbouring ranks are tensor-parallel peers."""


def module_prefix(module: str) -> str:
    """The prefix of ``module``'s parameter names inside ``MimoModel``."""
    return LANGUAGE_MODEL_PREFIX if module == LANGUAGE else f"{ENCODER_PREFIX}{module}."

