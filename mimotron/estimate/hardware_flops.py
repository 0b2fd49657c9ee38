"""The FLOPs activation recompute adds: hardware FLOPs beside model FLOPs.

The field reports two utilisations (PaLM, appendix B; Megatron's "MFU" and "HFU"):
**model FLOPs** count what the model needs, a forward and a backward
(:mod:`mimotron.estimate.flops`), whatever the implementation recomputes; **hardware
FLOPs** add what is run again. Here only full recompute runs matmuls again: each
recomputed layer's forward once more in backward (``modules.<m>.recompute = "full"``,
the first ``recompute_num_layers`` of each pipeline stage or model chunk, or all).
Selective recompute runs again only norms, RoPE, activations and the context-parallel
gather, none of which is a matmul: it adds nothing to the count. A module whose layers
run no backward (frozen, or a frozen tower) recomputes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.estimate.flops import (
    encoder_flops,
    language_model_flops,
    matmul_flops,
    projector_flops,
    training_multiplier,
)
from mimotron.estimate.image_counts import ImageStats, image_stats
from mimotron.names import LANGUAGE

__all__ = ["recompute_flops_per_iteration", "recomputed_layers"]


def recomputed_layers(mod: ModuleConfig) -> int:
    """How many of a module's layers full recompute runs again (0 without it).

    ``recompute_num_layers = n > 0`` recomputes the first ``n`` layers of each pipeline
    stage (of each model chunk under interleaving); 0 recomputes every layer.
    """
    if mod.recompute != "full":
        return 0
    n = mod.recompute_num_layers
    if n == 0:
        return mod.num_layers
    par = mod.parallel
    if par.layers_per_stage and par.virtual_pipeline == 1:
        return sum(min(n, layers) for layers in par.layers_per_stage)
    chunks = par.pipeline * par.virtual_pipeline
    return min(mod.num_layers, n * chunks)


def _layers_forward(cfg: MimoConfig, name: str, vocab_size: int, samples: float,
                    stats: ImageStats | None, attention_pairs: float | None) -> float:
    """Forward FLOPs of module ``name``'s transformer layers alone (no head, front end
    or projector; a native tower's patch embedding, a sliver, included)."""
    mod, lm = cfg.modules[name], cfg.modules[LANGUAGE]
    if name == LANGUAGE:
        head = matmul_flops(samples * cfg.data.seq_length, vocab_size, mod.hidden_size)
        return language_model_flops(mod, vocab_size, samples, cfg.data.seq_length,
                                    attention_pairs) - head
    whole = encoder_flops(mod, lm.hidden_size, samples, stats)
    return whole - projector_flops(mod, lm.hidden_size, samples, stats) - _front(mod, samples)


def _front(mod: ModuleConfig, samples: float) -> float:
    """A built-in encoder's front end (patch embedding or audio convolutions)."""
    if mod.hf_native is not None:
        return 0.0
    tokens, h = mod.num_output_tokens, mod.hidden_size
    if mod.kind == "vit":
        return matmul_flops(samples * tokens, h, mod.in_channels * mod.patch_size ** 2)
    pool = mod.num_frames // mod.num_audio_tokens
    return (matmul_flops(samples * mod.num_frames, h, mod.num_freq_bins * 3)
            + matmul_flops(samples * tokens, h, h * pool))


def recompute_flops_per_iteration(cfg: MimoConfig, vocab_size: int,
                                  encoder_samples: Mapping[str, float],
                                  num_samples: float | None = None,
                                  native_stats: Mapping[str, ImageStats] | None = None,
                                  attention_pairs: float | None = None) -> dict[str, float]:
    """FLOPs full recompute adds to an iteration, per module (hardware FLOPs = model
    FLOPs + these); the arguments are :func:`~mimotron.estimate.flops.
    model_flops_per_iteration`'s.

    Returns:
        Module name -> FLOPs (0 for a module that recomputes nothing).
    """
    out: dict[str, float] = {}
    for name, mod in cfg.modules.items():
        layers = recomputed_layers(mod)
        trains_layers = training_multiplier(cfg, name) > 1 and not mod.tower_frozen
        if not layers or not trains_layers:
            out[name] = 0.0
            continue
        if name == LANGUAGE:
            samples = cfg.train.global_batch_size if num_samples is None else num_samples
        else:
            samples = encoder_samples.get(name, 0.0)
        stats = None
        if mod.hf_native is not None:
            stats = (native_stats or {}).get(name) or image_stats(cfg, name)
        forward = _layers_forward(cfg, name, vocab_size, samples, stats, attention_pairs)
        out[name] = forward * layers / mod.num_layers
    return out
