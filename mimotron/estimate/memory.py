"""Analytic per-rank memory estimate: weights, gradients, optimizer state, activations.

Used by ``mimotron plan`` and the memory benchmark. Parameter counts come from building
each pipeline stage on the ``meta`` device, so they match the real model exactly; the
tensor-parallel share divides every stage's count by the TP degree (norm weights are
replicated, a small overcount we accept); an MoE stage's routed experts are divided by
``expert x expert_tensor`` instead, and its routers and shared experts (whole on every
rank) are not divided.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mimotron.config.lora import base_in_folder
from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, default_ffn_hidden_size
from mimotron.config.vocab_size import model_vocab_size
from mimotron.estimate.activation_terms import (
    context_keys_read,
    deepstack_link_bytes_per_sample,
    extra_layer_bytes_per_sample,
)
from mimotron.estimate.fsdp_memory import fsdp_memory_bytes
from mimotron.estimate.in_flight import held_forwards_peak
from mimotron.estimate.native_memory import (
    native_activation_bytes,
    native_workspace_bytes,
    uses_native_terms,
)
from mimotron.estimate.widths import (
    BYTES,
    FP32,
    attention_widths,
    bridged_rows_bytes,
    items_per_sample,
    mlp_saved_tensors,
    optimizer_state_bytes_per_param,
    residual_bytes,
)
from mimotron.models.blocks import _NORM_CHUNK_ELEMENTS
from mimotron.models.build import build_module
from mimotron.models.freeze import trainable_parameter_count
from mimotron.models.lora import adapter_parameter_count
from mimotron.models.moe import moe_layers
from mimotron.models.recompute import recomputed_layer_ids
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, check_layout
from mimotron.parallel.virtual_pipeline import rank_layers


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for one module.

    ``activations`` are the saved tensors of every micro-batch in flight (a frozen
    encoder saves none: only its outputs); ``workspace`` the backward's largest
    temporary on top of them; ``reduce_bucket`` the buffers of the data-parallel
    gradient reduction (:func:`reduce_bucket_bytes`) and ``param_gather`` those of a
    ZeRO-1 module's parameter all-gather (:func:`param_gather_bytes`), both counted
    after the backward, when the activations are freed. The peak is therefore
    ``weights + grads + optimizer + max(activations + workspace, reduce_bucket,
    param_gather)``.
    """

    module: str
    num_params: int  # parameters held by this rank
    weights: int
    grads: int
    optimizer: int
    activations: int
    workspace: int = 0
    reduce_bucket: int = 0
    param_gather: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.grads + self.optimizer
                + max(self.activations + self.workspace, self.reduce_bucket,
                      self.param_gather))


def _stage_parts(cfg: MimoConfig, name: str, vocab_size: int) -> list[torch.nn.Module]:
    """Each pipeline stage of a module, built on the meta device."""
    par = cfg.modules[name].parallel
    # Under interleaving a rank holds its chunks' layers (and stage 0 / p-1 the ends).
    stages = [rank_layers(cfg.modules[name].num_layers, par, s)[0] for s in range(par.pipeline)]
    parts = []
    for s, layers in enumerate(stages):
        with torch.device("meta"):
            parts.append(build_module(cfg, name, vocab_size, layer_ids=layers,
                                      pre_process=s == 0, post_process=s == len(stages) - 1,
                                      init=False))
    return parts


def stage_parameter_counts(cfg: MimoConfig, name: str, vocab_size: int) -> list[int]:
    """Parameter count of each pipeline stage of a module (built on the meta device),
    LoRA adapters included."""
    lora = cfg.modules[name].lora
    return [sum(p.numel() for p in part.parameters()) + adapter_parameter_count(part, lora)
            for part in _stage_parts(cfg, name, vocab_size)]


def stage_trainable_counts(cfg: MimoConfig, name: str, vocab_size: int) -> list[int]:
    """Parameters of each pipeline stage that train (``modules.<m>.freeze``, ``lora``).

    All of :func:`stage_parameter_counts` for a trainable module, none for a frozen one,
    for an encoder whose tower is frozen its projector's (on the last stage), and for a
    module with LoRA adapters the adapters' (already one TP rank's).
    """
    mod = cfg.modules[name]
    par = mod.parallel
    if mod.lora.rank:  # one rank's: TP splits only one matrix of an adapter
        return [adapter_parameter_count(part, mod.lora, par.tensor)
                for part in _stage_parts(cfg, name, vocab_size)]
    if not mod.freeze:
        return stage_parameter_counts(cfg, name, vocab_size)
    if mod.fully_frozen:
        return [0] * par.pipeline
    counts = [0] * par.pipeline
    layers = rank_layers(mod.num_layers, par, par.pipeline - 1)[0]
    with torch.device("meta"):
        part = build_module(cfg, name, vocab_size, layer_ids=layers,
                            pre_process=par.pipeline == 1, post_process=True, init=False)
    counts[-1] = trainable_parameter_count(part, mod)
    return counts


def stage_expert_counts(cfg: MimoConfig, name: str, vocab_size: int
                        ) -> list[tuple[int, int]]:
    """Per pipeline stage ``(routed expert params, router + shared expert params)``.

    Both are part of :func:`stage_parameter_counts`. Routed experts are split over
    ``expert x expert_tensor`` ranks; the routers and shared experts are whole on every
    rank of the module (not tensor parallel). ``[]`` for a dense module.
    """
    mod = cfg.modules[name]
    if not mod.is_language or moe_options(mod) is None:
        return []
    par = mod.parallel
    out = []
    for s in range(par.pipeline):
        layers = rank_layers(mod.num_layers, par, s)[0]
        with torch.device("meta"):
            part = build_module(cfg, name, vocab_size, layer_ids=layers, pre_process=s == 0,
                                post_process=False, init=False)
        experts = whole = 0
        for layer in moe_layers(part).values():
            routed = sum(p.numel() for p in layer.experts.parameters())
            experts += routed
            whole += sum(p.numel() for p in layer.parameters()) - routed
        out.append((experts, whole))
    return out


def rank_parameter_count(cfg: MimoConfig, name: str, stage_count: int,
                         expert_split: tuple[int, int] | None) -> int:
    """Parameters one rank of a module stage holds: the dense part / TP, MoE parts apart."""
    par = cfg.modules[name].parallel
    if expert_split is None:
        return stage_count // par.tensor
    experts, whole = expert_split
    dense = stage_count - experts - whole
    return dense // par.tensor + whole + experts // (par.expert * par.expert_tensor)


# The loss (log-softmax of the logits) and the norms' per-token statistics are fp32.


def layer_bytes_per_token(cfg: MimoConfig, name: str) -> tuple[int, int]:
    """Bytes one transformer layer saves for backward per token: ``(whole, tp_split)``.

    Counted from :class:`~mimotron.models.blocks.TransformerBlock` and checked against
    what autograd saves (``tests/test_memory_estimate.py``, and at Llama-2-7B's shape
    against the published analysis, ``tests/test_activation_bytes.py``), with ``h`` the
    width, ``f`` the SwiGLU width, ``c`` the compute dtype's bytes, ``r`` the residual
    stream's (:func:`residual_bytes`):

    * the two RMSNorms keep their input, ``2 x r h`` (and a per-token fp32 statistic,
      left out);
    * the column-parallel linears' input: each norm's output, in the compute dtype and
      shared by q/k/v (by w1/w3), ``2 x c h``;
    * attention keeps the rotated queries and keys, the values (``c`` x the query width
      and twice the key/value width, :func:`attention_widths`) and SDPA's output, whose
      heads merge is a view ``wo`` reads (``c`` x the query width);
    * SwiGLU keeps gate, silu(gate), up and their product, ``4 x c f``.

    This is Korthikanti et al.'s ``16h + 8f`` bytes (bf16, no dropout, flash attention,
    SwiGLU). With TP ``t`` attention and SwiGLU divide by ``t``; sequence parallelism
    (:mod:`mimotron.parallel.sequence_parallel`) divides the norms and the linears'
    inputs too (it keeps their shard, :mod:`mimotron.parallel.sequence_saved`).
    """
    mod = cfg.modules[name]
    h, c, r = mod.hidden_size, BYTES[cfg.train.precision], residual_bytes(cfg)
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    q_width, kv_width = attention_widths(cfg, name)
    whole = 2 * r * h + 2 * c * h
    split = c * (2 * q_width + 2 * kv_width) + mlp_saved_tensors(cfg, name) * c * f
    if mod.parallel.sequence_parallel:
        return 0, whole + split
    return whole, split


def ends_bytes_per_sample(cfg: MimoConfig, name: str, tokens: int, vocab_size: int
                          ) -> tuple[int, int]:
    """Saved bytes per sample outside the layers: ``(first stage, last stage)``.

    Last stage: the final norm's input (the residual dtype) and the head's input (its
    output, compute dtype); for the language model the loss keeps the log-softmax of
    the logits (fp32, the vocabulary divided by TP), for an encoder the projector keeps
    GELU's input and ``fc2``'s input. First stage of an encoder: its front end's saved
    input (the raw image or spectrogram, cast to the compute dtype) and, for audio, the
    frame-rate GELU input and pooling-conv input. The language model's embedding saves
    only indices.
    """
    mod = cfg.modules[name]
    h, c, t = mod.hidden_size, BYTES[cfg.train.precision], mod.parallel.tensor
    head_input = c * h
    norm = residual_bytes(cfg) * h // (t if mod.parallel.sequence_parallel else 1)
    if mod.is_language:
        return 0, tokens * (norm + head_input + FP32 * vocab_size // t)
    width = mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size
    last = tokens * (norm + head_input + 2 * c * width)
    if mod.kind == "vit":
        first = mod.in_channels * mod.image_size**2 * c
    else:
        first = (mod.num_freq_bins + 2 * h) * mod.num_frames * c
    return first, last


def microbatches_in_flight(cfg: MimoConfig, layout: Layout, name: str, stage: int = 0) -> int:
    """Forwards whose activations a stage holds at once, at the peak of its plan.

    Replayed from the training plan the executor runs
    (:func:`~mimotron.estimate.in_flight.held_forwards_peak`): the 1F1B plan
    (:func:`mimotron.pipeline.actions.build_1f1b_actions`) runs ``total - position - 1``
    warm-up forwards before the first backward, so a stage holds ``min(total - position,
    m)``; an encoder on its own ranks is a pipeline position ahead of the language
    model, so it keeps one more micro-batch than its own pipeline depth, and more when
    it feeds an interleaved language model (a longer warm-up). One with
    ``train.schedule`` other than ``1f1b`` and in colocated layouts (one position; a
    pipelined language model's stages as in a split layout of it alone).
    Under interleaving the count is of model-chunk forwards
    (:func:`interleaved_chunks_in_flight`). Under ``train.encoder_batching``, or beside
    a colocated pipelined language model, an encoder holds every micro-batch of the step
    (:func:`encoder_batching_factor`).
    """
    return int(held_forwards_peak(cfg, layout, name, stage))


def interleaved_chunks_in_flight(cfg: MimoConfig, name: str, stage: int,
                                 layout: Layout | None = None) -> int:
    """Model-chunk forwards an interleaved rank holds at once, at the peak of its plan.

    Replayed from the rank's interleaved plan (:func:`microbatches_in_flight`):
    Megatron's :func:`~mimotron.pipeline.interleaved_actions.num_warmup` forwards before
    the first backward, then one more before each backward (capped at the step's ``m x
    v``); an encoder feeding an interleaved language model warms up longer, and that is
    counted. At ``pipeline = 8 x virtual_pipeline = 2`` stage 0 holds 23.

    Args:
        cfg: the run config.
        name: the module.
        stage: the pipeline stage.
        layout: the config's layout (``None``: planned here).
    """
    return microbatches_in_flight(cfg, layout or check_layout(cfg), name, stage)


def activation_bytes(cfg: MimoConfig, name: str, vocab_size: int = 64,
                     in_flight: int | None = None, stage: int = 0,
                     layout: Layout | None = None) -> int:
    """Activations kept for backward by one rank of a module stage (``in_flight`` copies).

    One micro-batch's share: the micro-batch slice of the DP rank (``micro_batch / dp``
    samples) times the tokens (the language model: ``seq / context``; an encoder: its
    output tokens) times :func:`layer_bytes_per_token` for each layer of the stage, plus
    :func:`ends_bytes_per_sample` on the first / last stage. Context parallelism holds
    ``seq / context`` positions per rank, so it divides all of it (logits included);
    attention then also saves the all-gathered keys and values of the other ranks'
    positions for backward (after the GQA repeat: ``2 x c`` bytes x ``hidden / t`` per
    position). ``in_flight`` (``None``: :func:`microbatches_in_flight` of ``layout``,
    default the config's) multiplies the whole. Under interleaving (``virtual_pipeline
    = v > 1``) a model-chunk forward holds ``1 / v`` of the rank's layers, plus the
    module's first (last) stage ends on its first (last) chunk: ``None`` takes the peak
    of the rank's plan, each chunk weighted by its bytes
    (:func:`~mimotron.estimate.in_flight.held_forwards_peak`); a number ``in_flight``
    spreads that many chunk forwards evenly over the chunks. A native-resolution
    vision module is counted by the patch rows its replicas hold
    (:func:`~mimotron.estimate.native_memory.native_activation_bytes`: the largest
    replica's; ``in_flight`` is not used). A frozen
    encoder holds only its outputs (:func:`frozen_encoder_output_bytes`), one whose tower
    is frozen only its projector's saved tensors (:func:`projector_saved_bytes`). Each layer
    recomputed in backward (``modules.<m>.recompute``, :func:`recomputed_layers`) keeps
    :func:`recompute_dropped_bytes` less. MoE layers and attention masks (packing,
    context parallelism) add :func:`~mimotron.estimate.activation_terms.
    extra_layer_bytes_per_sample`.
    """
    mod = cfg.modules[name]
    par = mod.parallel
    samples = local_items(cfg, name)
    tokens = (cfg.data.seq_length // par.context if mod.is_language
              else mod.num_output_tokens)
    if in_flight is None and layout is None:
        layout = check_layout(cfg)
    if mod.hf_native is not None:  # by patch rows, not slots: its largest replica's
        layout, memo = layout or check_layout(cfg), {}
        return max(native_activation_bytes(cfg, layout, name, stage, d, None, memo)[0]
                   for d in range(par.data))
    if mod.freeze and mod.is_encoder:
        # Its outputs, or its projector's saved tensors: those of its last chunk's forwards.
        last_chunk = [0.0] * (par.virtual_pipeline - 1) + [1.0]
        held_bytes = (frozen_encoder_output_bytes if mod.fully_frozen
                      else projector_saved_bytes)(cfg, name, stage)
        return held_bytes * samples * int(
            held_forwards_peak(cfg, layout, name, stage, last_chunk)
            if in_flight is None else in_flight)
    layers, chunks = rank_layers(mod.num_layers, par, stage)
    per_layer = layer_bytes_per_sample(cfg, name)
    # Recomputed layers keep less (modules.<m>.recompute).
    recomputed = recomputed_layers(cfg, name, stage)
    held = (per_layer * len(layers) - recomputed * recompute_dropped_bytes(cfg, name)
            + extra_layer_bytes_per_sample(cfg, name, layers, recomputed)  # MoE
            + deepstack_link_bytes_per_sample(cfg, name, chunks or [layers]))
    first, last = ends_bytes_per_sample(cfg, name, tokens, vocab_size)
    ends = (first if stage == 0 else 0) + (last if stage == par.pipeline - 1 else 0)
    if chunks is not None:
        v, layer_part = len(chunks), held  # one micro-batch's, all chunks
        if in_flight is not None:
            return int((layer_part * in_flight / v + ends * -(-in_flight // v)) * samples)
        per_chunk = [layer_part / v + (first if stage == 0 and c == 0 else 0)
                     + (last if stage == par.pipeline - 1 and c == v - 1 else 0)
                     for c in range(v)]
        return int(held_forwards_peak(cfg, layout, name, stage, per_chunk) * samples)
    one = held + ends
    if in_flight is None:
        in_flight = microbatches_in_flight(cfg, layout, name, stage)
    return int(one * samples * in_flight) + bridged_rows_bytes(cfg, layout, name, stage)


def layer_bytes_per_sample(cfg: MimoConfig, name: str) -> int:
    """Bytes one transformer layer keeps for backward per sample, without recompute.

    The tokens of one sample on this rank (``seq / context`` for the language model, the
    output tokens for an encoder) times :func:`layer_bytes_per_token` (the TP-split part
    divided by ``tensor``), plus, under context parallelism, the keys and values
    attention reads beyond its own (:func:`context_kv_bytes_per_sample`).
    """
    mod = cfg.modules[name]
    par = mod.parallel
    tokens = (cfg.data.seq_length // par.context if mod.is_language
              else mod.num_output_tokens)
    whole, split = layer_bytes_per_token(cfg, name)
    return tokens * (whole + split // par.tensor) + context_kv_bytes_per_sample(cfg, name)


def context_kv_bytes_per_sample(cfg: MimoConfig, name: str) -> int:
    """The keys and values one layer's attention keeps under CP beyond the rank's own
    (0 without CP): see :func:`~mimotron.estimate.activation_terms.context_keys_read`."""
    mod = cfg.modules[name]
    par = mod.parallel
    if not mod.is_language or par.context == 1:
        return 0
    seq = cfg.data.seq_length
    others = context_keys_read(seq, par.context) - seq // par.context
    _, kv_width = attention_widths(cfg, name)
    return kv_width * others * 2 * BYTES[cfg.train.precision] // par.tensor


def recomputed_layers(cfg: MimoConfig, name: str, stage: int) -> int:
    """Layers of a module stage that recompute their activations (``modules.<m>.recompute``).

    The first ``recompute_num_layers`` of each model chunk the stage's ranks hold (all
    with 0), as :func:`mimotron.models.recompute.apply_recompute` picks them; none for
    ``recompute = "none"`` and for a frozen encoder or tower (its layers save nothing).
    """
    mod = cfg.modules[name]
    if mod.recompute == "none" or (mod.freeze and mod.is_encoder):
        return 0
    layers, chunks = rank_layers(mod.num_layers, mod.parallel, stage)
    return len(recomputed_layer_ids(chunks or [layers], mod.recompute_num_layers))


def recompute_dropped_bytes(cfg: MimoConfig, name: str) -> int:
    """Bytes per sample a recomputed layer does not keep for backward (its backward makes
    them again, :mod:`mimotron.models.recompute`); 0 without recompute.

    * ``full``: everything but the layer's input, the residual stream (``residual`` bytes
      per value, fp32 today, and ``seq / tensor`` positions under sequence parallelism).
    * ``selective``: everything but what the layer's selective-checkpoint policy keeps
      (:mod:`mimotron.models.save_policy`): the input (as ``full``), q, k, v and SDPA's
      output (``c`` x the query width and twice the key/value width, divided by TP),
      ``wo``'s and ``w2``'s reduced outputs (``2 x c h``, whole under TP without
      sequence parallelism) and the SwiGLU gate and up projections (``2 x c f`` over
      TP); under sequence parallelism every term is divided by TP. Under context
      parallelism the gathered keys and values go too (the gather runs again). SDPA's
      log-sum-exp stays and is not counted, as without recompute.
    """
    mod = cfg.modules[name]
    if mod.recompute == "selective":
        return layer_bytes_per_sample(cfg, name) - _selective_kept_bytes(cfg, name)
    if mod.recompute != "full":
        return 0
    par = mod.parallel
    tokens = (cfg.data.seq_length // par.context if mod.is_language
              else mod.num_output_tokens)
    kept = (tokens * residual_bytes(cfg) * mod.hidden_size
            // (par.tensor if par.sequence_parallel else 1))
    return layer_bytes_per_sample(cfg, name) - kept


def _selective_kept_bytes(cfg: MimoConfig, name: str) -> int:
    """Bytes per sample a layer keeps under ``recompute = "selective"``
    (:func:`recompute_dropped_bytes`)."""
    mod = cfg.modules[name]
    par = mod.parallel
    h, c = mod.hidden_size, BYTES[cfg.train.precision]
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    q_width, kv_width = attention_widths(cfg, name)
    tokens = (cfg.data.seq_length // par.context if mod.is_language
              else mod.num_output_tokens)
    whole = residual_bytes(cfg) * h + 2 * c * h
    split = c * (2 * q_width + 2 * kv_width) + mlp_saved_tensors(cfg, name) // 2 * c * f
    if par.sequence_parallel:
        whole, split = 0, whole + split
    return tokens * (whole + split // par.tensor)


def local_items(cfg: MimoConfig, name: str) -> int:
    """Inputs a rank of module ``name`` runs per micro-batch: its samples, and for a
    vision encoder every image they may hold (:func:`items_per_sample`)."""
    mod = cfg.modules[name]
    return cfg.train.micro_batch_size // mod.parallel.data * items_per_sample(cfg, name)


def recompute_workspace_bytes(cfg: MimoConfig, name: str) -> int:
    """The backward's extra temporary under recompute: one recomputed layer's activations.

    A recomputed layer's backward first makes what it dropped
    (:func:`recompute_dropped_bytes`, one micro-batch of this rank's samples), and that
    lives until the layer's backward ends, on top of the workspace of
    :func:`backward_workspace_bytes`. 0 when no layer of the module is recomputed, or its
    layers run no backward (a frozen encoder or tower; a frozen language model
    back-propagates to its input, through its layers).
    """
    mod = cfg.modules[name]
    if mod.recompute == "none" or (mod.freeze and mod.is_encoder):
        return 0
    return local_items(cfg, name) * recompute_dropped_bytes(cfg, name)


def frozen_encoder_output_bytes(cfg: MimoConfig, name: str, stage: int) -> int:
    """Bytes per sample a frozen encoder stage holds for the step: its outputs only.

    Neither its parameters nor its inputs need a gradient, so autograd saves nothing in
    its forward; what stays alive is the projected output (``num_output_tokens`` rows
    of the language model's width, in the compute dtype) until the language model has
    consumed it, on the last stage. Earlier stages hand theirs on: 0.
    """
    mod = cfg.modules[name]
    if stage != mod.parallel.pipeline - 1:
        return 0
    return mod.num_output_tokens * cfg.modules[LANGUAGE].hidden_size * BYTES[cfg.train.precision]


def projector_saved_bytes(cfg: MimoConfig, name: str, stage: int) -> int:
    """Bytes per sample an encoder stage with a frozen tower (``freeze = "encoder"``) saves.

    The tower's input is data and its parameters are frozen, so it saves nothing; the
    projector saves its input (the tower's output, compute dtype), GELU's input and
    ``fc2``'s input (the projector's width), as in :func:`ends_bytes_per_sample`, on
    the last stage (the only one that holds the projector).
    """
    mod = cfg.modules[name]
    if stage != mod.parallel.pipeline - 1:
        return 0
    c = BYTES[cfg.train.precision]
    width = mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size
    return mod.num_output_tokens * (c * mod.hidden_size + 2 * c * width)


def projector_workspace_bytes(cfg: MimoConfig, name: str) -> int:
    """The backward temporary of an encoder whose tower is frozen: its projector's.

    Only the projector runs a backward; its largest temporary is the gradient of its
    hidden width (compute dtype) for one micro-batch of this rank's samples.
    """
    mod = cfg.modules[name]
    samples = local_items(cfg, name)
    width = mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size
    return samples * mod.num_output_tokens * BYTES[cfg.train.precision] * width


def backward_workspace_bytes(cfg: MimoConfig, name: str, vocab_size: int = 0,
                             last_stage: bool = False) -> int:
    """The largest temporary of a backward on top of the saved activations.

    The larger of two, measured on the digits language model (``benchmarks/memory.py``,
    per-phase marks, and ``tests/test_memory_estimate.py``):

    * the backward of the last micro-batch's SwiGLU, where the gradient of the inner
      width (``c f`` per token, divided by TP) is live while every saved tensor of the
      layer still is;
    * an RMSNorm's backward: its input gradient (``c h`` per token) and three fp32
      temporaries of one chunk of rows (at most ``_NORM_CHUNK_ELEMENTS`` values each,
      :class:`~mimotron.models.blocks.RMSNorm`). Larger only for narrow FFNs or short
      sequences;
    * on the language model's last stage (``last_stage``, ``vocab_size`` given), the
      loss's backward: 8 bytes per logit of the rank's vocabulary shard above what the
      loss keeps (the fp32 gradient of the log-softmax and the logits' gradient,
      measured with ``language_loss`` and ``vocab_parallel_loss`` alike). With a real
      vocabulary this is the largest: 32,000 logits against an 11,008-wide SwiGLU.

    A native-resolution tower: :func:`~mimotron.estimate.native_memory.
    native_workspace_bytes` of a micro-batch whose image slots are all full
    (:func:`estimate_memory` gives it the largest micro-batch the data holds).
    """
    mod = cfg.modules[name]
    par = mod.parallel
    samples = local_items(cfg, name)
    if mod.hf_native is not None:  # its micro-batch's patch rows, every slot full
        return native_workspace_bytes(cfg, name, samples * mod.hf_native.max_patches)
    tokens = (cfg.data.seq_length // par.context if mod.is_language
              else mod.num_output_tokens)
    h, c = mod.hidden_size, BYTES[cfg.train.precision]
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    values = samples * tokens * h // (par.tensor if par.sequence_parallel else 1)
    norm = c * values + 3 * FP32 * min(values, _NORM_CHUNK_ELEMENTS)
    loss = 0
    if last_stage and mod.is_language:
        loss = 2 * FP32 * samples * tokens * vocab_size // par.tensor
    return max(samples * tokens * c * f // par.tensor, norm, loss)


def estimate_memory(
    cfg: MimoConfig, layout: Layout, vocab_size: int, ranks: list[int] | None = None,
    counts_memo: dict[tuple[object, ...], Any] | None = None,
    image_steps: range | None = None,
) -> dict[int, list[MemoryEstimate]]:
    """Per-rank estimates, one entry per module the rank holds (of ``ranks``; None: all).

    ``counts_memo`` (the planner's search, which estimates many layouts of one model)
    keeps the per-stage parameter counts, which build each stage on the meta device,
    keyed by module and stage split: share one dict only between configs that differ
    in parallel degrees, recompute and optimizer options, never in module shapes.

    ``vocab_size`` is the tokenizer's; the logits count the language model's own
    vocabulary (a checkpoint's ``config.json`` one where larger, padded:
    :func:`~mimotron.models.build.model_vocab_size`). Gradients, optimizer state and
    the reduction's buffers count the parameters that train
    (:func:`stage_trainable_counts`): none of a frozen module, only the projector of an
    encoder whose tower is frozen.

    A native-resolution vision module (Qwen2.5-VL, Qwen3-VL) and the first stage of a
    language model fed by one over a bridge are counted per data-parallel replica, from
    the images that replica holds (:func:`_with_native_images`; ``image_steps``: the
    training steps whose samples are read, ``None``: :func:`~mimotron.estimate.
    image_counts.image_steps`).
    """
    vocab_size = model_vocab_size(cfg, vocab_size)
    memo = {} if counts_memo is None else counts_memo

    def memoised(count: Any, name: str) -> list[Any]:
        par, lora = cfg.modules[name].parallel, cfg.modules[name].lora
        key = (count.__name__, name, vocab_size, par.pipeline, par.virtual_pipeline,
               tuple(par.layers_per_stage), lora.rank, tuple(lora.targets), par.tensor)
        if key not in memo:
            memo[key] = count(cfg, name, vocab_size)
        return memo[key]

    counts = {n: memoised(stage_parameter_counts, n) for n in cfg.modules}
    trained = {n: memoised(stage_trainable_counts, n)
               if cfg.modules[n].freeze or cfg.modules[n].lora.rank else counts[n]
               for n in cfg.modules}  # all of a trainable module's (no second build)
    experts = {n: memoised(stage_expert_counts, n) for n in cfg.modules}
    out: dict[int, list[MemoryEstimate]] = {}
    # Per (module, stage): the peak of its plan's held forwards (one replay per stage).
    activations: dict[tuple[str, int], int] = {}
    for rank in range(layout.world_size) if ranks is None else ranks:
        out[rank] = []
        for role in layout.roles(rank):
            name, stage, mod = role.module, role.pp, cfg.modules[role.module]
            if (name, stage) not in activations:  # a native tower's: per replica, below
                activations[(name, stage)] = 0 if mod.hf_native is not None else \
                    activation_bytes(cfg, name, vocab_size, None, stage, layout)
            split = experts[name][stage] if experts[name] else None
            n = rank_parameter_count(cfg, name, counts[name][stage], split)
            t = trained[name][stage] if mod.lora.rank else n if not mod.freeze else (
                0 if mod.fully_frozen else rank_parameter_count(cfg, name, trained[name][stage],
                                                                split))
            est = _rank_estimate(cfg, name, stage, n, t, split, vocab_size)
            est = replace(est, activations=activations[(name, stage)])
            if uses_native_terms(cfg, layout, name, stage):
                est = _with_native_images(cfg, layout, est, stage, role.dp, image_steps, memo)
            out[rank].append(est)
            if mod.parallel.fsdp and mod.parallel.data > 1:
                out[rank][-1] = _with_fsdp(cfg, out[rank][-1], vocab_size, t)
    return out


def _with_native_images(cfg: MimoConfig, layout: Layout, est: MemoryEstimate, stage: int,
                        dp: int, steps: range | None, memo: dict[tuple[object, ...], Any]
                        ) -> MemoryEstimate:
    """``est`` with the native terms of replica ``dp``
    (:func:`~mimotron.estimate.native_memory.native_activation_bytes`): a native tower's
    activations and workspace replaced by its held images', the blocks a language
    model's first stage received added to its own."""
    held_bytes, held = native_activation_bytes(cfg, layout, est.module, stage, dp, steps, memo)
    if est.module == LANGUAGE:
        return replace(est, activations=est.activations + held_bytes)
    return replace(est, activations=held_bytes,
                   workspace=native_workspace_bytes(cfg, est.module, held.largest_patches))


def _rank_estimate(cfg: MimoConfig, name: str, stage: int, n: int, trained: int,
                   split: tuple[int, int] | None, vocab_size: int) -> MemoryEstimate:
    """One rank's estimate of a module stage holding ``n`` parameters, ``trained`` of which
    train (activations left at 0 for the caller)."""
    mod = cfg.modules[name]
    master = FP32
    compute = BYTES[cfg.train.precision] if cfg.train.precision != "fp32" else 0
    # ZeRO-1 under bf16 / fp16: 16-bit weights for what trains, the fp32 master in the
    # optimizer's share (master_weight_bytes); frozen parameters stay fp32.
    masters = has_master_weights(cfg, name)
    weights = (trained * compute + (n - trained) * (master + compute) if masters
               else n * (master + compute))
    if compute and base_in_folder(cfg, name):  # the base held once in 16 bits (models/lora)
        weights = (trained * (compute if masters else master + compute)
                   + (n - trained) * compute)
    if mod.fully_frozen and mod.is_encoder:
        workspace = 0  # no backward at all
    elif mod.tower_frozen:  # only the projector (last stage) runs a backward
        last = stage == mod.parallel.pipeline - 1
        workspace = projector_workspace_bytes(cfg, name) if last else 0
    else:  # a frozen language model still back-propagates to its input
        workspace = (backward_workspace_bytes(cfg, name, vocab_size,
                                              stage == mod.parallel.pipeline - 1)
                     + recompute_workspace_bytes(cfg, name))
    if cfg.train.encoder_batching and mod.is_encoder:
        workspace *= cfg.num_microbatches  # one backward of the whole step's inputs
    return MemoryEstimate(
        module=name,
        num_params=n,
        weights=weights,
        grads=trained * FP32,
        optimizer=(optimizer_state_bytes(cfg, name, trained, split)
                   + master_weight_bytes(cfg, name, trained, split)) if trained else 0,
        activations=0,
        workspace=workspace,
        reduce_bucket=reduce_bucket_bytes(cfg, name, trained),
        param_gather=param_gather_bytes(cfg, name, trained),
    )


def _with_fsdp(cfg: MimoConfig, est: MemoryEstimate, vocab_size: int,
               num_trainable: int) -> MemoryEstimate:
    """An FSDP2 module's estimate (:func:`~mimotron.parallel.fsdp.fsdp_memory_bytes`):
    1 / dp of the fp32 state; its gather / reduce-scatter buffers on top of the
    activations (in the workspace); no DP bucket of its own."""
    held = fsdp_memory_bytes(cfg, est.module, est.num_params, vocab_size, num_trainable)
    return replace(est, weights=held["weights"], grads=held["grads"],
                   optimizer=held["optimizer"], workspace=est.workspace + held["buffers"],
                   reduce_bucket=0, param_gather=0)


def optimizer_state_bytes(cfg: MimoConfig, name: str, num_params: int,
                          expert_split: tuple[int, int] | None) -> int:
    """The optimizer state of the parameters a rank holds (its local TP / expert shards).

    :func:`optimizer_state_bytes_per_param` per parameter. Under ZeRO-1
    (:mod:`mimotron.parallel.zero`) each rank keeps the state of its rows only: the
    dense part's divided by the replica group (``dp x cp``), the routed experts' by
    ``expt_dp`` (the ranks holding the same expert shard). With one replica nothing is
    sharded.
    """
    par = cfg.modules[name].parallel
    per = optimizer_state_bytes_per_param(cfg, name)
    if not par.shard_optimizer or _replicas(cfg, name) == 1:
        return num_params * per
    experts = 0 if expert_split is None else expert_split[0] // (par.expert * par.expert_tensor)
    expt_dp = par.size // (par.expert * par.expert_tensor * par.pipeline)
    return (num_params - experts) * per // _replicas(cfg, name) + experts * per // expt_dp


def has_master_weights(cfg: MimoConfig, name: str) -> bool:
    """Module ``name`` holds 16-bit weights and fp32 master rows (ZeRO-1 under bf16 / fp16).

    See :mod:`mimotron.parallel.zero`: a trainable module with ``shard_optimizer`` and
    more than one replica, under a 16-bit ``train.precision``.
    """
    mod = cfg.modules[name]
    return (mod.parallel.shard_optimizer and not mod.fully_frozen and _replicas(cfg, name) > 1
            and cfg.train.precision != "fp32")


def master_weight_bytes(cfg: MimoConfig, name: str, num_params: int,
                        expert_split: tuple[int, int] | None) -> int:
    """The fp32 master rows a rank holds (4 B per parameter, split as the optimizer state).

    0 unless :func:`has_master_weights`; then the dense part's 4 B are divided by the
    replica group (``dp x cp``) and the routed experts' by ``expt_dp``, like
    :func:`optimizer_state_bytes`. Megatron-Core's distributed optimizer: 2 B weights +
    4 B gradients + (4 + 8) / d B per parameter.
    """
    if not has_master_weights(cfg, name):
        return 0
    par = cfg.modules[name].parallel
    experts = 0 if expert_split is None else expert_split[0] // (par.expert * par.expert_tensor)
    expt_dp = par.size // (par.expert * par.expert_tensor * par.pipeline)
    return (num_params - experts) * FP32 // _replicas(cfg, name) + experts * FP32 // expt_dp


def _replicas(cfg: MimoConfig, name: str) -> int:
    """The gradient replica group's size: ``dp x cp`` (``data_parallel.replica_group``)."""
    par = cfg.modules[name].parallel
    return par.data * par.context


def reduce_bucket_bytes(cfg: MimoConfig, name: str, num_params: int) -> int:
    """Buffers of the data-parallel gradient reduction alive at once (0 if none).

    ``num_params`` are the parameters that train (a frozen tower's are not reduced).
    Nothing is reduced with one replica or for a frozen module. Otherwise one bucket
    (``train.grad_bucket_mb`` of fp32 gradients) at a time: the flat copy an all-reduce
    sums (:class:`mimotron.parallel.grad_sync.GradSync`), or under ZeRO-1
    the padded rank-major copy a reduce-scatter sends plus the ``1 / replicas`` it
    receives. With ``train.overlap_grad_reduce`` every bucket is launched during the
    last backward and keeps its buffers until the step waits for them
    (:mod:`mimotron.parallel.grad_sync`): a whole extra gradient copy (ZeRO-1: plus
    ``1 / replicas``). The estimate counts it after the backward; while the last
    backward launches the first buckets it still holds part of one micro-batch's
    activations, which this leaves out.
    """
    mod = cfg.modules[name]
    replicas = _replicas(cfg, name)
    if replicas == 1 or mod.fully_frozen or num_params == 0:
        return 0
    grads = num_params * 4
    held = grads if cfg.train.overlap_grad_reduce else min(grads, _bucket_bytes(cfg))
    return held + held // replicas if mod.parallel.shard_optimizer else held


def param_gather_bytes(cfg: MimoConfig, name: str, num_params: int) -> int:
    """Buffers of a ZeRO-1 module's parameter all-gather alive at once (0 if none).

    One bucket at a time (the rows of every rank, plus the ``1 / replicas`` this rank
    sends); with ``train.overlap_param_gather`` every bucket's, until the next forward
    lands them (:meth:`mimotron.parallel.zero.ZeroShards.gather_params`): a whole extra
    copy of the module's parameters. The rows are the weights' dtype: fp32, or 16 bits
    with master weights (:func:`has_master_weights`), in buckets sized in fp32.
    ``num_params`` are the parameters that train (only those are sharded).
    """
    mod = cfg.modules[name]
    replicas = _replicas(cfg, name)
    if replicas == 1 or mod.fully_frozen or num_params == 0 or not mod.parallel.shard_optimizer:
        return 0
    width = BYTES[cfg.train.precision] if has_master_weights(cfg, name) else FP32
    weights = num_params * width
    bucket = _bucket_bytes(cfg) * width // FP32
    held = weights if cfg.train.overlap_param_gather else min(weights, bucket)
    return held + held // replicas


def _bucket_bytes(cfg: MimoConfig) -> int:
    return int(cfg.train.grad_bucket_mb * 2**20)
