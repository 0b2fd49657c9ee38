"""Analytic per-rank memory estimate: weights, gradients, optimizer state, activations.

Used by ``mimotron plan`` and the memory benchmark. Parameter counts come from building
each pipeline stage on the ``meta`` device, so they match the real model exactly; the
tensor-parallel share divides every stage's count by the TP degree (norm weights are
replicated, a small overcount we accept); an MoE stage's routed experts are divided by
``expert x expert_tensor`` instead, and its routers and shared experts (whole on every
rank) are not divided.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimotron.config import MimoConfig
from mimotron.models.blocks import default_ffn_hidden_size
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout
from mimotron.parallel.virtual_pipeline import rank_layers

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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


def stage_parameter_counts(cfg: MimoConfig, name: str, vocab_size: int) -> list[int]:
    """Parameter count of each pipeline stage of a module (built on the meta device)."""
    from mimotron.models.build import build_module

    par = cfg.modules[name].parallel
    # Under interleaving a rank holds its chunks' layers (and stage 0 / p-1 the ends).
    stages = [rank_layers(cfg.modules[name].num_layers, par, s)[0] for s in range(par.pipeline)]
    counts = []
    for s, layers in enumerate(stages):
        with torch.device("meta"):
            mod = build_module(
                cfg,
                name,
                vocab_size,
                layer_ids=layers,
                pre_process=s == 0,
                post_process=s == len(stages) - 1,
                init=False,
            )
        counts.append(sum(p.numel() for p in mod.parameters()))
    return counts


def stage_expert_counts(cfg: MimoConfig, name: str, vocab_size: int
                        ) -> list[tuple[int, int]]:
    """Per pipeline stage ``(routed expert params, router + shared expert params)``.

    Both are part of :func:`stage_parameter_counts`. Routed experts are split over
    ``expert x expert_tensor`` ranks; the routers and shared experts are whole on every
    rank of the module (not tensor parallel). ``[]`` for a dense module.
    """
    from mimotron.models.build import build_module, moe_options
    from mimotron.models.moe import moe_layers

    mod = cfg.modules[name]
    if mod.kind != "language" or moe_options(mod) is None:
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


# Norms, residual stream and the loss stay in fp32 under autocast (embeddings and norm
# weights are fp32; the residual adds promote the 16-bit branch outputs back to fp32).
FP32 = 4


def layer_bytes_per_token(cfg: MimoConfig, name: str) -> tuple[int, int]:
    """Bytes one transformer layer saves for backward per token: ``(whole, tp_split)``.

    Counted from :class:`~mimotron.models.blocks.TransformerBlock` (``tests/test_memory.py``
    checks the count against the tensors autograd saves), with ``h`` the width, ``f``
    the SwiGLU width, ``c`` the compute dtype's bytes:

    * norm regions, ``2 x 2 x 4h``: each RMSNorm keeps its input and the normalised
      tensor before the weight, in fp32;
    * the column-parallel linears' inputs: the norm's output (``2 x 4h``, shared by
      q/k/v and by w1/w3) in fp32; under autocast each linear casts its own copy
      (``5 x c h``: wq, wk, wv, w1, w3). An encoder's residual stream keeps its front
      end's transposed memory order (``[n, hidden, tokens]``), so each of its linears
      copies the input to a contiguous one in fp32 too (``5 x c h``);
    * attention, ``5 x c h`` with RoPE (the language model): rotated q and k, v (after
      the GQA repeat: all query heads), SDPA's output and the heads-merged input of
      ``wo`` (a copy, because RoPE's output is contiguous per head); ``4 x c h`` without
      (encoders: the merge is a view of the output);
    * SwiGLU, ``4 x c f``: gate, silu(gate), up and their product.

    With TP ``t`` the attention and SwiGLU tensors divide by ``t``, the rest is whole;
    sequence parallelism (:mod:`mimotron.parallel.sequence_parallel`) divides the norm
    regions too, but the DTensor plans gather the linears' input before the linear,
    which saves the gathered tensor whole (Megatron saves the shard and gathers again
    in backward).
    """
    mod = cfg.modules[name]
    h, c = mod.hidden_size, BYTES[cfg.train.precision]
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    norms = 2 * 2 * FP32 * h
    if cfg.train.precision == "fp32" and mod.kind == "language":
        linear_inputs = 2 * FP32 * h
    else:
        linear_inputs = 5 * c * h
    attention = (5 if mod.kind == "language" else 4) * c * h
    split = attention + 4 * c * f
    if mod.parallel.sequence_parallel:
        return linear_inputs, split + norms
    return norms + linear_inputs, split


def ends_bytes_per_sample(cfg: MimoConfig, name: str, tokens: int, vocab_size: int
                          ) -> tuple[int, int]:
    """Saved bytes per sample outside the layers: ``(first stage, last stage)``.

    Last stage: the final norm (input and normalised tensor, fp32) and the head's input;
    for the language model the loss keeps the log-softmax of the logits (fp32, the
    vocabulary divided by TP), for an encoder the projector keeps GELU's input and
    ``fc2``'s input. First stage of an encoder: its front end's saved input (the raw
    image or spectrogram, cast to the compute dtype) and, for audio, the frame-rate GELU
    input and pooling-conv input. The language model's embedding saves only indices.
    """
    mod = cfg.modules[name]
    h, c, t = mod.hidden_size, BYTES[cfg.train.precision], mod.parallel.tensor
    head_input = FP32 * h if cfg.train.precision == "fp32" else c * h
    norm = 2 * FP32 * h // (t if mod.parallel.sequence_parallel else 1)
    if mod.kind == "language":
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
    (:func:`~mimotron.pipeline.in_flight.held_forwards_peak`): the 1F1B plan
    (:func:`mimotron.pipeline.plan.build_1f1b_plan`) runs ``total - position - 1``
    warm-up forwards before the first backward, so a stage holds ``min(total - position,
    m)``; an encoder on its own ranks is a pipeline position ahead of the language
    model, so it keeps one more micro-batch than its own pipeline depth, and more when
    it feeds an interleaved language model (a longer warm-up). One with
    ``train.schedule`` other than ``1f1b`` and in colocated layouts (one position).
    Under interleaving the count is of model-chunk forwards
    (:func:`interleaved_chunks_in_flight`). Under ``train.encoder_batching`` an encoder
    holds every micro-batch of the step (:func:`encoder_batching_factor`).
    """
    from mimotron.pipeline.in_flight import held_forwards_peak

    return int(held_forwards_peak(cfg, layout, name, stage))


def encoder_batching_factor(cfg: MimoConfig, name: str) -> int:
    """How many micro-batches of module ``name``'s activations are alive at once, beyond
    the schedule's: ``num_microbatches`` for an encoder under ``train.encoder_batching``
    (it runs the whole step in one forward, :mod:`mimotron.pipeline.encoder_batching`),
    else 1. For a frozen encoder that multiplies its outputs only: it saves nothing for
    backward (:func:`frozen_encoder_output_bytes`)."""
    if cfg.train.encoder_batching and cfg.modules[name].is_encoder:
        return cfg.num_microbatches
    return 1


def interleaved_chunks_in_flight(cfg: MimoConfig, name: str, stage: int,
                                 layout: Layout | None = None) -> int:
    """Model-chunk forwards an interleaved rank holds at once, at the peak of its plan.

    Replayed from the rank's interleaved plan (:func:`microbatches_in_flight`):
    Megatron's :func:`~mimotron.pipeline.interleaved_plan.num_warmup` forwards before
    the first backward, then one more before each backward (capped at the step's ``m x
    v``); an encoder feeding an interleaved language model warms up longer, and that is
    counted. At ``pipeline = 8 x virtual_pipeline = 2`` stage 0 holds 23.

    Args:
        cfg: the run config.
        name: the module.
        stage: the pipeline stage.
        layout: the config's layout (``None``: planned here).
    """
    from mimotron.parallel.layout import plan_layout

    return microbatches_in_flight(cfg, layout or plan_layout(cfg), name, stage)


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
    (:func:`~mimotron.pipeline.in_flight.held_forwards_peak`); a number ``in_flight``
    spreads that many chunk forwards evenly over the chunks. A frozen
    encoder holds only its outputs (:func:`frozen_encoder_output_bytes`).
    """
    from mimotron.parallel.layout import plan_layout
    from mimotron.pipeline.in_flight import held_forwards_peak

    mod = cfg.modules[name]
    par = mod.parallel
    samples = cfg.train.micro_batch_size // par.data
    tokens = (cfg.data.seq_length // par.context if mod.kind == "language"
              else mod.num_output_tokens)
    if in_flight is None and layout is None:
        layout = plan_layout(cfg)
    if mod.freeze and mod.is_encoder:
        # Its outputs only: those of its last chunk's forwards held.
        last_chunk = [0.0] * (par.virtual_pipeline - 1) + [1.0]
        return frozen_encoder_output_bytes(cfg, name, stage) * samples * int(
            held_forwards_peak(cfg, layout, name, stage, last_chunk)
            if in_flight is None else in_flight)
    layers, chunks = rank_layers(mod.num_layers, par, stage)
    whole, split = layer_bytes_per_token(cfg, name)
    per_layer = tokens * (whole + split // par.tensor)
    if mod.kind == "language" and par.context > 1:
        others = cfg.data.seq_length - tokens  # the gathered K/V of the other CP ranks
        per_layer += mod.hidden_size * others * 2 * BYTES[cfg.train.precision] // par.tensor
    first, last = ends_bytes_per_sample(cfg, name, tokens, vocab_size)
    ends = (first if stage == 0 else 0) + (last if stage == par.pipeline - 1 else 0)
    if chunks is not None:
        v, layer_part = len(chunks), per_layer * len(layers)  # one micro-batch's, all chunks
        if in_flight is not None:
            return int((layer_part * in_flight / v + ends * -(-in_flight // v)) * samples)
        per_chunk = [layer_part / v + (first if stage == 0 and c == 0 else 0)
                     + (last if stage == par.pipeline - 1 and c == v - 1 else 0)
                     for c in range(v)]
        return int(held_forwards_peak(cfg, layout, name, stage, per_chunk) * samples)
    one = per_layer * len(layers) + ends
    if in_flight is None:
        in_flight = microbatches_in_flight(cfg, layout, name, stage)
    return int(one * samples * in_flight)


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


def backward_workspace_bytes(cfg: MimoConfig, name: str) -> int:
    """The largest temporary of a backward on top of the saved activations.

    Measured on the digits language model (``benchmarks/memory.py``, per-phase marks): the
    peak comes in the backward of the last micro-batch's SwiGLU, where the gradient of
    the inner width (``c f`` per token, divided by TP) is live while every saved tensor
    of the layer still is.
    """
    mod = cfg.modules[name]
    par = mod.parallel
    samples = cfg.train.micro_batch_size // par.data
    tokens = (cfg.data.seq_length // par.context if mod.kind == "language"
              else mod.num_output_tokens)
    f = mod.ffn_hidden_size or default_ffn_hidden_size(mod.hidden_size)
    return samples * tokens * BYTES[cfg.train.precision] * f // par.tensor


def estimate_memory(
    cfg: MimoConfig, layout: Layout, vocab_size: int, ranks: list[int] | None = None
) -> dict[int, list[MemoryEstimate]]:
    """Per-rank estimates, one entry per module the rank holds (of ``ranks``; None: all)."""
    counts = {n: stage_parameter_counts(cfg, n, vocab_size) for n in cfg.modules}
    experts = {n: stage_expert_counts(cfg, n, vocab_size) for n in cfg.modules}
    master = 4
    compute = BYTES[cfg.train.precision] if cfg.train.precision != "fp32" else 0
    out: dict[int, list[MemoryEstimate]] = {}
    # Per (module, stage): the peak of its plan's held forwards (one replay per stage).
    activations: dict[tuple[str, int], int] = {}
    for rank in range(layout.world_size) if ranks is None else ranks:
        out[rank] = []
        for role in layout.roles(rank):
            mod = cfg.modules[role.module]
            if (role.module, role.pp) not in activations:
                activations[(role.module, role.pp)] = activation_bytes(
                    cfg, role.module, vocab_size, None, role.pp, layout)
            split = experts[role.module][role.pp] if experts[role.module] else None
            n = rank_parameter_count(cfg, role.module, counts[role.module][role.pp], split)
            frozen = mod.freeze
            out[rank].append(
                MemoryEstimate(
                    module=role.module,
                    num_params=n,
                    weights=n * (master + compute),
                    grads=0 if frozen else n * 4,
                    optimizer=0 if frozen else optimizer_state_bytes(cfg, role.module, n, split),
                    activations=activations[(role.module, role.pp)],
                    workspace=0 if frozen else backward_workspace_bytes(cfg, role.module),
                    reduce_bucket=reduce_bucket_bytes(cfg, role.module, n),
                    param_gather=param_gather_bytes(cfg, role.module, n),
                )
            )
    return out


def optimizer_state_bytes(cfg: MimoConfig, name: str, num_params: int,
                          expert_split: tuple[int, int] | None) -> int:
    """Two fp32 Adam moments per parameter a rank holds (of its local TP / expert shards).

    Under ZeRO-1 (:mod:`mimotron.parallel.zero`) each rank keeps the moments of its rows
    only: the dense part's divided by the replica group (``dp x cp``), the routed
    experts' by ``expt_dp`` (the ranks holding the same expert shard). With one replica
    nothing is sharded.
    """
    par = cfg.modules[name].parallel
    if not par.shard_optimizer or _replicas(cfg, name) == 1:
        return num_params * 8
    experts = 0 if expert_split is None else expert_split[0] // (par.expert * par.expert_tensor)
    expt_dp = par.size // (par.expert * par.expert_tensor * par.pipeline)
    return (num_params - experts) * 8 // _replicas(cfg, name) + experts * 8 // expt_dp


def _replicas(cfg: MimoConfig, name: str) -> int:
    """The gradient replica group's size: ``dp x cp`` (``data_parallel.replica_group``)."""
    par = cfg.modules[name].parallel
    return par.data * par.context


def reduce_bucket_bytes(cfg: MimoConfig, name: str, num_params: int) -> int:
    """Buffers of the data-parallel gradient reduction alive at once (0 if none).

    Nothing is reduced with one replica or for a frozen module. Otherwise one bucket
    (``train.grad_bucket_mb`` of fp32 gradients) at a time: the flat copy an all-reduce
    sums (:func:`mimotron.parallel.data_parallel.allreduce_gradients`), or under ZeRO-1
    the padded rank-major copy a reduce-scatter sends plus the ``1 / replicas`` it
    receives. With ``train.overlap_grad_reduce`` every bucket is launched during the
    last backward and keeps its buffers until the step waits for them
    (:mod:`mimotron.parallel.overlap`): a whole extra gradient copy (ZeRO-1: plus
    ``1 / replicas``). The estimate counts it after the backward; while the last
    backward launches the first buckets it still holds part of one micro-batch's
    activations, which this leaves out.
    """
    mod = cfg.modules[name]
    replicas = _replicas(cfg, name)
    if replicas == 1 or mod.freeze:
        return 0
    grads = num_params * 4
    held = grads if cfg.train.overlap_grad_reduce else min(grads, _bucket_bytes(cfg))
    return held + held // replicas if mod.parallel.shard_optimizer else held


def param_gather_bytes(cfg: MimoConfig, name: str, num_params: int) -> int:
    """Buffers of a ZeRO-1 module's parameter all-gather alive at once (0 if none).

    One bucket at a time (the fp32 rows of every rank, plus the ``1 / replicas`` this
    rank sends); with ``train.overlap_param_gather`` every bucket's, until the next
    forward lands them (:meth:`mimotron.parallel.zero.ZeroShards.gather_params`): a
    whole extra copy of the module's parameters.
    """
    mod = cfg.modules[name]
    replicas = _replicas(cfg, name)
    if replicas == 1 or mod.freeze or not mod.parallel.shard_optimizer:
        return 0
    weights = num_params * 4
    held = weights if cfg.train.overlap_param_gather else min(weights, _bucket_bytes(cfg))
    return held + held // replicas


def _bucket_bytes(cfg: MimoConfig) -> int:
    return int(cfg.train.grad_bucket_mb * 2**20)
