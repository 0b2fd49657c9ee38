"""The training loop's side of checkpointing: when to save, and when to stop.

``train_mimo`` makes one :class:`CheckpointManager` and calls :meth:`after_step` after
every iteration, :meth:`finish` after the loop and :meth:`close` on the way out. The
manager saves every ``checkpoint.interval`` iterations, stops (after a save) on
``train.exit_interval``, ``train.exit_duration_mins``, SIGTERM or SIGINT, and saves at the
end when ``checkpoint.interval > 0``.

Stopping must be a world decision: the signal may reach one rank only, and clocks differ.
Each step every rank contributes its flags (signal received, time is up, a background
save failed) to one MAX all-reduce, so all ranks stop, or fail, after the same iteration.
A signal stop saves even at the last iteration and even with ``checkpoint.interval = 0``
(the progress would be lost otherwise); once that save is complete, later signals are
ignored and rank 0 leaves a stop record for the launcher
(:func:`~mimotron.checkpoint.signals.write_stop_record`). A signal that came while the run
was being built stops it before the first step (:meth:`CheckpointManager.stop_before_start`),
with nothing to save.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mimotron.checkpoint.files import CheckpointError
from mimotron.checkpoint.load import log
from mimotron.checkpoint.save import SaveHandle, make_stager, save_checkpoint
from mimotron.checkpoint.signals import StopSignals, write_stop_record
from mimotron.failures import FAILURE_DIR_ENV
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.runtime import pins_memory

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer


class CheckpointManager:
    """Periodic, final and exit saves of one training run (every rank makes one).

    Args:
        model: this rank's ``MimoModel``.
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module schedulers on this rank.
        global_state: config, runtime, train state.
        infra: the run's ``MimoModelInfra``.

    Attributes:
        exit_reason: why the loop stopped early (``"SIGTERM"``, ``"exit_interval"``,
            ``"exit_duration_mins"``), or None.
        saves: per save, ``{"iteration", "blocking_s", "async"}`` (for reports).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: MimoOptimizer,
        schedulers: dict[str, OptimizerParamScheduler],
        global_state: Any,
        infra: Any,
    ) -> None:
        self._run = (model, optimizer, schedulers, global_state, infra)
        self._cfg = global_state.cfg
        self._state = global_state
        self._group: Any = None
        self._pending: SaveHandle | None = None
        self._staging: Any = None  # Reused host buffers for async saves (made on first).
        iteration = global_state.train_state.iteration
        # A resumed run starts at a saved iteration: no need to write it again.
        self._last_saved: int | None = iteration if iteration > 0 else None
        self.exit_reason: str | None = None
        self._before_start = False
        self.saves: list[dict[str, Any]] = []
        # Adopt the handlers the rank's entry point installed before set-up, if any: a
        # signal that came while the run was being built still counts.
        self._signals, self._owns_signals = StopSignals.adopt_or_install()

    @property
    def stopped(self) -> bool:
        """Whether the loop was told to stop before ``train.iters``."""
        return self.exit_reason is not None

    def after_step(self) -> bool:
        """Save if due; decide (world-wide) whether to stop. Collective; call every step.

        Returns:
            True when training should stop now (a checkpoint was saved first).

        Raises:
            CheckpointError: a background save failed (on every rank alike).
        """
        cfg, ts = self._cfg, self._state.train_state
        limit_min = cfg.train.exit_duration_mins
        elapsed_min = (time.monotonic() - self._state.start_time) / 60.0
        flags = torch.tensor(
            [
                float(self._signals.received is not None),
                float(0 < limit_min <= elapsed_min),
                float(self._pending is not None and self._pending.failed()),
            ],
            device=self._state.runtime.device,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, out_of_time, save_failed = (bool(f) for f in flags.tolist())
        if save_failed:
            self._fail_pending()
        reason = None
        if cfg.train.exit_interval > 0 and ts.iteration % cfg.train.exit_interval == 0:
            reason = "exit_interval"
        if out_of_time:
            reason = "exit_duration_mins"
        periodic = cfg.checkpoint.interval > 0 and ts.iteration % cfg.checkpoint.interval == 0
        if reason is not None and ts.iteration >= cfg.train.iters:
            reason = None  # The loop ends here anyway; finish() saves as configured.
        if signalled:
            # Even at the last iteration: the launcher reports what a signal stop saved.
            reason = self._signals.name or "SIGTERM"
            # Until the save is complete, an insisting signal aborts it.
            self._signals.begin_save(ts.iteration)
        if periodic or reason is not None:
            self.save()
        if reason is not None:
            self.exit_reason = reason
            log(
                dist.get_rank(),
                f"stopping after iteration {ts.iteration} ({reason}); "
                f"resume with checkpoint.load=auto from {cfg.checkpoint_dir}",
            )
        return reason is not None

    def stop_before_start(self) -> bool:
        """Whether a stop signal came while the run was built (world-agreed). Collective.

        Call once before the first step. Then nothing was trained, so nothing is saved:
        the stop is complete at once (later signals are ignored), and rank 0 leaves a
        stop record that says so.

        Returns:
            True when the loop must not start.
        """
        flag = torch.tensor([float(self._signals.received is not None)],
                            device=self._state.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not bool(flag.item()):
            return False
        ts = self._state.train_state
        self.exit_reason = self._signals.name or "SIGTERM"
        self._before_start = True
        self._signals.save_complete()
        if dist.get_rank() == 0:
            write_stop_record(os.environ.get(FAILURE_DIR_ENV), self.exit_reason,
                              ts.iteration, None, began=False)
        log(dist.get_rank(), f"stopping before iteration {ts.iteration + 1} "
            f"({self.exit_reason} during set-up); nothing trained, nothing saved")
        return True

    def save(self) -> None:
        """Save the current iteration (waits for a previous background save first)."""
        self.wait()
        ts = self._state.train_state
        if self._group is None:
            # Created on first use, by every rank at the same save: DCP's background
            # thread must not share a group with the training loop's collectives.
            self._group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=self._cfg.train.pg_timeout_s)
            )
        handle = save_checkpoint(
            self._cfg.checkpoint_dir,
            *self._run,
            async_save=self._cfg.checkpoint.async_save,
            keep=self._cfg.checkpoint.keep,
            process_group=self._group,
            stager=self._stager(),
        )
        self._last_saved = ts.iteration
        self.saves.append(
            {
                "iteration": ts.iteration,
                "blocking_s": handle.blocking_s,
                "async": handle.future is not None,
            }
        )
        self._pending = handle if handle.future is not None else None

    def _stager(self) -> Any:
        """One reusable staging helper per run, for async saves only."""
        if not self._cfg.checkpoint.async_save:
            return None
        if self._staging is None:
            self._staging = make_stager(pins_memory(self._state.runtime.device))
        return self._staging

    def wait(self) -> None:
        """Block until a background save is complete.

        Raises:
            CheckpointError: it failed.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def finish(self) -> None:
        """After the loop: the final save (``checkpoint.interval > 0``), then wait for it."""
        if self._before_start:
            return  # Stopped before the first step: nothing new to save.
        if (
            self._cfg.checkpoint.interval > 0
            and self._last_saved != self._state.train_state.iteration
        ):
            self.save()
        self.wait()
        if not self._signals.saving:
            return
        self._signals.save_complete()  # Saved: the run is on its way out; ignore signals.
        if dist.get_rank() == 0:
            write_stop_record(os.environ.get(FAILURE_DIR_ENV), self.exit_reason or "SIGTERM",
                              self._state.train_state.iteration, self._last_saved)

    def close(self) -> None:
        """Restore the signal handlers. Never waits: on an error path peers may be gone."""
        if self._owns_signals:
            self._signals.restore()

    def _fail_pending(self) -> None:
        """Some rank's background save failed: raise here too, with its message if local."""
        self.wait()  # Raises this rank's own failure, if it has one.
        raise CheckpointError("an asynchronous checkpoint save failed on another rank")
