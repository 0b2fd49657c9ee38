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
  and time stamp, on the threads it profiles (the caller's; CPU autograd runs there
  too); marks are empty ``record_function`` ranges on the same clock. Replaying the
  events gives the live bytes at each mark and the peak between marks, counting exactly
  the blocks allocated in the window (a block allocated before it is never reported).
  One gap: a block whose last reference is dropped on an unprofiled thread (gloo's
  worker threads finishing a collective) has no free event; it counts until its
  address is handed out again, which proves it free (see :func:`replay`). The cost is
  the profiler's per-operator bookkeeping, which changes no sizes. (A
  ``TorchDispatchMode`` counting output storages would miss kernels' internal
  temporaries and autograd's own buffers, and needs weak references to see frees;
  ``profile_all_threads`` drops the memory events in torch 2.13.)

Both count bytes allocated since the meter started and still live: everything a run
builds (parameters, optimizer state, gradients, data sets, activations), nothing from
before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._profiler import _EventType

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
            tree = self._prof.profiler.kineto_results.experimental_event_tree()
            self.marks = replay(tree, self._labels)

    @property
    def peak(self) -> int:
        """Peak live bytes over the whole window (up to the last mark)."""
        return max((m.peak_since_previous for m in self.marks), default=0)


def replay(tree: list[Any], labels: list[str]) -> list[Mark]:
    """Live bytes at each mark and peaks between marks from the profiler's event tree.

    Allocation events carry the block's address and size (negative for a free). A free
    of a block allocated before profiling started is not reported by the allocator, so
    the running sum counts exactly the blocks allocated inside the window. A block freed
    on a thread the profiler does not record (gloo's worker threads drop the last
    reference to a finished collective's buffer) leaves no free event; the allocator
    handing out its address again proves it was freed, so it stops counting there.
    """
    stream = []
    todo = list(tree)
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            stream.append((e.start_time_ns, 0, e.extra_fields.ptr, e.extra_fields.alloc_size))
        elif e.name.startswith(MARK):
            stream.append((e.start_time_ns, 1, int(e.name[len(MARK):]), 0))
    stream.sort(key=lambda x: (x[0], x[1]))
    out: list[Mark] = []
    blocks: dict[int, int] = {}
    live = peak = 0
    for _, kind, key, size in stream:
        if kind == 1:
            out.append(Mark(labels[key], live, peak))
            peak = live
        elif size > 0:
            live += size - blocks.get(key, 0)  # a reused address: its old block is gone
            blocks[key] = size
            peak = max(peak, live)
        else:
            live -= blocks.pop(key, 0)
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
