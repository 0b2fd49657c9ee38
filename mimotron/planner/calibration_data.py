"""What a calibration measured, as the step-time model prices it.

:class:`Calibration` holds the module times and collective costs
(:class:`LinkCost`) that :mod:`mimotron.planner.calibration` measures on this machine
(``--calibrate``) and caches as JSON; the step-time model
(:func:`mimotron.planner.cost.step_cost`) and its terms (:mod:`mimotron.planner.terms`,
:mod:`mimotron.planner.lanes`) read them in place of the device constants. Plain data:
it imports nothing of mimotron, so every planner module can import it.
"""

from __future__ import annotations

import json
import math
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
