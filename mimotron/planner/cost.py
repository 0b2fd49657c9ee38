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

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mimotron.config import MimoConfig
    from mimotron.parallel.layout import Layout
    from mimotron.planner.devices import DeviceSpec
    from mimotron.planner.lanes import LaneCost
    from mimotron.planner.simulate import Lane, SimResult


@dataclass(frozen=True)
class LinkCost:
    """A collective or transfer's cost: a fixed latency plus bytes over a bandwidth."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        """Seconds to move ``num_bytes`` (a collective: the per-rank buffer size)."""
        return self.latency_s + num_bytes / self.bytes_per_s


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""The collective kinds a :class:`Calibration` may hold."""


@dataclass(frozen=True)
class Calibration:
    """Measured costs on this machine that replace the device constants.

    Produced by :mod:`mimotron.planner.calibration` (``--calibrate``), consumed by
    :func:`step_cost`.

    Attributes:
        device: the :class:`~mimotron.planner.devices.DeviceSpec` name it refines.
        module_seconds: module name -> ``(forward_s, backward_s)`` of ONE micro-batch at
            tensor=1, pipeline=1, data=1, recompute none, as configured (the whole
            ``train.micro_batch_size`` samples, ``data.seq_length``), measured with the
            rank computing alone on its host (the model adds the sharing of cores).
        collectives: kind (:data:`COLLECTIVES`) -> group size -> cost. The bytes are
            the per-rank buffer size: the whole tensor a rank holds at the largest
            (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter:
            the input; all-to-all: the send buffer; p2p: the message).
        host_cores: cores the measuring ranks shared (0 = not shared).
        samples: samples per micro-batch the module times were measured at (0 = the
            config's ``train.micro_batch_size``); the model scales them linearly.
        module_fixed_seconds: module name -> the part of ``module_seconds`` that does
            not scale with the samples (Python, kernel launches, hooks: the intercept
            of the times at two micro-batch sizes); empty = everything scales. It is
            paid once per micro-batch and chunk whatever the share of samples or TP.
    """

    device: str
    module_seconds: dict[str, tuple[float, float]]
    collectives: dict[str, dict[int, LinkCost]] = field(default_factory=dict)
    host_cores: int = 0
    samples: int = 0
    module_fixed_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)

    def to_json(self) -> str:
        """The calibration as JSON text (what the run directory caches)."""
        return json.dumps({
            "device": self.device,
            "module_seconds": {k: list(v) for k, v in self.module_seconds.items()},
            "collectives": {kind: {str(n): [c.latency_s, c.bytes_per_s]
                                   for n, c in sizes.items()}
                            for kind, sizes in self.collectives.items()},
            "host_cores": self.host_cores,
            "samples": self.samples,
            "module_fixed_seconds": {k: list(v) for k, v in self.module_fixed_seconds.items()},
        }, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, check: bool = True) -> Calibration:
        """Read :meth:`to_json`'s text back.

        Args:
            text: the JSON text.
            check: range-check the values (:meth:`check`).

        Raises:
            ValueError: the text is not such a calibration;
                :class:`CalibrationRangeError` (``check``): a value is out of range.
        """
        calibration = cls._parse(text)
        if check:
            calibration.check()
        return calibration

    def check(self) -> None:
        """Raise :class:`CalibrationRangeError` naming the first field out of range:
        seconds and bandwidths must be finite and positive (a backward and a fixed part
        may be 0: a frozen module has none), counts whole and >= 0, group sizes >= 2."""
        for field_name, table in (("module_seconds", self.module_seconds),
                                  ("module_fixed_seconds", self.module_fixed_seconds)):
            for name, pair in table.items():
                for part, value in zip(("forward", "backward"), pair, strict=True):
                    zero = field_name == "module_fixed_seconds" or part == "backward"
                    _check_number(f"{field_name}.{name}.{part}", value, zero, "seconds")
        for kind, sizes in self.collectives.items():
            if kind not in COLLECTIVES:
                raise CalibrationRangeError(f"collectives.{kind} is not a collective kind; "
                                            f"valid: {', '.join(COLLECTIVES)}")
            for n, link in sizes.items():
                if n < 2:
                    raise CalibrationRangeError(f"collectives.{kind}.{n} is invalid: "
                                                "expected a group size >= 2")
                _check_number(f"collectives.{kind}.{n}.latency_s", link.latency_s, False,
                              "seconds")
                _check_number(f"collectives.{kind}.{n}.bytes_per_s", link.bytes_per_s, False,
                              "bytes per second")
        for field_name in ("host_cores", "samples"):
            value = getattr(self, field_name)
            if value < 0:
                raise CalibrationRangeError(f"{field_name}={value!r} is invalid: expected "
                                            "a whole number >= 0 (0: not measured)")

    @classmethod
    def _parse(cls, text: str) -> Calibration:
        """The calibration in ``text``, values unchecked."""
        try:
            doc = json.loads(text)
            return cls(
                device=str(doc["device"]),
                module_seconds={k: (float(v[0]), float(v[1]))
                                for k, v in doc["module_seconds"].items()},
                collectives={kind: {int(n): LinkCost(float(c[0]), float(c[1]))
                                    for n, c in sizes.items()}
                             for kind, sizes in doc.get("collectives", {}).items()},
                host_cores=_whole(doc.get("host_cores", 0), "host_cores"),
                samples=_whole(doc.get("samples", 0), "samples"),
                module_fixed_seconds={k: (float(v[0]), float(v[1])) for k, v in
                                      doc.get("module_fixed_seconds", {}).items()},
            )
        except (KeyError, TypeError, IndexError, AttributeError, json.JSONDecodeError
                ) as exc:
            raise ValueError(f"not a planner calibration: {exc!r}") from exc

    def link(self, kind: str, group_size: int) -> LinkCost | None:
        """The measured cost of ``kind`` at ``group_size``, else the nearest size measured.

        Returns None when nothing of that kind was measured.
        """
        sizes = self.collectives.get(kind)
        if not sizes:
            return None
        if group_size in sizes:
            return sizes[group_size]
        nearest = min(sizes, key=lambda n: (abs(n - group_size), n))
        return sizes[nearest]


class CalibrationRangeError(ValueError):
    """A calibration value out of range (:meth:`Calibration.check`), as opposed to text
    that is no calibration at all."""


def _check_number(name: str, value: float, may_be_zero: bool, unit: str) -> None:
    """Raise :class:`CalibrationRangeError` unless ``value`` is finite and > 0 (or 0,
    where ``may_be_zero``)."""
    if math.isfinite(value) and (value > 0 or (may_be_zero and value == 0)):
        return
    bound = ">= 0" if may_be_zero else "> 0"
    raise CalibrationRangeError(f"{name}={value!r} is invalid: expected finite {unit} "
                                f"{bound}")


def _whole(value: object, name: str) -> int:
    """A count read from JSON: a whole number (``int(inf)`` would raise OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            not math.isfinite(value) or value != int(value)):
        raise CalibrationRangeError(f"{name}={value!r} is invalid: expected a whole number "
                                    ">= 0 (0: not measured)")
    return int(value)


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
    critical: tuple[str, int] = ("language", 0)

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
    from mimotron.data.llava_setup import build_tokenizer
    from mimotron.models.vocab_size import model_vocab_size
    from mimotron.training.model_setup import padded_vocab_size

    return model_vocab_size(cfg, padded_vocab_size(build_tokenizer(cfg).vocab_size))


def step_cost(cfg: MimoConfig, layout: Layout, device: DeviceSpec,
              calibration: Calibration | None = None, vocab_size: int | None = None
              ) -> StepCost:
    """Predict one training step of ``cfg`` laid out as ``layout`` on ``device``.

    Args:
        cfg: a config that passed the validator (``load_config`` + ``plan_layout``).
        layout: its layout.
        device: the device constants (:func:`~mimotron.planner.devices.device_table`).
        calibration: measured module times and collective costs that replace the
            constants where they cover a term (``None``: the constants alone).
        vocab_size: the model's padded vocabulary (``None``: :func:`model_vocabulary`).

    Returns:
        The step's terms and total (:class:`StepCost`).
    """
    from mimotron.names import LANGUAGE
    from mimotron.pipeline.interleaved_plan import build_rank_plan
    from mimotron.pipeline.plan import Position, build_1f1b_plan
    from mimotron.planner.lanes import (
        bridge_seconds,
        colocated_lane_cost,
        lane_cost,
        transfer_seconds,
    )
    from mimotron.planner.simulate import Lane, simulate
    from mimotron.planner.terms import Links

    vocab = vocab_size if vocab_size is not None else model_vocabulary(cfg)
    links = Links(device, calibration)
    n, pipelined = cfg.num_microbatches, cfg.train.schedule == "1f1b"
    cores = (calibration.host_cores if calibration is not None and calibration.host_cores
             else device.host_cores)
    lanes: dict[tuple[str, int], Lane] = {}
    costs: dict[tuple[str, int], LaneCost] = {}
    if layout.colocated:
        key = (LANGUAGE, 0)
        costs[key], bridge = colocated_lane_cost(cfg, layout, vocab, device, calibration, links)
        plan = build_1f1b_plan(n, Position(LANGUAGE, 0, 0, 1, False, False), pipelined)
        lanes[key] = Lane(plan, layout.world_size, 1, 1, costs[key].compute)
    else:
        bridge = bridge_seconds(cfg, layout, links)
        for name, placement in layout.modules.items():
            par = placement.parallel
            for s in range(par.pipeline):
                costs[(name, s)] = lane_cost(cfg, layout, name, s, vocab, device,
                                             calibration, links)
                lanes[(name, s)] = Lane(build_rank_plan(layout, name, s, n, pipelined),
                                        par.size // par.pipeline, par.pipeline,
                                        par.virtual_pipeline, costs[(name, s)].compute)
    result = simulate(lanes, lambda src, msg: transfer_seconds(cfg, layout, links, src, msg),
                      cores)
    return _assemble(n, costs, result, bridge * n, layout.colocated)


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
    terms = {**{f"compute ({m})": s for m, s in compute.items()},
             **{f"tp/sp/cp/ep collectives ({m})": s for m, s in collectives.items()},
             **{f"data-parallel reduction ({m})": s for m, s in data_parallel.items()},
             "bridge transfers": bridge, "pipeline idle": idle, "shared CPU cores": sharing,
             "optimizer step": optimizer}
    bottleneck = max(terms, key=lambda k: terms[k])
    return StepCost(compute, collectives, data_parallel, bridge, idle, optimizer,
                    ends[critical], bottleneck, sharing, critical)
