"""Models: transformer blocks, modality encoders, the decoder LM, and ``MimoModel``.

Batch format consumed by :class:`MimoModel` (produced by :mod:`mimotron.data`): a dict
with ``tokens`` Long[B, S] (padded with 0), ``labels`` Long[B, S] (next-token targets),
``loss_mask`` Float[B, S], and per modality the input (``image`` Float[B, 1, 8, 8],
``audio`` Float[B, 129, 16]; zeros where absent) plus ``has_<modality>`` Bool[B].
"""

from mimotron.models.blocks import (
    Attention,
    RMSNorm,
    SwiGLU,
    TransformerBlock,
    apply_rope,
    default_ffn_hidden_size,
    rope_cache,
)
from mimotron.models.build import build_mimo_model, build_module, count_parameters, module_prefix
from mimotron.models.encoders import AudioEncoder, ModalitySubmodule, Projector, VisionEncoder
from mimotron.models.init import init_parameters_, parameter_seed
from mimotron.models.language import LanguageModel, language_loss
from mimotron.models.mimo import MimoModel
from mimotron.models.moe import (
    GroupedExperts,
    LocalDispatcher,
    MoEFeedForward,
    MoEOptions,
)

__all__ = [
    "Attention",
    "AudioEncoder",
    "GroupedExperts",
    "LanguageModel",
    "LocalDispatcher",
    "MimoModel",
    "MoEFeedForward",
    "MoEOptions",
    "ModalitySubmodule",
    "Projector",
    "RMSNorm",
    "SwiGLU",
    "TransformerBlock",
    "VisionEncoder",
    "apply_rope",
    "build_mimo_model",
    "build_module",
    "count_parameters",
    "default_ffn_hidden_size",
    "init_parameters_",
    "language_loss",
    "module_prefix",
    "parameter_seed",
    "rope_cache",
]
