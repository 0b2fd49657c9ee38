"""Per-(module, stage) costs of one micro-batch: compute, collectives, transfers.

The pieces :func:`mimotron.planner.cost.step_cost` puts on the simulated clock:

* **compute** — without a calibration, the stage's model FLOPs
  (:mod:`mimotron.estimate.flops`: its layers, the front end on the first stage, the
  head or projector on the last) over ``flops_per_s x tensor x tp_efficiency(tensor)``
  (:func:`tp_efficiency`: smaller matmuls run less efficiently) plus the device's
  ``layer_overhead_s`` per layer and end, per micro-batch; with one, the measured
  seconds of the whole module scaled by the stage's share of the layers, the samples
  per replica and ``1 / (tensor x tp_efficiency x context)``. Backward is twice the
  forward for what trains (once for a frozen language model, which still
  back-propagates to its input; nothing for a frozen encoder); recompute adds the
  recomputed layers' forward (``full``) or :data:`SELECTIVE_SHARE` of it
  (``selective``: norms, activations, RoPE, elementwise);
* **collectives** — per layer, TP's calls as the DTensor plan makes them
  (:func:`_tp_collectives`), CP's key/value all-gather forward and reduce-scatter backward, EP's two
  all-to-alls each way; FSDP2's parameter all-gathers and gradient reduce-scatter per
  micro-batch, less the compute they overlap (prefetch);
* **transfers** — a stage's output to the next stage, an encoder's to the language
  model (the bridge), the same bytes back as gradients.

Collective costs come from the calibration where it measured that kind (nearest group
size), else from the device: ``latency x ceil(log2 n) + bytes x factor / bandwidth``
with the ring factor of the kind (all-reduce ``2 (n - 1) / n``, all-gather,
reduce-scatter and all-to-all ``(n - 1) / n``) and the intra-node bandwidth when the
group's ranks share a node, else the inter-node one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mimotron.config.hf_specs import mlp_matrices
from mimotron.config.schema import MimoConfig, default_ffn_hidden_size
from mimotron.estimate.flops import (
    encoder_flops,
    language_layer_flops,
    language_model_flops,
    matmul_flops,
    projector_flops,
    transformer_layer_flops,
)
from mimotron.estimate.widths import BYTES, attention_widths
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import ModulePlacement
from mimotron.parallel.virtual_pipeline import stage_layers
from mimotron.planner.calibration_data import Calibration, LinkCost
from mimotron.planner.devices import DeviceSpec

SELECTIVE_SHARE = 0.1
"""Selective recompute re-runs a layer's elementwise work: this share of its forward."""
TP_EFFICIENCY_LOSS = 0.04
"""Matmul efficiency lost per doubling of the tensor-parallel degree."""


def ring_factor(kind: str, n: int) -> float:
    """Bytes a rank moves per byte of its buffer in a ring collective of ``n`` ranks:
    all-reduce ``2 (n - 1) / n``, all-gather / reduce-scatter / all-to-all
    ``(n - 1) / n``, a point-to-point message 1.

    Raises:
        ValueError: ``kind`` is not one of :data:`~mimotron.planner.calibration_data.COLLECTIVES`.
    """
    if kind == "p2p":
        return 1.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"collective kind={kind!r} is invalid: expected one of all_reduce, "
                     "all_gather, reduce_scatter, all_to_all, p2p")


def tp_efficiency(tensor: int) -> float:
    """Matmul efficiency at TP ``tensor`` relative to 1: ``1 - 0.04 log2(tensor)``."""
    return max(0.5, 1.0 - TP_EFFICIENCY_LOSS * math.log2(tensor))


@dataclass(frozen=True)
class Links:
    """How to price a collective on a layout's ranks: the device and the calibration."""

    device: DeviceSpec
    calibration: Calibration | None

    def cost(self, kind: str, ranks: list[int], num_bytes: float) -> float:
        """Seconds of collective ``kind`` over ``ranks`` (``num_bytes``: the per-rank
        buffer, as :class:`~mimotron.planner.calibration_data.Calibration` defines it)."""
        n = len(ranks)
        if n <= 1 and kind != "p2p":
            return 0.0
        return self.link(kind, ranks).seconds(num_bytes)

    def link(self, kind: str, ranks: list[int]) -> LinkCost:
        """The calibrated link of ``kind`` at this group size, else the device's."""
        n = len(ranks)
        if self.calibration is not None:
            measured = self.calibration.link(kind, n)
            if measured is not None:
                return measured
        d = self.device
        nodes = {r // d.devices_per_node for r in ranks}
        bandwidth = d.intra_node_bytes_per_s if len(nodes) == 1 else d.inter_node_bytes_per_s
        factor = ring_factor(kind, max(n, 2))
        hops = 1 if kind == "p2p" else max(1, math.ceil(math.log2(max(n, 2))))
        return LinkCost(d.latency_s * hops, bandwidth / factor)


def axis_ranks(placement: ModulePlacement, axis: str) -> list[int]:
    """The global ranks of the first group along mesh ``axis`` (tp, cp, dp, pp)."""
    size = placement.shape[("tp", "cp", "dp", "pp").index(axis)]
    return [placement.rank_at(**{axis: i}) for i in range(size)]


def replica_ranks(placement: ModulePlacement, stage: int = 0) -> list[int]:
    """The first gradient-replica group (``dp x cp``) of a module's pipeline ``stage``:
    each stage reduces among its own ranks, which may span nodes where stage 0's do not."""
    p = placement.parallel
    return [placement.rank_at(cp=c, dp=d, pp=stage) for d in range(p.data)
            for c in range(p.context)]


@dataclass(frozen=True)
class StageShape:
    """What one rank of a (module, stage) processes per micro-batch."""

    samples: float  # samples per data-parallel replica
    tokens: int  # tokens per sample the rank holds (seq / context for the LM)
    layers: list[int]  # layers per model chunk on this stage
    first: bool
    last: bool


def stage_shape(cfg: MimoConfig, name: str, stage: int) -> StageShape:
    """The micro-batch slice and the layers per chunk of one stage of module ``name``."""
    mod = cfg.modules[name]
    par = mod.parallel
    samples = cfg.train.micro_batch_size / par.data
    tokens = cfg.data.seq_length // par.context if not mod.is_encoder else mod.num_output_tokens
    v = par.virtual_pipeline
    if v > 1:
        chunks = stage_layers(mod.num_layers, par.pipeline * v)
        layers = [len(chunks[j * par.pipeline + stage]) for j in range(v)]
    else:
        layers = [len(stage_layers(mod.num_layers, par.pipeline, par.layers_per_stage)[stage])]
    return StageShape(samples, tokens, layers, stage == 0, stage == par.pipeline - 1)


def _flops_per_layer(cfg: MimoConfig, name: str, shape: StageShape) -> float:
    """Forward FLOPs of one layer on one rank's slice (before the TP split)."""
    mod = cfg.modules[name]
    if mod.is_encoder:
        return transformer_layer_flops(shape.samples, shape.tokens, mod.hidden_size,
                                       mod.ffn_hidden_size, mlp_matrices(mod))
    return language_layer_flops(mod, shape.samples, cfg.data.seq_length) / mod.parallel.context


def _ends_flops(cfg: MimoConfig, name: str, shape: StageShape, vocab: int
                ) -> tuple[float, float]:
    """Forward FLOPs outside the layers: (first stage's front end, last stage's end)."""
    mod = cfg.modules[name]
    lm_h = cfg.modules[LANGUAGE].hidden_size
    if mod.is_encoder:
        whole = encoder_flops(mod, lm_h, shape.samples)
        proj = projector_flops(mod, lm_h, shape.samples)
        layers = mod.num_layers * _flops_per_layer(cfg, name, shape)
        return whole - proj - layers, proj
    head = matmul_flops(shape.samples * shape.tokens, vocab, mod.hidden_size)
    return 0.0, head


def module_forward_flops(cfg: MimoConfig, name: str, vocab: int) -> float:
    """Forward FLOPs of the whole module on one micro-batch (for the calibration's share)."""
    mod = cfg.modules[name]
    samples = cfg.train.micro_batch_size
    lm_h = cfg.modules[LANGUAGE].hidden_size
    if mod.is_encoder:
        return encoder_flops(mod, lm_h, samples)
    return language_model_flops(mod, vocab, samples, cfg.data.seq_length)


def backward_factor(cfg: MimoConfig, name: str) -> float:
    """Backward FLOPs over forward: 2 trains, 1 frozen LM or LoRA adapters (input
    gradients only), 0 frozen encoder/tower."""
    mod = cfg.modules[name]
    if mod.lora.rank:
        return 1.0
    if not mod.freeze:
        return 2.0
    return 0.0 if mod.is_encoder else 1.0


def chunk_compute(cfg: MimoConfig, name: str, stage: int, chunk: int, vocab: int,
                  device: DeviceSpec, calibration: Calibration | None
                  ) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one micro-batch through one model chunk of a stage,
    compute only (the rank's TP share, recompute included in the backward)."""
    mod = cfg.modules[name]
    par = mod.parallel
    shape = stage_shape(cfg, name, stage)
    n_layers = shape.layers[chunk]
    first = shape.first and chunk == 0
    last = shape.last and chunk == len(shape.layers) - 1
    layer = _flops_per_layer(cfg, name, shape)
    front, end = _ends_flops(cfg, name, shape, vocab)
    fwd_flops = n_layers * layer + (front if first else 0.0) + (end if last else 0.0)
    back = backward_factor(cfg, name) * fwd_flops
    if mod.tower_frozen and last:
        back = 2.0 * end  # only the projector trains
    recomputed = _recomputed_layers(cfg, name, n_layers)
    extra = 0.0 if mod.recompute == "none" else recomputed * layer * (
        1.0 if mod.recompute == "full" else SELECTIVE_SHARE)
    if backward_factor(cfg, name) == 0.0:
        extra = 0.0  # no backward, nothing recomputed
    rate = par.tensor * tp_efficiency(par.tensor)
    if calibration is not None and name in calibration.module_seconds:
        f_s, b_s = calibration.module_seconds[name]
        # The fixed part (per micro-batch, not per sample) is paid by every rank of
        # the stage in full, for its share of the layers; the rest scales by FLOPs.
        fixed_f, fixed_b = calibration.module_fixed_seconds.get(name, (0.0, 0.0))
        f_s, b_s = max(0.0, f_s - fixed_f), max(0.0, b_s - fixed_b)
        measured_samples = calibration.samples or cfg.train.micro_batch_size
        # FLOPs of the micro-batch the times were measured on (module_forward_flops
        # counts this config's whole micro-batch, whatever its DP share or size).
        whole = (module_forward_flops(cfg, name, vocab) * measured_samples
                 / cfg.train.micro_batch_size)
        scale_f = f_s / whole if whole else 0.0  # seconds per forward FLOP, as measured
        whole_b = _measured_backward_flops(cfg, name, whole, measured_samples)
        scale_b = b_s / whole_b if b_s and whole_b else scale_f
        here = whole * shape.samples / measured_samples  # the module at this shape
        share = min(1.0, fwd_flops / here) if here else 1.0
        return (fwd_flops * scale_f / rate + fixed_f * share,
                (back * scale_b + extra * scale_f) / rate + fixed_b * share)
    flops_rate = device.flops_per_s * rate
    # The fixed part, as a calibration's: paid whole per micro-batch by every rank of
    # the stage (neither the samples nor TP shrink it), per layer and end it runs.
    units = n_layers + (1 if first else 0) + (1 if last else 0)
    fixed_f = device.layer_overhead_s * units
    fixed_b = fixed_f * (backward_factor(cfg, name) + (recomputed if extra else 0) / units)
    if mod.tower_frozen and last:
        fixed_b = 2.0 * device.layer_overhead_s  # the projector's backward alone
    return (fwd_flops / flops_rate + fixed_f,
            (back + extra) / flops_rate + fixed_b)


def _measured_backward_flops(cfg: MimoConfig, name: str, forward: float, samples: int
                             ) -> float:
    """Backward FLOPs of the micro-batch a calibration measured (``forward``: its
    forward FLOPs): a frozen tower's backward is its projector's alone."""
    mod = cfg.modules[name]
    if mod.tower_frozen:
        return 2.0 * projector_flops(mod, cfg.modules[LANGUAGE].hidden_size, samples)
    return backward_factor(cfg, name) * forward


def _recomputed_layers(cfg: MimoConfig, name: str, n_layers: int) -> int:
    """Layers of a chunk recompute re-runs (``recompute_num_layers``: the first n)."""
    mod = cfg.modules[name]
    if mod.recompute == "none":
        return 0
    return min(n_layers, mod.recompute_num_layers) if mod.recompute_num_layers else n_layers


def chunk_collectives(cfg: MimoConfig, name: str, stage: int, chunk: int,
                      placement: ModulePlacement, links: Links) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of a chunk's TP / SP / CP / EP collectives."""
    mod = cfg.modules[name]
    par = mod.parallel
    shape = stage_shape(cfg, name, stage)
    n_layers = shape.layers[chunk]
    c = BYTES[cfg.train.precision]
    act = shape.samples * shape.tokens * mod.hidden_size * c
    fwd = bwd = 0.0
    if par.tensor > 1:
        tf, tb = _tp_collectives(cfg, name, shape, chunk, axis_ranks(placement, "tp"), links)
        fwd, bwd = fwd + tf, bwd + tb
    if par.context > 1:
        _, kv_width = attention_widths(cfg, name)
        kv = 2 * shape.samples * cfg.data.seq_length * kv_width * c / par.tensor
        ranks = axis_ranks(placement, "cp")
        fwd += n_layers * links.cost("all_gather", ranks, kv)
        bwd += n_layers * links.cost("reduce_scatter", ranks, kv)
    if par.expert > 1 and mod.num_experts:
        send = act * mod.top_k
        ep_ranks = [placement.rank_offset + i * par.tensor for i in range(par.expert)]
        a2a = 2 * links.cost("all_to_all", ep_ranks, send)
        fwd, bwd = fwd + a2a * n_layers, bwd + a2a * n_layers
    return fwd, bwd


def _tp_collectives(cfg: MimoConfig, name: str, shape: StageShape, chunk: int,
                    ranks: list[int], links: Links) -> tuple[float, float]:
    """``(forward_s, backward_s)`` of one micro-batch's TP collectives in one chunk, one
    call per call the DTensor plan makes (:mod:`mimotron.parallel.tensor_parallel`;
    counted on gloo, 2026-12-02): small calls cost their latency, so the count matters.

    Without SP each row-wise projection (``wo``, ``w2``) all-reduces its output in
    forward and each column-wise one (``wq``, ``wk``, ``wv``, ``w1``, ``w3``; a Hugging
    Face encoder layer has no ``w3``) its input's gradient in backward, one call each.
    With SP each of a layer's two regions all-gathers its input and reduce-scatters
    its output in forward, the reverse in backward. Ends: the language model's
    vocabulary-parallel embedding (an all-reduce) and its column-wise head (an
    all-reduce of its input's gradient, or SP's gather / scatter) and loss (4 small
    all-reduces of ``[samples, tokens]``); an encoder's projector (``fc2``'s output,
    ``fc1``'s input gradient).
    """
    mod = cfg.modules[name]
    c = BYTES[cfg.train.precision]
    act = shape.samples * shape.tokens * mod.hidden_size * c
    n_layers = shape.layers[chunk]
    first = shape.first and chunk == 0
    last = shape.last and chunk == len(shape.layers) - 1
    all_reduce = links.cost("all_reduce", ranks, act)
    if mod.parallel.sequence_parallel:
        region = links.cost("all_gather", ranks, act) + links.cost("reduce_scatter", ranks, act)
        fwd = bwd = 2 * region * n_layers + (region / 2 if last else 0.0)
    else:
        columns = 4 if mod.is_encoder and mod.hf_path else 5
        fwd, bwd = 2 * all_reduce * n_layers, columns * all_reduce * n_layers
        bwd += all_reduce if last and not mod.is_encoder else 0.0
    if mod.is_encoder:
        if last:
            lm_width = cfg.modules[LANGUAGE].hidden_size
            fwd += links.cost("all_reduce", ranks, shape.samples * shape.tokens * lm_width * c)
            bwd += all_reduce
        return fwd, bwd
    fwd += all_reduce if first else 0.0
    if last:
        fwd += 4 * links.cost("all_reduce", ranks, shape.samples * shape.tokens * 4)
    return fwd, bwd


def layer_params(cfg: MimoConfig, name: str) -> float:
    """Parameters of one layer (whole, before TP): attention + MLP (MoE experts / EP;
    a Hugging Face encoder's MLP has two matrices, SwiGLU three)."""
    mod = cfg.modules[name]
    h = mod.hidden_size
    q_width, kv_width = attention_widths(cfg, name)
    attention = h * (2 * q_width + 2 * kv_width)
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    if mod.num_experts:
        fe = mod.moe_ffn_hidden_size or f
        return attention + 3 * h * fe * mod.num_experts / mod.parallel.expert
    return attention + mlp_matrices(mod) * h * f


def stage_params(cfg: MimoConfig, name: str, stage: int, vocab: int) -> float:
    """Parameters one rank of a stage holds (its TP share), for bytes on the wire."""
    mod = cfg.modules[name]
    shape = stage_shape(cfg, name, stage)
    n = sum(shape.layers) * layer_params(cfg, name)
    h = mod.hidden_size
    if mod.is_encoder:
        mid = mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size
        n += (h * mid + mid * cfg.modules[LANGUAGE].hidden_size) if shape.last else 0
    else:
        n += vocab * h * ((1 if shape.first else 0) + (1 if shape.last else 0))
    return n / mod.parallel.tensor


def trainable_params(cfg: MimoConfig, name: str, stage: int, vocab: int) -> float:
    """What of :func:`stage_params` trains (a frozen tower: its projector only)."""
    mod = cfg.modules[name]
    if mod.fully_frozen:
        return 0.0
    if mod.tower_frozen:
        if stage != mod.parallel.pipeline - 1:
            return 0.0
        mid = mod.projector_hidden_size or cfg.modules[LANGUAGE].hidden_size
        lm_h = cfg.modules[LANGUAGE].hidden_size
        return (mod.hidden_size * mid + mid * lm_h) / mod.parallel.tensor
    return stage_params(cfg, name, stage, vocab)
