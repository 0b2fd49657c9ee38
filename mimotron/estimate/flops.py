"""Analytic model FLOPs of one training iteration (encoders + projections + LM).

Megatron-Bridge reports MIMO FLOPs as 0; we count them from the config, so TFLOP/s and
MFU mean something. The count is the usual "model FLOPs" (PaLM appendix B, Megatron's
``num_floating_point_operations``): only matrix multiplications, each ``[m, k] @ [k, n]``
costing ``2·m·n·k`` (a multiply and an add per term), recomputation not included.

Forward FLOPs of the built-in modules, for ``N = samples · tokens`` tokens of width
``h`` (``f`` = MLP width, ``S`` = tokens per sample, ``V`` = vocabulary):

======================  ================================================================
piece                   forward FLOPs
======================  ================================================================
q, k, v, o projections  ``2·2·N·h·q + 2·2·N·h·kv`` (``q = kv = h`` without grouped-query
                        attention; a Hugging Face decoder's widths from its config)
attention scores+context ``2 · 2·P·q`` (``Q Kᵀ`` and ``A V``) over ``P`` (query, key)
                        pairs: ``samples·S·S`` for whole rows (the full square, causal
                        or not, as PaLM and Megatron count it), the sum of the
                        documents' squares for packed rows (each attends within itself)
SwiGLU MLP              ``3 · 2·N·h·f`` (gate, up, down)
two-matrix MLP          ``2 · 2·N·h·f`` (``fc1``, ``fc2``: Hugging Face CLIP, SigLIP and
                        Whisper encoders, :func:`~mimotron.config.hf_specs.mlp_matrices`)
MoE layer (instead)     ``2·N·h·E`` (router) + ``top_k · 3·2·N·h·f_e`` (the experts a
                        token visits) + ``3·2·N·h·f_s`` (shared experts)
LM output head          ``2·N·h·V`` (the embedding lookup is free)
ViT patch embedding     ``2·N·(C·p²)·h`` (a stride-``p`` conv = a matmul per patch)
audio front end         ``2·samples·T·F·h·3`` (k=3 conv over ``T`` frames, ``F`` bins) +
                        ``2·samples·T·h·h`` (the pooling conv, kernel = stride)
projector               ``2·N·h_enc·h_mid + 2·N·h_mid·h_lm``
======================  ================================================================

Norms, rotary embeddings, softmax and activations are elementwise and not counted.
Training multiplies by 3 (backward computes a gradient for the input and one for the
weight of every matmul, each as costly as the forward) for trainable modules. A frozen
encoder runs forward only (nothing upstream of it needs a gradient), so does a frozen
tower (``freeze = "encoder"``) while its projector trains (×3); a frozen language
model still back-propagates to its input when an encoder or projector trains (×2). The "×3" slightly
overcounts the very first layer of each encoder, whose raw input needs no gradient —
the standard convention, kept so numbers compare with other frameworks.

Encoders only see the samples that carry their modality, so the loop counts those per
step (:class:`~mimotron.training.metrics.LoopMonitor`); the language model sees every
sample padded to ``data.seq_length``.

A native-resolution tower (Qwen2.5-VL, Qwen3-VL) is counted per image from its real
patch rows and attention segments (:mod:`mimotron.estimate.native_flops`), its mergers
being its projector; the per-image counts are the data's
(:class:`~mimotron.estimate.image_counts.ImageStats`: the mock data's expectation, the
``max_pixels`` bound, or a step's real grids given by the caller).
"""

from __future__ import annotations

from collections.abc import Mapping

from mimotron.config.hf_specs import mlp_matrices
from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, ModuleConfig, default_ffn_hidden_size
from mimotron.estimate.image_counts import ImageStats, bound_stats, image_stats
from mimotron.estimate.native_flops import merger_flops, tower_flops
from mimotron.estimate.widths import module_attention_widths
from mimotron.names import LANGUAGE


def matmul_flops(m: int | float, n: int | float, k: int | float) -> float:
    """FLOPs of ``[m, k] @ [k, n]``: one multiply and one add per term."""
    return 2.0 * m * n * k


def transformer_layer_flops(num_samples: float, seq_length: int, hidden_size: int,
                            ffn_hidden_size: int = 0, num_mlp_matrices: int = 3, *,
                            widths: tuple[int, int] | None = None,
                            attention_pairs: float | None = None) -> float:
    """Forward FLOPs of one transformer layer (:class:`~mimotron.models.blocks.
    TransformerBlock`, or a Hugging Face encoder's with ``num_mlp_matrices=2``).

    Args:
        num_samples: sequences in the batch (may be fractional: an average).
        seq_length: tokens per sequence.
        hidden_size: model width ``h``.
        ffn_hidden_size: MLP width (0 = the SwiGLU default for ``h``).
        num_mlp_matrices: 3 for SwiGLU (gate, up, down), 2 for ``fc1``/``fc2``
            (:func:`~mimotron.config.hf_specs.mlp_matrices`).
        widths: ``(query width, key/value width)`` (grouped-query attention:
            :func:`~mimotron.estimate.widths.module_attention_widths`); ``None``: ``h``.
        attention_pairs: (query, key) pairs the attention computes over the batch: the
            sum over its attention segments of ``queries x keys`` (packed documents
            attend within themselves); ``None``: every sequence whole, ``B·S²``.

    Returns:
        ``2·N·h·(2q + 2kv) + 4·P·q + 2·m·N·h·f`` with ``N = B·S`` tokens, ``P`` the
        attention pairs (``B·S²`` unpacked: ``8·N·h² + 4·B·S²·h`` without GQA).
    """
    ffn = ffn_hidden_size or default_ffn_hidden_size(hidden_size)
    q_width, kv_width = widths or (hidden_size, hidden_size)
    tokens = num_samples * seq_length
    pairs = num_samples * seq_length * seq_length if attention_pairs is None else attention_pairs
    projections = (2 * matmul_flops(tokens, q_width, hidden_size)  # q and o
                   + 2 * matmul_flops(tokens, kv_width, hidden_size))  # k and v
    attention = 2 * matmul_flops(pairs, q_width, 1)  # Q Kᵀ and A V over every head
    mlp = num_mlp_matrices * matmul_flops(tokens, ffn, hidden_size)
    return projections + attention + mlp


def language_model_flops(mod: ModuleConfig, vocab_size: int, num_samples: float,
                         seq_length: int, attention_pairs: float | None = None) -> float:
    """Forward FLOPs of the language model (layers + output head).

    Args:
        mod: the ``language`` module's config (a Hugging Face decoder's grouped-query
            widths are read from its folder).
        vocab_size: tokenizer vocabulary size.
        num_samples: sequences.
        seq_length: tokens per sequence (padded length: padding is computed too).
        attention_pairs: the attention's (query, key) pairs per layer
            (:func:`transformer_layer_flops`); ``None``: unpacked sequences.

    Returns:
        ``num_layers · layer + 2·N·h·V``.
    """
    layers = mod.num_layers * language_layer_flops(mod, num_samples, seq_length,
                                                   attention_pairs)
    return layers + matmul_flops(num_samples * seq_length, vocab_size, mod.hidden_size)


def language_layer_flops(mod: ModuleConfig, num_samples: float, seq_length: int,
                         attention_pairs: float | None = None) -> float:
    """Forward FLOPs of one language-model layer, the MoE layers' share averaged over
    all layers (what :func:`language_model_flops` sums and the planner prices per
    stage); the arguments are :func:`language_model_flops`'s."""
    dense = transformer_layer_flops(num_samples, seq_length, mod.hidden_size,
                                    mod.ffn_hidden_size, widths=module_attention_widths(mod),
                                    attention_pairs=attention_pairs)
    return dense + moe_flops_delta(mod, num_samples * seq_length) / mod.num_layers


def moe_flops_delta(mod: ModuleConfig, num_tokens: float) -> float:
    """Forward FLOPs the MoE layers add over dense SwiGLU layers (0 for a dense model).

    An MoE layer costs the router ``2·N·h·E``, the ``top_k`` experts each token visits
    ``top_k · 3·2·N·h·f_e`` and the shared experts ``3·2·N·h·f_s`` instead of the dense
    SwiGLU's ``3·2·N·h·f``: experts a token does not visit cost nothing (dropless
    routing computes exactly the chosen ones).
    """
    if mod.num_experts == 0 and not (mod.hf_path and mod.is_language):
        return 0.0
    moe = moe_options(mod)
    if moe is None:
        return 0.0
    h = mod.hidden_size
    dense_f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    expert_f = moe.ffn_hidden_size or default_ffn_hidden_size(h)
    shared_f = moe.shared_ffn_hidden_size or moe.num_shared_experts * expert_f
    per_layer = (matmul_flops(num_tokens, moe.num_experts, h)
                 + 3 * matmul_flops(num_tokens, moe.top_k * expert_f + shared_f, h)
                 - 3 * matmul_flops(num_tokens, dense_f, h))
    return len(moe.moe_layer_ids(mod.num_layers)) * per_layer


def encoder_flops(mod: ModuleConfig, lm_hidden_size: int, num_samples: float,
                  stats: ImageStats | None = None) -> float:
    """Forward FLOPs of an encoder with its projector, for ``num_samples`` inputs.

    Args:
        mod: the encoder's config (``vit`` or ``audio``).
        lm_hidden_size: the language model's width (the projector's output).
        num_samples: inputs that carry the encoder's modality (images of a native tower).
        stats: a native-resolution tower's per-image counts (``None``: the
            ``max_pixels`` bound, :func:`~mimotron.estimate.image_counts.bound_stats`).

    Returns:
        Front end + transformer layers + projector FLOPs.

    Raises:
        ValueError: the module is not an encoder kind this count knows.
    """
    if mod.hf_native is not None:
        return tower_flops(mod, stats or bound_stats(mod), num_samples)
    tokens = mod.num_output_tokens
    h = mod.hidden_size
    if mod.kind == "vit":
        patch = mod.in_channels * mod.patch_size ** 2
        front = matmul_flops(num_samples * tokens, h, patch)
    elif mod.kind == "audio":
        pool = mod.num_frames // mod.num_audio_tokens
        front = (matmul_flops(num_samples * mod.num_frames, h, mod.num_freq_bins * 3)
                 + matmul_flops(num_samples * tokens, h, h * pool))
    else:
        raise ValueError(f"kind={mod.kind!r} has no FLOP count: expected 'vit' or 'audio'")
    layers = mod.num_layers * transformer_layer_flops(num_samples, tokens, h,
                                                      mod.ffn_hidden_size, mlp_matrices(mod))
    return front + layers + projector_flops(mod, lm_hidden_size, num_samples)


def projector_flops(mod: ModuleConfig, lm_hidden_size: int, num_samples: float,
                    stats: ImageStats | None = None) -> float:
    """Forward FLOPs of an encoder's projector (its two matmuls) for ``num_samples``; a
    native tower's mergers (``stats`` as :func:`encoder_flops` takes them)."""
    if mod.hf_native is not None:
        return merger_flops(mod, stats or bound_stats(mod), num_samples)
    tokens, h = mod.num_output_tokens, mod.hidden_size
    mid = mod.projector_hidden_size or lm_hidden_size
    return (matmul_flops(num_samples * tokens, mid, h)
            + matmul_flops(num_samples * tokens, lm_hidden_size, mid))


def training_multiplier(cfg: MimoConfig, name: str) -> int:
    """3 for a trainable module, 1 for a frozen encoder or tower (its projector is added
    apart), 2 or 1 for a frozen LM (see above), 2 for a module with LoRA adapters (the
    gradients of its inputs reach every adapter; the adapters' own are negligible)."""
    mod = cfg.modules[name]
    if mod.lora.rank:
        return 2
    if not mod.freeze:
        return 3
    if mod.is_encoder:
        return 1
    encoders_train = any(not cfg.modules[n].fully_frozen for n in cfg.encoder_names)
    return 2 if encoders_train else 1


def model_flops_per_iteration(cfg: MimoConfig, vocab_size: int,
                              encoder_samples: Mapping[str, float],
                              num_samples: float | None = None,
                              native_stats: Mapping[str, ImageStats] | None = None,
                              attention_pairs: float | None = None) -> dict[str, float]:
    """Training FLOPs of one iteration, per module (forward + backward).

    Args:
        cfg: the run config (module shapes, ``data.seq_length``, freezing).
        vocab_size: tokenizer vocabulary size.
        encoder_samples: encoder name -> samples of the iteration carrying its modality
            (a native-resolution tower: the images it ran).
        num_samples: samples through the language model (default: the global batch).
        native_stats: a native tower's per-image counts for this iteration (its real
            grids, :func:`~mimotron.estimate.image_counts.grid_stats`); missing ones
            are the data's (:func:`~mimotron.estimate.image_counts.image_stats`).
        attention_pairs: the language model's attention pairs of the iteration (packed
            rows: the sum of their documents' squares); ``None``: unpacked rows.

    Returns:
        Module name -> FLOPs; sum the values for the model total.
    """
    lm = cfg.modules[LANGUAGE]
    samples = cfg.train.global_batch_size if num_samples is None else num_samples
    out = {LANGUAGE: training_multiplier(cfg, LANGUAGE) * language_model_flops(
        lm, vocab_size, samples, cfg.data.seq_length, attention_pairs)}
    for name in cfg.encoder_names:
        mod, n = cfg.modules[name], encoder_samples.get(name, 0.0)
        stats = None
        if mod.hf_native is not None:
            stats = (native_stats or {}).get(name) or image_stats(cfg, name)
        out[name] = training_multiplier(cfg, name) * encoder_flops(mod, lm.hidden_size, n,
                                                                   stats)
        if mod.tower_frozen:  # its projector trains: backward x2 on top of the forward
            out[name] += 2 * projector_flops(mod, lm.hidden_size, n, stats)
    return out
