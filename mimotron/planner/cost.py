"""The planner's step-time model: seconds of one training step of a layout, by term.

:func:`step_cost` prices a config's layout on one device (:class:`DeviceSpec`), from
the device constants or, when given, a :class:`Calibration` measured on the machine.
The terms (:class:`StepCost`) are per-module compute, the tensor / sequence / context
/ expert collectives, the data-parallel gradient reduction less what overlaps the
backward, the bridge transfers, and the pipeline's idle time: the step is the makespan
of a simulation of the ranks' actual action lists (:mod:`mimotron.planner.simulate`)
plus the reduction and optimizer tail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mimotron.config.schema import MimoConfig
from mimotron.config.vocab_size import model_vocab_size, padded_vocab_size
from mimotron.data.run_data import build_tokenizer
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, is_colocated_pipeline, language_pipeline
from mimotron.pipeline.actions import Position, build_1f1b_actions
from mimotron.pipeline.interleaved_actions import build_rank_actions
from mimotron.planner.calibration_data import Calibration
from mimotron.planner.devices import DeviceSpec
from mimotron.planner.lanes import (
    LaneCost,
    bridge_seconds,
    colocated_bridge,
    colocated_lane_cost,
    lane_cost,
    transfer_seconds,
)
from mimotron.planner.simulate import Lane, SimResult, simulate
from mimotron.planner.terms import Links


@dataclass(frozen=True)
class StepCost:
    """One layout's predicted step, by term (seconds).

    Attributes:
        compute: module -> forward + backward (+ recompute) seconds of the step's
            micro-batches on the module's busiest rank.
        collectives: module -> its TP / SP / CP / EP collectives over the step, on
            the critical path (not overlapped).
        data_parallel: module -> the gradient reduction (or FSDP gathers) left
            exposed after what overlaps the backward.
        bridge: encoder-to-language transfers on the critical path.
        pipeline_idle: the simulated makespan minus the busiest rank's own work: the
            pipeline bubble and waits across modules.
        optimizer: the optimizer step (memory-bound: bytes of state over bandwidth).
        total: predicted seconds of one step.
        bottleneck: the term that dominates, named (e.g. ``"compute (language)"``).
        core_sharing: CPU ranks only: time the critical rank's computes were stretched
            by other ranks computing on the same cores.
        critical: the (module, stage) whose end is the step's end.
    """

    compute: dict[str, float]
    collectives: dict[str, float]
    data_parallel: dict[str, float]
    bridge: float
    pipeline_idle: float
    optimizer: float
    total: float
    bottleneck: str
    core_sharing: float = 0.0
    critical: tuple[str, int] = (LANGUAGE, 0)

    def terms(self) -> list[tuple[str, float]]:
        """``(label, seconds)`` of every non-zero term, for ``--explain``."""
        out = [(f"compute ({m})", s) for m, s in self.compute.items()]
        out += [(f"tp/sp/cp/ep collectives ({m})", s) for m, s in self.collectives.items()]
        out += [(f"data-parallel reduction ({m})", s) for m, s in self.data_parallel.items()]
        out += [("bridge transfers", self.bridge), ("pipeline idle", self.pipeline_idle),
                ("shared CPU cores", self.core_sharing), ("optimizer step", self.optimizer)]
        return [(label, s) for label, s in out if s > 0]


def model_vocabulary(cfg: MimoConfig) -> int:
    """The language model's padded vocabulary, from the config's tokenizer (as ``plan``)."""
    return model_vocab_size(cfg, padded_vocab_size(build_tokenizer(cfg).vocab_size))


def step_cost(cfg: MimoConfig, layout: Layout, device: DeviceSpec,
              calibration: Calibration | None = None, vocab_size: int | None = None
              ) -> StepCost:
    """Predict one training step of ``cfg`` laid out as ``layout`` on ``device``.

    Args:
        cfg: a config that passed the validator (``load_config`` + ``check_layout``).
        layout: its layout.
        device: the device constants (:func:`~mimotron.planner.devices.device_table`).
        calibration: measured module times and collective costs that replace the
            constants where they cover a term (``None``: the constants alone).
        vocab_size: the model's padded vocabulary (``None``: :func:`model_vocabulary`).

    Returns:
        The step's terms and total (:class:`StepCost`).
    """
    vocab = vocab_size if vocab_size is not None else model_vocabulary(cfg)
    links = Links(device, calibration)
    if is_colocated_pipeline(layout):
        return _colocated_pipeline_cost(cfg, layout, device, calibration, vocab, links)
    n, pipelined = cfg.num_microbatches, cfg.train.schedule == "1f1b"
    cores = (calibration.host_cores if calibration is not None and calibration.host_cores
             else device.host_cores)
    lanes: dict[tuple[str, int], Lane] = {}
    costs: dict[tuple[str, int], LaneCost] = {}
    if layout.colocated:
        key = (LANGUAGE, 0)
        costs[key], bridge = colocated_lane_cost(cfg, layout, vocab, device, calibration, links)
        plan = build_1f1b_actions(n, Position(LANGUAGE, 0, 0, 1, False, False), pipelined)
        lanes[key] = Lane(plan, layout.world_size, 1, 1, costs[key].compute)
    else:
        bridge = bridge_seconds(cfg, layout, links)
        for name, placement in layout.modules.items():
            par = placement.parallel
            for s in range(par.pipeline):
                costs[(name, s)] = lane_cost(cfg, layout, name, s, vocab, device,
                                             calibration, links)
                lanes[(name, s)] = Lane(build_rank_actions(layout, name, s, n, pipelined),
                                        par.size // par.pipeline, par.pipeline,
                                        par.virtual_pipeline, costs[(name, s)].compute)
    result = simulate(lanes, lambda src, msg: transfer_seconds(cfg, layout, links, src, msg),
                      cores)
    return _assemble(n, costs, result, bridge * n, layout.colocated)


def _colocated_pipeline_cost(cfg: MimoConfig, layout: Layout, device: DeviceSpec,
                             calibration: Calibration | None, vocab: int, links: Links
                             ) -> StepCost:
    """A colocated layout with a pipelined language model (the first-stage placement
    included): the encoders' ranks run the encoders and bridges of every micro-batch,
    then the language stages run, then the bridges' and encoders' backward
    (:mod:`mimotron.pipeline.colocated_pipeline`): the encoders' phase in series with the
    language model's pipeline, priced as a split layout of the language model alone."""
    n = cfg.num_microbatches
    lm = step_cost(cfg, language_pipeline(layout), device, calibration, vocab)
    # Under train.encoder_batching an encoder runs the step as one micro-batch: its
    # per-layer fixed costs and collective latencies once, its bytes and FLOPs alike.
    batched = cfg.train.encoder_batching
    enc_cfg = whole_step(cfg) if batched else cfg
    runs = 1 if batched else n
    enc = {m: lane_cost(enc_cfg, layout, m, 0, vocab, device, calibration, links)
           for m in cfg.encoder_names}
    bridge = n * sum(colocated_bridge(cfg, layout, links, m) for m in cfg.encoder_names)
    compute = {**{m: runs * c.work for m, c in enc.items()}, **lm.compute}
    collectives = {**{m: runs * c.collectives for m, c in enc.items()}, **lm.collectives}
    data_parallel = {**{m: c.reduction + runs * c.fsdp for m, c in enc.items()},
                     **lm.data_parallel}
    optimizer = lm.optimizer + sum(c.optimizer for c in enc.values())
    encoders = sum(compute[m] + collectives[m] + data_parallel[m] for m in enc)
    total = lm.total + encoders + bridge + optimizer - lm.optimizer
    cost = StepCost(compute, collectives, data_parallel, bridge + lm.bridge,
                    lm.pipeline_idle, optimizer, total, "", lm.core_sharing, lm.critical)
    return replace(cost, bottleneck=_bottleneck(cost))


def whole_step(cfg: MimoConfig) -> MimoConfig:
    """``cfg`` with the step as one micro-batch (an encoder under encoder batching)."""
    train = replace(cfg.train, micro_batch_size=cfg.train.global_batch_size)
    return replace(cfg, train=train)


def _bottleneck(cost: StepCost) -> str:
    """The label of ``cost``'s largest term (:meth:`StepCost.terms`'s labels)."""
    terms = {**{f"compute ({m})": s for m, s in cost.compute.items()},
             **{f"tp/sp/cp/ep collectives ({m})": s for m, s in cost.collectives.items()},
             **{f"data-parallel reduction ({m})": s for m, s in cost.data_parallel.items()},
             "bridge transfers": cost.bridge, "pipeline idle": cost.pipeline_idle,
             "shared CPU cores": cost.core_sharing, "optimizer step": cost.optimizer}
    return max(terms, key=lambda k: terms[k])


def _assemble(n: int, costs: dict[tuple[str, int], LaneCost], result: SimResult,
              bridge: float, colocated: bool) -> StepCost:
    """The terms from the lanes' costs and the simulation.

    The step ends when the last lane has finished its plan, its exposed reduction and
    its optimizer step (``critical``). The pipeline's idle time is the makespan less the
    busiest lane's busy time: what that rank waits (bubble, other modules); the shared
    cores term is how much longer its computes took than alone on the host.
    """
    ends = {k: result.finish[k] + c.reduction + c.optimizer for k, c in costs.items()}
    critical = max(ends, key=lambda k: (ends[k], k))
    busiest = max(result.busy, key=lambda k: (result.busy[k], k))
    b = costs[busiest]
    idle = max(0.0, result.makespan - result.busy[busiest])
    own = n * (b.work + b.collectives + b.fsdp) + (bridge if colocated else 0.0)
    sharing = max(0.0, result.busy[busiest] - own)  # a colocated lane holds the bridge
    modules = list(dict.fromkeys(m for m, _ in costs))

    def most(field_of: str, module: str) -> float:
        return max(getattr(costs[k], field_of) for k in costs if k[0] == module)

    label = {m: "colocated" if colocated else m for m in modules}
    compute = {label[m]: n * most("work", m) for m in modules}
    collectives = {label[m]: n * most("collectives", m) for m in modules}
    data_parallel = {label[m]: most("reduction", m) + n * most("fsdp", m) for m in modules}
    optimizer = costs[critical].optimizer
    cost = StepCost(compute, collectives, data_parallel, bridge, idle, optimizer,
                    ends[critical], "", sharing, critical)
    return replace(cost, bottleneck=_bottleneck(cost))
