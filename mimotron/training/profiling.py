"""Instrumentation of the loop: per-module timers, torch.profiler traces, fault injection.

* :class:`ModuleTimes` times each module's forward and backward with module and autograd
  hooks, so the schedule needs no timer calls: forward = the module's ``forward`` call;
  backward = from the gradient of its output arriving to the gradient of its input (or,
  for an encoder whose raw input needs none, to the last gradient of its parameters).
* Transfer time is not measured here: each transport accumulates its own
  (``pop_transfer_seconds``) and the loop hands it to the monitor.
* :class:`StepProfiler` records ``profile.start..profile.end`` iterations (inclusive,
  numbered from 1) with ``torch.profiler`` on the ranks in ``profile.ranks`` and writes
  one Chrome trace per rank to ``<log.dir>/profile/``.
* :func:`inject_fault` is a test hook: with ``MIMOTRON_FAIL_AT_ITER=k`` (and optionally
  ``MIMOTRON_FAIL_RANK=r``, default every rank) in the environment, rank ``r`` raises
  :class:`InjectedFault` when the loop calls it, right after fetching the data of
  iteration ``k`` — while its peers go on into the step and wait on it — so tests can
  check that one failing rank ends the whole job. With ``MIMOTRON_FAIL_SIGNAL=SIGKILL``
  (any signal name) the rank kills itself with that signal instead of raising. Unset,
  it costs one dictionary lookup per step.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from mimotron.config.schema import ProfileConfig
from mimotron.config.setup_rules import check_profile_ranks
from mimotron.run_files import replacing
from mimotron.runtime import synchronize

FAIL_AT_ITER_ENV = "MIMOTRON_FAIL_AT_ITER"
FAIL_RANK_ENV = "MIMOTRON_FAIL_RANK"
FAIL_SIGNAL_ENV = "MIMOTRON_FAIL_SIGNAL"


class InjectedFault(RuntimeError):
    """The failure requested by ``MIMOTRON_FAIL_AT_ITER`` (tests only)."""


def inject_fault(iteration: int, rank: int) -> None:
    """Raise :class:`InjectedFault` (or die by a signal) if the environment says so.

    Args:
        iteration: the iteration being run (from 1).
        rank: this global rank.

    Raises:
        InjectedFault: ``MIMOTRON_FAIL_AT_ITER == iteration`` and ``MIMOTRON_FAIL_RANK``
            is unset or equals ``rank`` (and ``MIMOTRON_FAIL_SIGNAL`` is unset; when it
            is set, e.g. to ``SIGKILL``, the rank sends itself that signal instead).
    """
    at = os.environ.get(FAIL_AT_ITER_ENV)
    if at is None or int(at) != iteration:
        return
    who = os.environ.get(FAIL_RANK_ENV)
    if who is not None and int(who) != rank:
        return
    how = os.environ.get(FAIL_SIGNAL_ENV)
    if how is not None:
        os.kill(os.getpid(), signal.Signals[how])
    raise InjectedFault(f"rank {rank}: injected failure at iteration {iteration} "
                        f"({FAIL_AT_ITER_ENV}={at})")


class ModuleTimes:
    """Wall time of each module's forward and backward on this rank, from hooks.

    Only training-mode forwards are timed (evaluation runs the model in eval mode). On an
    accelerator each boundary synchronises the device, so the numbers are device time at
    the cost of a few synchronisations per micro-batch.

    Args:
        parts: module name -> the part of the model this rank holds.
        device: this rank's device.
    """

    def __init__(self, parts: dict[str, nn.Module], device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, dict[str, float]] = defaultdict(
            lambda: {"forward": 0.0, "backward": 0.0})
        self._fwd_start: dict[str, float] = {}
        self._bwd_start: dict[str, float] = {}
        self._handles: list[Any] = []
        for name, mod in parts.items():
            self._handles.append(mod.register_forward_pre_hook(partial(self._pre, name)))
            self._handles.append(mod.register_forward_hook(partial(self._post, name)))
            params = [p for p in mod.parameters() if p.requires_grad]
            if params:
                self._handles.append(register_multi_grad_hook(
                    params, partial(self._params_done, name), mode="all"))

    def _now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()

    def _pre(self, name: str, module: nn.Module, args: tuple) -> None:
        if not module.training:
            return
        self._fwd_start[name] = self._now()
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if torch.is_grad_enabled() and inputs:
            # Backward of this module ends when the gradient of its input is ready.
            inputs[0].register_hook(partial(self._input_grad, name))

    def _post(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        start = self._fwd_start.pop(name, None)
        if start is None:
            return
        self._add(name, "forward", self._now() - start)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._output_grad, name))

    def _output_grad(self, name: str, grad: torch.Tensor) -> None:
        self._bwd_start[name] = self._now()

    def _input_grad(self, name: str, grad: torch.Tensor) -> None:
        self._close_backward(name)

    def _params_done(self, name: str, grads: Any) -> None:
        self._close_backward(name)

    def _close_backward(self, name: str) -> None:
        # The first end marker wins (the input gradient comes before the parameters').
        start = self._bwd_start.pop(name, None)
        if start is not None:
            self._add(name, "backward", self._now() - start)

    def _add(self, name: str, kind: str, seconds: float) -> None:
        self.seconds[name][kind] += seconds

    def pop(self) -> dict[str, dict[str, float]]:
        """Accumulated seconds per module and phase since the last pop; resets them."""
        out = {k: dict(v) for k, v in self.seconds.items()}
        self.seconds.clear()
        return out

    def remove(self) -> None:
        """Remove every hook (the model is left as it was)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


class StepProfiler:
    """torch.profiler over iterations ``[profile.start, profile.end]`` on chosen ranks.

    Call :meth:`before_step` with the iteration about to run and :meth:`after_step` with
    the one just finished; :meth:`close` writes a partial trace if the run stops inside
    the window. The trace is ``<log_dir>/profile/rank<r>_iter<start>-<end>.json``.

    Args:
        cfg: the ``[profile]`` config.
        log_dir: the run directory.
        rank: this global rank.
        world_size: number of ranks (to validate ``profile.ranks``).

    Raises:
        ValueError: ``profile.ranks`` names a rank outside the world (same on every rank).
    """

    def __init__(self, cfg: ProfileConfig, log_dir: Path, rank: int, world_size: int) -> None:
        check_profile_ranks(cfg, world_size)  # The validator's rule (check_layout) too.
        self.enabled = cfg.enabled and rank in cfg.ranks
        self.start, self.end = max(cfg.start, 1), cfg.end
        self.path = log_dir / "profile" / f"rank{rank}_iter{self.start}-{self.end}.json"
        self._prof: Any = None
        self._step_range: Any = None

    def before_step(self, iteration: int) -> None:
        """Start recording if ``iteration`` is the first of the window (or a resume in it)."""
        if self.enabled and self._prof is None and self.start <= iteration <= self.end:
            self._prof = torch.profiler.profile(
                activities=list(torch.profiler.supported_activities()), record_shapes=True)
            self._prof.__enter__()
        if self._prof is not None:
            # A named range per iteration, so the trace shows where each step begins.
            self._step_range = torch.profiler.record_function(f"mimotron/iteration {iteration}")
            self._step_range.__enter__()

    def after_step(self, iteration: int) -> None:
        """Mark the step boundary; stop and write the trace after the last iteration."""
        if self._prof is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        self._prof.step()
        if iteration >= self.end:
            self._finish()

    def _finish(self) -> None:
        if self._step_range is not None:  # Stopped inside an iteration (an exception).
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(self.path) as tmp:  # A fresh file: never written through a link.
            prof.export_chrome_trace(str(tmp))
        self.enabled = False  # One window a run.

    def close(self) -> None:
        """Write what was recorded if the run ended inside the window."""
        if self._prof is not None:
            self._finish()
