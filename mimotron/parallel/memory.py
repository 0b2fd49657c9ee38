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
from mimotron.parallel.layout import Layout
from mimotron.parallel.virtual_pipeline import rank_layers

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs for one module."""

    module: str
    num_params: int  # parameters held by this rank
    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


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


def activation_bytes(cfg: MimoConfig, name: str) -> int:
    """Rough activations kept for backward per rank and micro-batch (fp32 or compute dtype).

    Per transformer layer and token about ``34 * hidden`` bytes in 16-bit precision
    (Korthikanti et al., without recomputation), attention scores excluded since SDPA
    does not store them; divided by DP through the micro-batch slice. With TP ``t`` only
    the TP regions' ``24`` divide by ``t``: the ``10`` of the norm regions (norm inputs,
    the linears' inputs, dropout masks) is whole on every rank. Sequence parallelism
    (:mod:`mimotron.parallel.sequence_parallel`) divides the norm regions' ``6`` too;
    the ``4`` of the column-parallel linears' inputs stays whole, because the DTensor
    plans gather the input before the linear, which saves the gathered tensor (Megatron
    saves the shard and gathers again in backward, reaching ``34 / t``). Context
    parallelism (:mod:`mimotron.parallel.context_parallel`) holds ``seq / context``
    positions per rank, so it divides all of it (logits included); attention then also
    saves the all-gathered keys and values of the other ranks' positions for backward
    (after the GQA repeat: ``2 x 2`` bytes x ``hidden / t`` per position, 16-bit).
    Under ``train.encoder_batching`` an encoder holds every micro-batch of the step
    (:func:`encoder_batching_factor`).
    """
    mod = cfg.modules[name]
    par = mod.parallel
    samples = cfg.train.micro_batch_size // par.data
    tokens = (cfg.data.seq_length // par.context if mod.kind == "language"
              else mod.num_output_tokens)
    layers = -(-mod.num_layers // par.pipeline)
    scale = BYTES[cfg.train.precision] / 2
    whole, split = (4, 30) if par.sequence_parallel else (10, 24)
    per_layer = mod.hidden_size * tokens * samples * scale * (whole + split / par.tensor)
    if mod.kind == "language" and par.context > 1:
        others = cfg.data.seq_length - tokens  # the gathered K/V of the other CP ranks
        per_layer += mod.hidden_size * others * samples * scale * 4 / par.tensor
    logits = 0
    if mod.kind == "language":
        logits = 3 * samples * tokens * 4 * 64  # vocab ~ 64 classes: logits, softmax, grad
    # 1F1B keeps up to `pipeline` micro-batches in flight on the first stage; interleaved
    # 1F1B runs (p - 1) * 2 + (v - 1) * p warm-up forwards of one chunk each, plus one.
    v = par.virtual_pipeline
    if v > 1:
        chunk = -(-mod.num_layers // (par.pipeline * v))
        in_flight = per_layer * chunk * ((par.pipeline - 1) * 2 + (v - 1) * par.pipeline + 1)
    else:
        in_flight = per_layer * layers * par.pipeline
    return int((in_flight + logits) * encoder_batching_factor(cfg, name))


def encoder_batching_factor(cfg: MimoConfig, name: str) -> int:
    """How many micro-batches of module ``name``'s activations are alive at once, beyond
    the schedule's: ``num_microbatches`` for an encoder under ``train.encoder_batching``
    (it runs the whole step in one forward, :mod:`mimotron.pipeline.encoder_batching`),
    else 1."""
    if cfg.train.encoder_batching and cfg.modules[name].is_encoder:
        return cfg.num_microbatches
    return 1


def estimate_memory(
    cfg: MimoConfig, layout: Layout, vocab_size: int
) -> dict[int, list[MemoryEstimate]]:
    """Per-rank estimates, one entry per module the rank holds."""
    counts = {n: stage_parameter_counts(cfg, n, vocab_size) for n in cfg.modules}
    experts = {n: stage_expert_counts(cfg, n, vocab_size) for n in cfg.modules}
    master = 4
    compute = BYTES[cfg.train.precision] if cfg.train.precision != "fp32" else 0
    out: dict[int, list[MemoryEstimate]] = {}
    for rank in range(layout.world_size):
        out[rank] = []
        for role in layout.roles(rank):
            mod = cfg.modules[role.module]
            split = experts[role.module][role.pp] if experts[role.module] else None
            n = rank_parameter_count(cfg, role.module, counts[role.module][role.pp], split)
            frozen = mod.freeze
            # ZeRO shards over the replica group: dp, or dp x cp (data_parallel.replica_group).
            replicas = mod.parallel.data * mod.parallel.context
            opt_shard = replicas if mod.parallel.shard_optimizer else 1
            out[rank].append(
                MemoryEstimate(
                    module=role.module,
                    num_params=n,
                    weights=n * (master + compute),
                    grads=0 if frozen else n * 4,
                    optimizer=0 if frozen else n * 8 // opt_shard,
                    activations=activation_bytes(cfg, role.module),
                )
            )
    return out
