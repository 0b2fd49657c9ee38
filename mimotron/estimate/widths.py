"""The per-module widths and byte sizes every estimate starts from.

A value's bytes in each precision, the residual stream's, a module's attention widths
(grouped-query attention read from a Hugging Face config.json), how many tensors its
MLP keeps, its optimizer's fp32 state per parameter and the encoder-batching factor.
Nothing here depends on another estimate, so the memory estimate, the activation
terms, the in-flight counts, the FSDP terms and the planner all import it downward.
"""

from __future__ import annotations

from mimotron.config.hf_resolve import language_spec
from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, is_colocated_pipeline

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
FP32 = 4


def residual_bytes(cfg: MimoConfig) -> int:
    """Bytes per value of the residual stream: the compute dtype's, or fp32 under fp32 or
    ``train.fp32_residual_connection`` (:func:`~mimotron.pipeline.shapes.residual_dtype`)."""
    return FP32 if cfg.train.fp32_residual_connection else BYTES[cfg.train.precision]

def attention_widths(cfg: MimoConfig, name: str) -> tuple[int, int]:
    """``(query width, key/value width)`` of module ``name``'s attention, whole layer
    (:func:`module_attention_widths`)."""
    return module_attention_widths(cfg.modules[name])


def module_attention_widths(mod: ModuleConfig) -> tuple[int, int]:
    """``(query width, key/value width)`` of a module's attention, whole layer.

    ``hidden`` for both, except a Hugging Face language model's (grouped-query
    attention: ``num_kv_heads x head_dim`` for keys and values, read from config.json).
    """
    if mod.is_language and mod.hf_path:
        spec = language_spec(mod)
        head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
        return spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    return mod.hidden_size, mod.hidden_size

def mlp_saved_tensors(cfg: MimoConfig, name: str) -> int:
    """Tensors of the inner width module ``name``'s MLP keeps for backward: 4 for SwiGLU
    (gate, silu(gate), up, product: the built-in blocks, Hugging Face decoders), 2 for
    the Hugging Face encoders' ``fc2(act(fc1 x))`` (CLIP, SigLIP, Whisper)."""
    mod = cfg.modules[name]
    return 2 if mod.hf_path and mod.is_encoder else 4

def optimizer_state_bytes_per_param(cfg: MimoConfig, name: str) -> int:
    """fp32 state per parameter of module ``name``'s optimizer (its effective ``name``).

    Adam / AdamW keep two moments (8 bytes); SGD one momentum buffer (4) when
    ``momentum > 0``, none without (``torch.optim.SGD`` creates no buffer then).
    """
    opt = cfg.effective_optimizer(name)
    if opt.name in ("adam", "adamw"):
        return 8
    return 4 if opt.momentum else 0

def encoder_batching_factor(cfg: MimoConfig, name: str, layout: Layout) -> int:
    """How many micro-batches of module ``name``'s activations are alive at once, beyond
    the schedule's: ``num_microbatches`` for an encoder under ``train.encoder_batching``
    (it runs the whole step in one forward, :mod:`mimotron.pipeline.encoder_batching`)
    or of a colocated layout with a pipelined language model (every micro-batch's
    forward runs before the language stages, its backward after:
    :mod:`mimotron.pipeline.colocated_pipeline`), else 1. For a frozen encoder that
    multiplies its outputs only: it saves nothing for backward
    (:func:`frozen_encoder_output_bytes`)."""
    whole_step = cfg.train.encoder_batching or is_colocated_pipeline(layout)
    if whole_step and cfg.modules[name].is_encoder:
        return cfg.num_microbatches
    return 1


def items_per_sample(cfg: MimoConfig, name: str) -> int:
    """Inputs of module ``name`` one sample may hold: ``data.max_images_per_sample`` for a
    vision encoder, else 1."""
    return cfg.data.max_images_per_sample if cfg.modules[name].kind == "vit" else 1


def bridged_rows_bytes(cfg: MimoConfig, layout: Layout | None, name: str, stage: int) -> int:
    """What the first stage of a colocated pipelined language model keeps besides its
    forwards' activations: every micro-batch's encoder rows from the bridge, and, once
    its backwards ran, their gradients, both until the encoders' backward at the end of
    the step (:mod:`mimotron.pipeline.colocated_pipeline`); 0 anywhere else."""
    if layout is None or name != LANGUAGE or stage != 0 or not is_colocated_pipeline(layout):
        return 0
    language = cfg.modules[LANGUAGE]
    samples = cfg.train.micro_batch_size // language.parallel.data
    # Into context-parallel stages a rank keeps the rows of its own positions only
    # (colocated_cp): at most seq_length / context of a sample's, wherever its media sit.
    positions = cfg.data.seq_length // language.parallel.context
    per_sample = 0
    for encoder in cfg.encoder_names:
        mod = cfg.modules[encoder]
        copies = 1 if mod.fully_frozen else 2  # the rows, and their gradients
        per_sample += copies * min(items_per_sample(cfg, encoder) * mod.num_output_tokens,
                                   positions)
    if language.parallel.context > 1:
        per_sample = min(per_sample, 2 * positions)
    total = samples * per_sample
    return (total * cfg.num_microbatches * language.hidden_size
            * BYTES[cfg.train.precision])
