"""The run's bookkeeping tables: evaluation, checkpoints, logging and profiling.

One dataclass per TOML table, every field documented as in :mod:`mimotron.config.schema`
(which re-exports them; :mod:`mimotron.config.docs` reads their docstrings). They say
when the run evaluates, saves, logs and profiles, never what it trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CheckpointConfig", "EvalConfig", "LogConfig", "ProfileConfig"]


@dataclass
class EvalConfig:
    """Evaluation on the validation split."""

    interval: int = 50
    """Evaluate every this many iterations (>= 1) and at the end."""
    iters: int = 0
    """Validation steps per evaluation (>= 0); 0 = the whole validation split."""


@dataclass
class CheckpointConfig:
    """Checkpoint saving and resuming."""

    dir: str = ""
    """Checkpoint directory; ``""`` = ``<log.dir>/checkpoints``."""
    interval: int = 0
    """Save every this many iterations and at the end (>= 0); 0 = no periodic or final saves."""
    load: str = "auto"
    """``auto`` (resume from the latest checkpoint in dir, if any), ``none`` (start fresh)
    or a checkpoint path.

    ``auto`` resumes from the checkpoint ``latest`` names; when ``latest`` is missing, from
    the newest complete ``iter_*`` folder. Starting fresh over a previous run needs
    train.overwrite.
    """
    pretrained: str = ""
    """A checkpoint to start a new run from (fine-tuning; LLaVA's stage 2 from stage 1):
    a mimotron checkpoint (a dir holding ``latest``, an ``iter_*`` folder, or a run's
    log.dir holding ``checkpoints/``; written by any layout) or a ``mimotron export``
    folder. ``""`` = none.

    Read only when the run starts fresh (load = "none", or "auto" finding no checkpoint
    in dir): its weights are loaded, and the run starts at iteration 0 with a fresh
    optimizer and schedule and the data from the start (see pretrained_optimizer and
    pretrained_schedule), in its own log.dir. Once the run has saved, a relaunch resumes
    its own checkpoints. It may not lie inside this run's checkpoint dir.
    """
    pretrained_optimizer: bool = False
    """Also load the optimizer state (Adam moments, loss scale) from pretrained (a mimotron
    checkpoint only); a module with no state there starts fresh.
    """
    pretrained_schedule: bool = False
    """Also continue pretrained's count: its iteration, learning-rate schedules and data
    position (a mimotron checkpoint only); train.iters must lie beyond its iteration.
    """
    async_save: bool = False
    """Save on a background thread (own process group) while training continues."""
    keep: int = 3
    """Complete checkpoints to keep (>= 1); older ones are deleted."""


@dataclass
class LogConfig:
    """Metrics and console output."""

    dir: str = ""
    """Run output directory (metrics.jsonl, checkpoints, traces); ``""`` = ``runs/<name>``."""
    interval: int = 1
    """Write a train record every this many iterations (>= 1) and at the end; its metrics
    are means over the interval.

    loss is token-weighted and accuracy sample-weighted over the interval's
    non-skipped iterations; the last iteration's values are kept with a ``_last`` suffix.
    """
    tensorboard: bool = False
    """Also write TensorBoard scalars under ``<log.dir>/tensorboard``."""
    progress: bool = True
    """Print to the console: banner, a line per log interval, summary; on a terminal also
    a bar and a line redrawn every iteration (iteration, loss, ETA).
    """
    wandb: bool = False
    """Also log every record of metrics.jsonl to a Weights & Biases run (needs the
    ``wandb`` package: ``pip install 'mimotron[wandb]'``); written under
    ``<log.dir>/wandb``, offline with ``WANDB_MODE=offline`` (upload later with
    ``wandb sync``). A resumed run continues the same wandb run.
    """
    wandb_project: str = ""
    """The wandb project of ``log.wandb`` (only with ``log.wandb = true``); empty =
    ``mimotron``. The wandb run is named after ``name``.
    """


@dataclass
class ProfileConfig:
    """torch.profiler traces."""

    enabled: bool = False
    """Record torch.profiler Chrome traces under ``<log.dir>/profile/``."""
    start: int = 2
    """First profiled iteration (numbered from 1; 0 <= start <= end)."""
    end: int = 4
    """Last profiled iteration (inclusive)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks to profile; each must exist in the world."""
