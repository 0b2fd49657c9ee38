"""Models: transformer blocks, modality encoders, the decoder LM, and ``MimoModel``.

Batch format consumed by :class:`MimoModel` (produced by :mod:`mimotron.data`): a dict
with ``tokens`` Long[B, S] (padded with 0), ``labels`` Long[B, S] (next-token targets),
``loss_mask`` Float[B, S], and per modality the input (``image`` Float[B, 1, 8, 8],
``audio`` Float[B, 129, 16]; zeros where absent) plus ``has_<modality>`` Bool[B].

The names below are loaded on first use, so importing one submodule (the config checks
import :mod:`~mimotron.models.moe`; the launcher of ``mimotron train`` runs them) does not
import every model and DTensor with it.
"""

from __future__ import annotations

from mimotron.lazy import lazy_getattr

# Public name -> defining module. A constant table, read only.
_EXPORTS = {
    "Attention": "mimotron.models.blocks",
    "AudioEncoder": "mimotron.models.encoders",
    "GroupedExperts": "mimotron.models.moe",
    "LanguageModel": "mimotron.models.language",
    "LocalDispatcher": "mimotron.models.moe",
    "MimoModel": "mimotron.models.mimo",
    "MoEFeedForward": "mimotron.models.moe",
    "MoEOptions": "mimotron.config.moe_options",
    "ModalitySubmodule": "mimotron.models.encoders",
    "Projector": "mimotron.models.encoders",
    "RMSNorm": "mimotron.models.blocks",
    "SwiGLU": "mimotron.models.blocks",
    "TransformerBlock": "mimotron.models.blocks",
    "VisionEncoder": "mimotron.models.encoders",
    "apply_rope": "mimotron.models.blocks",
    "build_mimo_model": "mimotron.models.build",
    "build_module": "mimotron.models.build",
    "count_parameters": "mimotron.models.build",
    "default_ffn_hidden_size": "mimotron.config.schema",
    "init_parameters_": "mimotron.models.init",
    "language_loss": "mimotron.models.language",
    "module_prefix": "mimotron.models.build",
    "parameter_seed": "mimotron.models.init",
    "rope_cache": "mimotron.models.blocks",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
