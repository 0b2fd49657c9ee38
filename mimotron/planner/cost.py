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
from dataclasses import dataclass, field


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
    """

    device: str
    module_seconds: dict[str, tuple[float, float]]
    collectives: dict[str, dict[int, LinkCost]] = field(default_factory=dict)
    host_cores: int = 0
    samples: int = 0

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
        }, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Read :meth:`to_json`'s text back.

        Raises:
            ValueError: the text is not such a calibration.
        """
        try:
            doc = json.loads(text)
            return cls(
                device=str(doc["device"]),
                module_seconds={k: (float(v[0]), float(v[1]))
                                for k, v in doc["module_seconds"].items()},
                collectives={kind: {int(n): LinkCost(float(c[0]), float(c[1]))
                                    for n, c in sizes.items()}
                             for kind, sizes in doc.get("collectives", {}).items()},
                host_cores=int(doc.get("host_cores", 0)),
                samples=int(doc.get("samples", 0)),
            )
        except (KeyError, TypeError, IndexError, json.JSONDecodeError) as exc:
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
    """

    compute: dict[str, float]
    collectives: dict[str, float]
    data_parallel: dict[str, float]
    bridge: float
    pipeline_idle: float
    optimizer: float
    total: float
    bottleneck: str

    def terms(self) -> list[tuple[str, float]]:
        """``(label, seconds)`` of every non-zero term, for ``--explain``."""
        out = [(f"compute ({m})", s) for m, s in self.compute.items()]
        out += [(f"tp/sp/cp/ep collectives ({m})", s) for m, s in self.collectives.items()]
        out += [(f"data-parallel reduction ({m})", s) for m, s in self.data_parallel.items()]
        out += [("bridge transfers", self.bridge), ("pipeline idle", self.pipeline_idle),
                ("optimizer step", self.optimizer)]
        return [(label, s) for label, s in out if s > 0]
