"""A rank's measured memory peak: its real training step in the dry run, under torch's tracker.

:func:`measure_peak` runs ranks of a layout in the fake-device dry run
(:func:`mimotron.dryrun.dry_run`: real modules at real shapes, ``FakeTensorMode``, the
``fake`` process-group backend) and, for the ranks asked, follows every tensor the rank
holds on its accelerator with ``torch.distributed._tools.mem_tracker.MemTracker``: the
parameters as set-up allocates them, then every op's outputs through the training
steps (forward, backward, gradient finalisation, optimizer step) until their storage
is freed. Nothing is allocated, so a Llama-2-70B stage is measured on a laptop. The
peak of the last step (the optimizer state exists by then) is the rank's measured
peak, with the tracker's attribution of the bytes live at that moment (parameters,
gradients, optimizer state, activations, backward temporaries). The first step's peak
is not comparable: the first time DTensor meets an op it propagates the sharding on
stand-ins of the global shapes (a fake mode of its own on a real run, the dry run's
here, so the tracker counts them: about 3 GiB in the optimizer step of a cut-down 70B
FSDP2 rank); later steps hit its cache and make none. It is what the
analytic estimate (:func:`mimotron.estimate.memory.estimate_memory`) is checked
against (``benchmarks/plan_vs_measured.py``, ``tests/test_memory_peak.py``).

What it cannot see: the caching allocator's rounding and fragmentation (bytes are
storage sizes), kernels' internal workspaces (cuBLAS, flash attention), the CUDA
context and NCCL's buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mimotron.config.schema import MimoConfig
from mimotron.dryrun.harness import dry_run
from mimotron.runtime import fake_accelerator

# The tracker's reference types, in the order the breakdown is printed.
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


@dataclass
class MeasuredPeak:
    """One rank's measured peak on its (fake) accelerator.

    Attributes:
        rank: the global rank.
        peak: bytes live at the peak of the last training step.
        breakdown: those bytes by the tracker's category (:data:`CATEGORIES`): weights
            (``Parameter``; ``Buffer``: RoPE tables), ``Gradient``, ``Optstate``
            (optimizer state and what the optimizer step makes), ``Activation``
            (forward outputs, saved or not yet freed), ``Temp`` (made in backward:
            activation gradients, recomputed layers), ``Other`` (everything else).
        steps: the peak of each training step, in order.
    """

    rank: int
    peak: int
    breakdown: dict[str, int]
    steps: list[int] = field(default_factory=list)

    def format(self) -> str:
        """One line: the peak and its breakdown in MiB."""
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in self.breakdown.items() if v)
        return f"rank {self.rank}: measured peak {self.peak / 2**20:.0f} MiB ({parts})"


def _step_tracker() -> Any:
    """A ``MemTracker`` that takes a model run once per micro-batch.

    The tracker keeps per-module statistics of one forward and refuses a root module's
    second forward; a step runs one per micro-batch. Only the device totals are used
    here, so a root module's statistics start again at each of its forwards, and the
    peak is kept for the device only (per-module peaks cost a walk over every module at
    every op).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module: torch.nn.Module,
                                             install_grad_hooks: bool = True) -> Any:
            # torch hooks every parameter's gradient, which a frozen one (LoRA's base, a
            # frozen tower) cannot take: mark those as hooked already.
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, _NO_HOOKS)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            # The device totals only: the per-module peaks walk every module at every op.
            for device, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snap["Total"]:
                    self._peak_mem[device] = snap["Total"]
                    self._peak_mem_snap[device] = dict(snap)

    return StepTracker()


class _NoHook:
    """The hook handle of a parameter the tracker must not hook (nothing to remove)."""

    def remove(self) -> None:
        return None


_NO_HOOKS = (_NoHook(), _NoHook())


class PeakObserver:
    """Follows one rank's accelerator tensors through set-up and the training steps.

    The dry run (:func:`mimotron.dryrun.harness.dry_run`, ``observers``) enters
    :meth:`setup` around the rank's set-up and :meth:`step` around each training step,
    inside its fake mode.
    """

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.tracker = _step_tracker()
        self.step_peaks: list[int] = []
        self.last: dict[str, int] = {}

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Around set-up: the parameters and buffers it allocates are followed."""
        with self.tracker:
            yield

    @contextlib.contextmanager
    def step(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
             ) -> Iterator[None]:
        """Around one training step: its peak and the breakdown there are recorded."""
        # Parameters allocated in set-up were counted as outputs of ops; name them (and
        # state a previous step made) before the step, so the breakdown attributes them.
        self.tracker.track_external(model, *optimizers)
        with self.tracker:
            yield
        snap = self.tracker.get_tracker_snapshot("peak").get(self.device, {})
        self.step_peaks.append(int(snap.get("Total", 0)))
        self.last = {k: int(snap.get(k, 0)) for k in CATEGORIES}

    def result(self) -> MeasuredPeak:
        """The last step's peak and breakdown."""
        assert self.step_peaks, "no training step was observed"
        return MeasuredPeak(self.rank, self.step_peaks[-1], dict(self.last),
                            list(self.step_peaks))


def measure_peak(cfg: MimoConfig, ranks: Sequence[int], *, run_first: Sequence[int] = (),
                 steps: int = 2) -> dict[int, MeasuredPeak]:
    """Measure the memory peak of ``ranks`` in the fake-device dry run.

    Args:
        cfg: the run config (not modified).
        ranks: the global ranks to measure.
        run_first: ranks that feed them (earlier pipeline positions whose shape headers
            they read), run in the same dry run but not measured.
        steps: training steps per rank; the last one's peak is reported (two: the
            second holds the optimizer state the first made).

    Returns:
        Per measured rank, its :class:`MeasuredPeak`.

    Raises:
        ValueError: a rank outside the layout, or a process group already exists.
        DryRunError: a measured rank reads a message from a rank not run.
    """
    device = fake_accelerator()
    if device.type == "meta":
        # A CPU-only torch build stands in ``meta`` for the accelerator, which has no
        # autocast (bf16 would compute in fp32) and whose SDPA is the unfused math kernel
        # (it keeps S x S probabilities). Fake CPU tensors get both as a GPU would.
        device = torch.device("cpu")
    observers = {r: PeakObserver(r, device) for r in ranks}
    dry_run(cfg, sorted(set(ranks) | set(run_first)), steps=steps, evaluate=False,
            checkpoint=False, observers=observers, device=device)
    return {r: o.result() for r, o in observers.items()}
