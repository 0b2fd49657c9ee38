"""The per-lane costs the step-time model simulates: one (module, stage) at a time.

A *lane* (:class:`~mimotron.planner.simulate.Lane`) is the ranks of one module stage,
which run one plan together. :func:`lane_cost` gathers what one micro-batch costs such a
rank per model chunk (compute as cores-bound work, its collectives as fixed time), and
what it does after its last backward: the exposed data-parallel reduction and the
optimizer step. :func:`transfer_seconds` prices the messages between lanes (the next
stage's input, the bridge from an encoder to the language model, gradients back).
"""

from __future__ import annotations

from dataclasses import dataclass

from mimotron.config.schema import MimoConfig
from mimotron.estimate.memory import has_master_weights, items_per_sample
from mimotron.estimate.widths import BYTES
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout
from mimotron.planner.calibration_data import Calibration
from mimotron.planner.devices import DeviceSpec
from mimotron.planner.simulate import MessageKey, StageKey
from mimotron.planner.terms import (
    Links,
    chunk_collectives,
    chunk_compute,
    replica_ranks,
    stage_params,
    stage_shape,
    trainable_params,
)

OPTIMIZER_BYTES_PER_PARAM = 32
"""Adam reads and writes weight, gradient and two moments (fp32): about 32 B each step."""
HBM_OVER_LINK = 10
"""Memory bandwidth as a multiple of the intra-node link's (H100: ~3.4 TB/s vs 360 GB/s);
the optimizer step is memory bound."""


@dataclass(frozen=True)
class LaneCost:
    """One (module, stage)'s per-micro-batch pieces and its after-backward tail.

    Attributes:
        compute: ``(kind, chunk) -> (work_s, fixed_s)`` as the simulation takes it.
        work: compute seconds of one micro-batch (forward + backward, every chunk).
        collectives: TP / SP / CP / EP seconds of one micro-batch.
        fsdp: FSDP2's gathers and reduce-scatters of one micro-batch, not overlapped.
        reduction: the data-parallel reduction left exposed after the backward.
        optimizer: the optimizer step.
    """

    compute: dict[tuple[str, int], tuple[float, float]]
    work: float
    collectives: float
    fsdp: float
    reduction: float
    optimizer: float


def lane_cost(cfg: MimoConfig, layout: Layout, name: str, stage: int, vocab: int,
              device: DeviceSpec, calibration: Calibration | None, links: Links) -> LaneCost:
    """What one rank of module ``name``'s ``stage`` spends per micro-batch and after."""
    placement = layout.modules[name]
    par = placement.parallel
    compute: dict[tuple[str, int], tuple[float, float]] = {}
    work = coll = fsdp = backward = forward = 0.0
    gathers = _fsdp_seconds(cfg, name, stage, vocab, layout, links)
    for chunk in range(par.virtual_pipeline if not layout.colocated else 1):
        f_s, b_s = chunk_compute(cfg, name, stage, chunk, vocab, device, calibration)
        cf, cb = chunk_collectives(cfg, name, stage, chunk, placement, links)
        share = 1.0 / par.virtual_pipeline
        gf = max(0.0, gathers[0] * share - f_s)  # FSDP2 prefetches: hidden by compute
        gb = max(0.0, gathers[1] * share - b_s)
        compute[("F", chunk)] = (f_s, cf + gf)
        compute[("B", chunk)] = (b_s, cb + gb)
        work, coll, fsdp = work + f_s + b_s, coll + cf + cb, fsdp + gf + gb
        forward, backward = forward + f_s, backward + b_s
    reduction = _reduction_seconds(cfg, name, stage, vocab, layout, links, forward, backward)
    return LaneCost(compute, work, coll, fsdp, reduction,
                    _optimizer_seconds(cfg, name, stage, vocab, device))


def colocated_lane_cost(cfg: MimoConfig, layout: Layout, vocab: int, device: DeviceSpec,
                        calibration: Calibration | None, links: Links
                        ) -> tuple[LaneCost, float]:
    """The one lane of a colocated layout (every module on every rank, in turn), and
    the bridge's seconds per micro-batch (inside it)."""
    parts = {m: lane_cost(cfg, layout, m, 0, vocab, device, calibration, links)
             for m in layout.modules}
    bridge = sum(colocated_bridge(cfg, layout, links, m) for m in cfg.encoder_names)
    f = [sum(p.compute[("F", 0)][i] for p in parts.values()) for i in (0, 1)]
    b = [sum(p.compute[("B", 0)][i] for p in parts.values()) for i in (0, 1)]
    compute = {("F", 0): (f[0], f[1] + bridge / 2), ("B", 0): (b[0], b[1] + bridge / 2)}
    total = LaneCost(compute, sum(p.work for p in parts.values()),
                     sum(p.collectives for p in parts.values()),
                     sum(p.fsdp for p in parts.values()),
                     sum(p.reduction for p in parts.values()),
                     sum(p.optimizer for p in parts.values()))
    return total, bridge


def colocated_bridge(cfg: MimoConfig, layout: Layout, links: Links, encoder: str) -> float:
    """The colocated bridge's all-gather (forward) and all-reduce (backward) of the
    micro-batch's rows, or into a context-parallel language model one all-to-all each way
    of a rank's own rows (:mod:`mimotron.pipeline.colocated_cp`); 0 when each rank's
    encoder and language slices coincide (rows pass through). Over the encoder's ranks:
    the world, or the language model's first stage."""
    enc, lm = cfg.modules[encoder].parallel, cfg.modules[LANGUAGE].parallel
    # Rows pass through where every rank of the bridge holds the same slice of both:
    # an unpipelined language model, or encoders on its first stage only.
    if ((enc.data, enc.tensor) == (lm.data, lm.tensor) and lm.context == 1
            and (lm.pipeline == 1 or enc.size < lm.size)):
        return 0.0
    rows = (cfg.train.micro_batch_size * cfg.modules[encoder].num_output_tokens
            * items_per_sample(cfg, encoder))
    nbytes = rows * cfg.modules[LANGUAGE].hidden_size * BYTES[cfg.train.precision]
    ranks = list(layout.modules[encoder].ranks)
    if lm.context > 1:
        return 2 * links.cost("all_to_all", ranks, nbytes / (lm.data * lm.context))
    return links.cost("all_gather", ranks, nbytes) + links.cost("all_reduce", ranks, nbytes)


def _fsdp_seconds(cfg: MimoConfig, name: str, stage: int, vocab: int, layout: Layout,
                  links: Links) -> tuple[float, float]:
    """FSDP2's per-micro-batch (forward, backward) traffic: the gathered parameters in
    the compute dtype, and again plus the fp32 gradient reduce-scatter in backward."""
    par = cfg.modules[name].parallel
    if not par.fsdp or par.data == 1:
        return 0.0, 0.0
    params = stage_params(cfg, name, stage, vocab)
    ranks = replica_ranks(layout.modules[name], stage)
    gather = links.cost("all_gather", ranks, params * BYTES[cfg.train.precision])
    scatter = links.cost("reduce_scatter", ranks, trainable_params(cfg, name, stage, vocab) * 4)
    return gather, gather + scatter


def _reduction_seconds(cfg: MimoConfig, name: str, stage: int, vocab: int, layout: Layout,
                       links: Links, forward: float, backward: float) -> float:
    """The step's data-parallel reduction left exposed: an all-reduce of the fp32
    gradients (ZeRO-1: reduce-scatter + the parameters' all-gather), less the last
    backward under ``overlap_grad_reduce`` (and a forward under ``overlap_param_gather``)."""
    par = cfg.modules[name].parallel
    ranks = replica_ranks(layout.modules[name], stage)
    trained = trainable_params(cfg, name, stage, vocab)
    if len(ranks) == 1 or trained == 0 or (par.fsdp and par.data > 1):
        return 0.0
    grads = trained * 4
    if not par.shard_optimizer:
        reduce = links.cost("all_reduce", ranks, grads)
        return max(0.0, reduce - (backward if cfg.train.overlap_grad_reduce else 0.0))
    width = BYTES[cfg.train.precision] if has_master_weights(cfg, name) else 4
    scatter = links.cost("reduce_scatter", ranks, grads)
    gather = links.cost("all_gather", ranks, trained * width)
    return (max(0.0, scatter - (backward if cfg.train.overlap_grad_reduce else 0.0))
            + max(0.0, gather - (forward if cfg.train.overlap_param_gather else 0.0)))


def _optimizer_seconds(cfg: MimoConfig, name: str, stage: int, vocab: int,
                       device: DeviceSpec) -> float:
    """The optimizer step: memory bound, its state's bytes over the memory bandwidth."""
    par = cfg.modules[name].parallel
    params = trainable_params(cfg, name, stage, vocab)
    if par.shard_optimizer or par.fsdp:
        params /= par.data * par.context
    return params * OPTIMIZER_BYTES_PER_PARAM / (HBM_OVER_LINK * device.intra_node_bytes_per_s)


def transfer_seconds(cfg: MimoConfig, layout: Layout, links: Links, src: StageKey,
                     message: MessageKey) -> float:
    """Seconds of one message from lane ``src`` to its receiver (activations or their
    gradient: the same bytes): one rank's slice of the micro-batch."""
    src_module, src_stage = src
    _, dst_module, dst_stage, _, _ = message
    c = BYTES[cfg.train.precision]
    if src_module == dst_module:
        mod = cfg.modules[src_module]
        shape = stage_shape(cfg, src_module, src_stage)
        nbytes = shape.samples * shape.tokens * mod.hidden_size * c
    else:
        encoder = src_module if src_module != LANGUAGE else dst_module
        return _bridge_message_seconds(cfg, layout, links, encoder, src, message)
    a = layout.modules[src_module].rank_at(pp=src_stage)
    b = layout.modules[dst_module].rank_at(pp=dst_stage)
    return links.cost("p2p", [a, b], nbytes)


def _bridge_message_seconds(cfg: MimoConfig, layout: Layout, links: Links, encoder: str,
                            src: StageKey, message: MessageKey) -> float:
    """One micro-batch's bridge between ``encoder`` and the language model, one way:
    encoder tokens in the language model's width. An encoder rank with fewer DP
    replicas than the language model sends its slice to ``lm.data / enc.data`` ranks,
    one message each (fan-out); with more, a language rank receives that many (fan-in):
    the busier side's messages, in turn."""
    enc, lm = cfg.modules[encoder].parallel, cfg.modules[LANGUAGE].parallel
    per_sample = (cfg.modules[encoder].num_output_tokens * items_per_sample(cfg, encoder)
                  * cfg.modules[LANGUAGE].hidden_size * BYTES[cfg.train.precision])
    a = layout.modules[src[0]].rank_at(pp=src[1])
    b = layout.modules[message[1]].rank_at(pp=message[2])
    mbs = cfg.train.micro_batch_size
    sides = ((max(1, lm.data // enc.data), mbs / enc.data),  # an encoder rank sends
             (max(1, enc.data // lm.data), mbs / lm.data))  # a language rank receives
    return max(count * links.cost("p2p", [a, b], samples * per_sample / count)
               for count, samples in sides)


def bridge_seconds(cfg: MimoConfig, layout: Layout, links: Links) -> float:
    """A split layout's bridge per micro-batch: the slowest encoder's output to the
    language model and its gradient back."""
    out = 0.0
    for encoder in layout.topology:  # none in the language model alone
        p = layout.modules[encoder].parallel.pipeline
        message = ("F", LANGUAGE, 0, 0, 0)
        out = max(out, 2 * transfer_seconds(cfg, layout, links, (encoder, p - 1), message))
    return out
