"""Live tensor bytes of one rank: the allocator's own count at named marks, and the peaks.

What the memory estimate of ``mimotron plan`` claims is tensor bytes (weights, gradients,
optimizer state, activations), so the measurement counts tensor bytes too, at the
allocator, not the process's resident set:

* On an accelerator (``torch.accelerator``, the runtime's device) the caching allocator
  keeps exact counters: ``memory_allocated`` at each mark, ``max_memory_allocated``
  since the previous mark (the peak statistic is reset at every mark). No overhead.
* On the CPU there is no such counter, but ``torch.profiler`` with ``profile_memory``
  records every allocation and free of the c10 CPU allocator (the one every CPU tensor
  storage comes from, kernels' internal temporaries included) with its address, size
  and time stamp; marks are empty ``record_function`` ranges on the same clock.
  Replaying the events gives the exact live bytes at each mark and the peak between
  marks. This is exact for everything allocated after the meter started (a block freed
  in the window but allocated before it is not reported by the allocator, so it never
  counts); it costs the profiler's per-operator bookkeeping, which changes no sizes.
  A ``TorchDispatchMode`` counting output storages would miss kernels' internal
  temporaries and autograd's own buffers, and needs weak references to see frees.

Both count bytes allocated by this process's main thread (and the autograd engine
working for it) since the meter started and still live: everything a run builds
(parameters, optimizer state, gradients, data sets, activations), nothing from before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MARK = "mimotron.mark:"


@dataclass
class Mark:
    """Live bytes at a mark and the peak of live bytes since the previous mark."""

    label: str
    live: int
    peak_since_previous: int


@dataclass
class TensorMemoryMeter:
    """Context manager recording live tensor bytes at :meth:`mark` calls.

    Args:
        device: the rank's device (``runtime.device``); an accelerator device uses the
            allocator statistics, ``cpu`` the profiler's allocation events.
    """

    device: torch.device
    marks: list[Mark] = field(default_factory=list)
    _base: int = 0
    _prof: Any = None
    _labels: list[str] = field(default_factory=list)
    _quiet: Any = None

    @property
    def on_accelerator(self) -> bool:
        return self.device.type != "cpu"

    def __enter__(self) -> TensorMemoryMeter:
        if self.on_accelerator:
            mem = torch.accelerator.memory
            torch.accelerator.synchronize(self.device)
            mem.reset_peak_memory_stats(self.device)
            self._base = mem.memory_allocated(self.device)
            return self
        from torch.profiler import ProfilerActivity, profile

        self._quiet = _quiet_stderr()
        self._quiet.__enter__()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self, label: str) -> None:
        """Record the live bytes now (and the peak since the previous mark) as ``label``."""
        if self.on_accelerator:
            mem = torch.accelerator.memory
            torch.accelerator.synchronize(self.device)
            self.marks.append(Mark(label, mem.memory_allocated(self.device) - self._base,
                                   mem.max_memory_allocated(self.device) - self._base))
            mem.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import record_function

        self._labels.append(label)
        with record_function(f"{MARK}{len(self._labels) - 1}"):
            pass

    def __exit__(self, *exc: object) -> None:
        if self.on_accelerator:
            return
        self._prof.__exit__(*exc)
        self._quiet.__exit__(*exc)
        if exc[0] is None:
            self.marks = replay(self._prof.profiler.kineto_results.events(), self._labels)

    @property
    def peak(self) -> int:
        """Peak live bytes over the whole window (up to the last mark)."""
        return max((m.peak_since_previous for m in self.marks), default=0)


def replay(events: Any, labels: list[str]) -> list[Mark]:
    """Live bytes at each mark and peaks between marks from the profiler's events.

    ``[memory]`` events carry ``nbytes`` (negative for a free); a free of a block
    allocated before profiling started is not reported by the allocator, so the running
    sum is exactly the bytes allocated inside the window and still live.
    """
    stream = []
    for e in events:
        name = e.name()
        if name == "[memory]" and str(e.device_type()).endswith("CPU"):
            stream.append((e.start_ns(), 0, e.nbytes()))
        elif name.startswith(MARK):
            stream.append((e.start_ns(), 1, int(name[len(MARK):])))
    stream.sort(key=lambda x: (x[0], x[1]))
    out: list[Mark] = []
    live = peak = 0
    for _, kind, value in stream:
        if kind == 0:
            live += value
            peak = max(peak, live)
        else:
            out.append(Mark(labels[value], live, peak))
            peak = live
    return out


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop chatter on fd 2 (this rank only)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
