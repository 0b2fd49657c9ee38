"""Training state: ``GlobalState`` (config, timers, train state) and the timers.

The loop, the step and the checkpoint layer share one ``GlobalState``; nothing here is a
module-level global, so several runs can live in one process (tests do this).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mimotron.config.schema import MimoConfig
from mimotron.runtime import Runtime, synchronize

if TYPE_CHECKING:
    from mimotron.data.data_summary import DataSummary


@dataclass
class TrainState:
    """Progress counters; saved in checkpoints so a resume continues exactly."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iters: int = 0
    consecutive_skips: int = 0
    nan_iters: int = 0
    floating_point_operations_so_far: float = 0.0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for key, value in sd.items():
            setattr(self, key, value)


class Timer:
    """Wall-clock timer that accumulates over start/stop pairs."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._start: float | None = None
        self.elapsed_s = 0.0

    def start(self) -> None:
        assert self._start is None, "timer started twice"
        self._start = time.perf_counter()

    def stop(self, sync: bool = False) -> None:
        assert self._start is not None, "timer stopped before start"
        if sync:
            synchronize(self._device)
        self.elapsed_s += time.perf_counter() - self._start
        self._start = None

    def reset(self) -> float:
        """Return the accumulated seconds and reset."""
        out, self.elapsed_s = self.elapsed_s, 0.0
        return out


class Timers:
    """Named timers: ``timers("forward").start()``; read and reset with ``pop_all``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(self._device)
        return self._timers[name]

    def pop_all(self) -> dict[str, float]:
        return {name: t.reset() for name, t in self._timers.items()}


@dataclass
class GlobalState:
    """Everything the loop threads through: config, runtime, timers, train state."""

    cfg: MimoConfig
    runtime: Runtime
    timers: Timers = field(init=False)
    train_state: TrainState = field(default_factory=TrainState)
    start_time: float = field(default_factory=time.monotonic)
    skipped_samples: int | None = None
    """Bad samples the dataset left out (``data.skip_bad_samples``); ``None``: a dataset
    without such checks. The same on every rank (each checks the same file)."""
    data_summary: DataSummary | None = None
    """The run's data at a glance for the banner (``setup_mimo`` sets it on the logging
    rank); ``None``: not known (a caller's own data), no ``data:`` lines."""
    vocab_size_unpadded: int | None = None
    """The language model's real vocabulary (no padding rows), recorded in checkpoints so
    an export drops exactly the padding; ``None``: unknown (not recorded)."""

    def __post_init__(self) -> None:
        self.timers = Timers(self.runtime.device)
