"""Weights & Biases as a metrics sink beside ``metrics.jsonl`` and TensorBoard (``log.wandb``).

The logging rank (the only writer of ``metrics.jsonl``) logs every record it writes,
train and evaluation alike, to one wandb run: nested values are flattened to
``a/b`` keys (``lr/vision``, ``module_time_s/language/forward``), list items to
``a/0``, ``a/1``; ``None`` (a non-finite number in ``metrics.jsonl``) is left out, as
TensorBoard leaves it. Every key is plotted against the record's ``iteration``
(``define_metric``), not wandb's own step counter, so the evaluation records share the
x-axis of the training ones and a resumed run continues where its checkpoint was.

**Where.** The run is written under ``<log.dir>/wandb``. ``WANDB_MODE=offline`` keeps it
there (upload later with ``wandb sync``); otherwise wandb's own login and
``WANDB_*`` variables apply. The project is ``log.wandb_project`` (default
``mimotron``), the run's name is ``name`` and its config the run's whole config.

**Resume.** The wandb run id is kept in ``<log.dir>/wandb_run_id``: a run that resumes
from a checkpoint continues the same wandb run (``resume="allow"``); a fresh start gets
a new id. The file is never read or written through a link.

wandb's console capture is off (the console stays the training's own:
:class:`~mimotron.training.console.LiveLine` redraws it on a terminal) and wandb is
quiet: it says only where the run is (and, offline, how to upload it).
"""

from __future__ import annotations

import math
import secrets
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mimotron.config.schema import MimoConfig
from mimotron.run_files import check_plain, read_text, write_text

DEFAULT_PROJECT = "mimotron"
RUN_ID_FILE = "wandb_run_id"
"""In ``log.dir``: the wandb run id a resumed run continues."""
_ID_CHARS = string.ascii_lowercase + string.digits


def flatten_record(record: dict[str, Any]) -> dict[str, float | int | bool]:
    """The wandb row of a record: ``a/b`` keys, numbers only, ``None`` left out."""
    return dict(_leaves("", record))


def _leaves(prefix: str, value: Any) -> Iterator[tuple[str, float | int | bool]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(f"{prefix}/{key}" if prefix else str(key), item)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _leaves(f"{prefix}/{i}", item)
    elif isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        yield prefix, value


def run_id(log_dir: Path, resume: bool) -> str:
    """The wandb run id: the recorded one when resuming, else a new one (recorded).

    Raises:
        UnsafeRunFile: ``wandb_run_id`` is a link or not a plain file (never followed).
        RunFileError: it cannot be written (a full disk; names it).
    """
    path = log_dir / RUN_ID_FILE
    check_plain(path)
    if resume and path.is_file():
        recorded = read_text(path).strip()
        if recorded:
            return recorded
    # wandb's own id form: 8 characters of [a-z0-9].
    new = "".join(secrets.choice(_ID_CHARS) for _ in range(8))
    log_dir.mkdir(parents=True, exist_ok=True)
    write_text(path, new + "\n")
    return new


class WandbSink:
    """One wandb run that receives the run's records (rules in the module docstring).

    Args:
        cfg: the run config (``log.dir``, ``log.wandb_project``, ``name``; the whole
            config is the run's wandb config).
        resume: the run resumes from a checkpoint: continue the recorded wandb run.

    Raises:
        ValueError: ``wandb.init`` failed (not logged in, no network): one line with
            what wandb said and the two ways out (log in, or ``WANDB_MODE=offline``).
    """

    def __init__(self, cfg: MimoConfig, resume: bool) -> None:
        import wandb

        log_dir = cfg.log_dir
        run = run_id(log_dir, resume)
        try:
            self._run = wandb.init(
                project=cfg.log.wandb_project or DEFAULT_PROJECT, name=cfg.name,
                id=run, resume="allow", dir=str(log_dir),
                config=cfg.to_dict(), settings=wandb.Settings(console="off", quiet=True))
        except Exception as exc:  # noqa: BLE001 - wandb raises many kinds; all mean "no run"
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(
                f"log.wandb=True: wandb could not start a run ({reason}); log in with "
                "`wandb login` (or WANDB_API_KEY), or set WANDB_MODE=offline to write it "
                f"under {log_dir / 'wandb'} and upload it later with `wandb sync`") from exc
        # Every key against the record's iteration: eval rows share the train x-axis.
        self._run.define_metric("iteration")
        self._run.define_metric("*", step_metric="iteration")

    @property
    def directory(self) -> Path:
        """The wandb run's folder (``<log.dir>/wandb/<run>-<time>-<id>/files``' parent)."""
        return Path(self._run.dir).parent

    def log(self, record: dict[str, Any]) -> None:
        """Log one record (``metrics.jsonl``'s line) as one wandb row."""
        self._run.log(flatten_record(record))

    def close(self) -> None:
        """Finish the wandb run (offline: its folder is complete) and stop wandb's service.

        The service process and wandb's threads end here, not at interpreter exit: a
        process that goes on (a test, a notebook, a script training again) forks cleanly.
        """
        import wandb

        self._run.finish()
        wandb.teardown()
