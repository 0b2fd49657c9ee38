"""A run directory holds one run: a fresh start never clobbers a previous one silently.

A run *starts fresh* when ``checkpoint.load = "none"``, or ``"auto"`` finds no checkpoint
to resume. Its metrics writer then truncates ``<log.dir>/metrics.jsonl`` and its first
save moves ``latest`` back to iteration 1's neighbourhood, over whatever a previous run
left there. So a fresh start over a *previous run* — a non-empty ``metrics.jsonl`` in
log.dir, or ``latest`` / ``iter_*`` folders in checkpoint.dir — is refused with one line
naming the directory, unless ``train.overwrite = true``; then the previous run's files
(metrics.jsonl, tensorboard/, profile/, latest, iter_*) are moved, not deleted, into
``<log.dir>/previous-<time>/`` (checkpoints keep their path relative to log.dir there;
a checkpoint.dir outside log.dir gets its own ``previous-<time>/``), and the move is
printed. Anything else in the directories (a job's own log file) stays where it is.

An explicit ``checkpoint.load = <path>`` resumes, but into a checkpoint.dir that may hold
*newer* ``iter_*`` folders (a rewind to an earlier checkpoint); its first save would move
``latest`` below them. That is refused the same way, and with ``train.overwrite = true``
the newer folders (and ``latest`` when it names one) are moved aside.

Who moves, and when: files may only be moved before any rank can write. ``mimotron
train`` calls :func:`prepare_run_dir` before it launches the ranks (no process group
exists yet); under an external launcher every rank runs that call, and only ``RANK`` 0
moves, while the others neither move nor refuse (with ``train.overwrite`` false all of
them refuse alike, since nobody moves anything). No rank can write into the directory
before every rank has joined the process group, which each does only after this call.
Library users get :func:`guard_fresh_start` at the start of ``train_mimo``: every rank
refuses alike; a single process moves the previous run aside itself, but several ranks
cannot without a collective (one rank would move files another is about to open), so
they are told to move it before starting the ranks.

A run that starts fresh with ``checkpoint.pretrained`` (a fine-tune: another run's
checkpoint or a ``mimotron export`` folder) is a fresh start like any other: it needs a
log.dir without a previous run (or ``train.overwrite``), and the checkpoint it starts
from may not lie inside its checkpoint.dir (``auto`` would resume it as this run's own,
and ``train.overwrite`` would move it aside). Once it has saved, a relaunch resumes its
own checkpoints; ``pretrained`` is not read again. :func:`pretrained_source` checks the
path before any rank starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path

from mimotron.checkpoint.files import (
    LATEST,
    CheckpointError,
    checkpoint_iterations,
    parse_iteration,
    read_latest,
    read_manifest,
    resolve_checkpoint,
    resolve_load,
)
from mimotron.config.hf_files import check_safetensors
from mimotron.config.schema import MimoConfig
from mimotron.outputs import check_output_dir

METRICS = "metrics.jsonl"
LOG_ENTRIES = (METRICS, "tensorboard", "profile")
"""What a run writes into log.dir (besides its checkpoints)."""
PREVIOUS = "previous-"


class RunRefused(ValueError):
    """The run directory refuses this launch (in use, or nothing left to train): the
    config may be valid, so ``mimotron train`` prints the reason without calling the
    config invalid."""


def is_mover() -> bool:
    """Whether this process may move files: the one process, or RANK 0 of a launch."""
    return os.environ.get("RANK", "0") == "0"


def previous_run(cfg: MimoConfig) -> list[Path]:
    """The files of a previous run a fresh start would overwrite (empty when none).

    A previous run is a non-empty ``metrics.jsonl`` in log.dir or ``latest`` / ``iter_*``
    in checkpoint.dir; its tensorboard/ and profile/ folders are listed with it.
    """
    metrics = cfg.log_dir / METRICS
    logged = metrics.is_file() and metrics.stat().st_size > 0
    root = cfg.checkpoint_dir
    checkpoints = [p for _, p in sorted(checkpoint_iterations(root).items())]
    if (root / LATEST).exists():
        checkpoints.insert(0, root / LATEST)
    if not logged and not checkpoints:
        return []
    logs = [cfg.log_dir / name for name in LOG_ENTRIES if (cfg.log_dir / name).exists()]
    return logs + checkpoints


def _refusal(cfg: MimoConfig, entries: list[Path]) -> str:
    where = cfg.log_dir if (cfg.log_dir / METRICS) in entries else cfg.checkpoint_dir
    shown = ", ".join(str(p) for p in entries[:3]) + (
        f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    if cfg.checkpoint.load == "auto":
        why = f"checkpoint.load='auto' found no checkpoint to resume in {cfg.checkpoint_dir}"
        also = ""
    else:
        why = f"checkpoint.load={cfg.checkpoint.load!r}"
        also = ", resume it with checkpoint.load=auto"
    return (f"{where} holds a previous run ({shown}) that this fresh start ({why}) would "
            f"overwrite: set train.overwrite=true to move it aside{also}, or use another "
            "log.dir")


def _inside(path: Path, root: Path) -> Path | None:
    """``path`` relative to ``root`` when it lies inside it, else None."""
    try:
        return path.resolve().relative_to(root.resolve())
    except ValueError:
        return None


def move_aside(cfg: MimoConfig, entries: list[Path]) -> Path:
    """Move a previous run's files into ``<log.dir>/previous-<time>/``; print what moved.

    Returns:
        The folder they were moved into.

    Raises:
        ValueError: a file could not be moved (names it and why).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = cfg.log_dir / f"{PREVIOUS}{stamp}"
    n = 1
    while dest.exists() or (cfg.checkpoint_dir / dest.name).exists():
        n += 1
        dest = cfg.log_dir / f"{PREVIOUS}{stamp}-{n}"
    moved: list[str] = []
    folders: list[str] = []  # Where things went: dest, and for outside checkpoints theirs.
    for entry in entries:
        rel = _inside(entry, cfg.log_dir)
        folder = dest if rel is not None else cfg.checkpoint_dir / dest.name
        target = folder / (rel if rel is not None else entry.name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            entry.rename(target)
        except OSError as exc:
            raise ValueError(f"train.overwrite=true: cannot move {entry} to {target}: "
                             f"{exc.strerror or exc}") from None
        moved.append(str(rel if rel is not None else entry))
        if str(folder) not in folders:
            folders.append(str(folder))
    print(f"mimotron: train.overwrite=true: moved the previous run ({', '.join(moved)}) to "
          f"{' and '.join(folders)}", file=sys.stderr, flush=True)
    return dest


def _probe(path: Path, key: str) -> None:
    """Create ``path`` if missing and create/delete a file in it; ValueError if not."""
    probe = path / f".mimotron-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{key}={str(path)!r} is not writable: {exc.strerror or exc} "
                         "(it must be a directory this user can create files in)") from None


def _check_creatable(path: Path, key: str) -> None:
    """``path`` is, or could be made, a writable folder; a missing one is not created.

    Creating it and removing it again would race with the other ranks, which list it
    at the same time: one that saw it exist could fail reading it.
    """
    try:
        check_output_dir(path)
    except ValueError as exc:
        detail = str(exc).split(" is invalid: ", 1)[-1]
        raise ValueError(f"{key}={str(path)!r}: {detail} (it must be a directory this "
                         "user can create files in)") from None


def check_writable(cfg: MimoConfig) -> None:
    """log.dir can be written (created if missing) and checkpoint.dir can be made (not
    created: saves create it).

    Raises:
        ValueError: one line naming the key and the directory.
    """
    _probe(cfg.log_dir, "log.dir")
    _check_creatable(cfg.checkpoint_dir, "checkpoint.dir")


def prepare_run_dir(cfg: MimoConfig) -> None:
    """Before launch: writable directories, and no silent fresh start over a previous run.

    Call before any process group exists, in every process that runs the command (see
    the module docstring for who checks and who moves).

    Raises:
        ValueError: an unwritable directory, an invalid ``checkpoint.load`` or
            ``checkpoint.pretrained``, or a previous run without ``train.overwrite`` (one
            line each).
        RunRefused: the checkpoint to resume (or to continue with
            ``checkpoint.pretrained_schedule``) already reached train.iters.
        CheckpointError: ``latest`` names a missing or incomplete checkpoint.
    """
    mover = is_mover()
    if mover:
        check_writable(cfg)
    loaded = resolve_load(cfg.checkpoint.load, cfg.checkpoint_dir, quiet=True)
    if loaded is not None:
        check_something_to_train(cfg, loaded)
        if cfg.checkpoint.load != "auto":  # auto follows `latest`, rewound or not.
            _check_newer(cfg, loaded, mover)
        return  # Resuming: the run continues from the loaded checkpoint.
    pretrained_source(cfg)  # A fine-tune starts fresh: its source is checked first.
    if cfg.train.overwrite and not mover:
        return  # RANK 0 moves; looking now could race with it.
    entries = previous_run(cfg)
    if not entries:
        return
    if not cfg.train.overwrite:
        raise ValueError(_refusal(cfg, entries))
    move_aside(cfg, entries)


def checkpoint_iteration(loaded: Path) -> int | None:
    """The iteration a checkpoint folder follows (its name, else its manifest)."""
    start = parse_iteration(loaded)
    if start is None:
        with contextlib.suppress(CheckpointError):
            start = int(read_manifest(loaded).get("iteration", 0))
    return start


def check_something_to_train(cfg: MimoConfig, loaded: Path) -> None:
    """A resume from ``loaded`` has iterations left to train.

    A finished run launched again would otherwise "resume" with nothing to do, evaluate
    again (a duplicate eval record) and exit 0 as if it had trained.

    Raises:
        RunRefused: ``loaded`` already reached train.iters (nothing is written).
    """
    reached = checkpoint_iteration(loaded)
    if reached is not None and reached >= cfg.train.iters:
        raise RunRefused(
            f"nothing to train: iteration {reached} already reached (checkpoint.load="
            f"{cfg.checkpoint.load!r} resumes from {loaded}, train.iters="
            f"{cfg.train.iters}): raise train.iters to train on, or use another log.dir")


def newer_checkpoints(cfg: MimoConfig, loaded: Path) -> list[Path]:
    """``iter_*`` folders in checkpoint.dir newer than ``loaded`` (and ``latest`` if it
    names one of them): the first save of a run resumed from ``loaded`` would move
    ``latest`` back below them."""
    start = checkpoint_iteration(loaded)
    root = cfg.checkpoint_dir
    newer = {it: p for it, p in checkpoint_iterations(root).items()
             if start is not None and it > start and p.resolve() != loaded.resolve()}
    if not newer:
        return []
    entries = [p for _, p in sorted(newer.items())]
    with contextlib.suppress(CheckpointError):
        if read_latest(root) in newer:
            entries.insert(0, root / LATEST)
    return entries


def _check_newer(cfg: MimoConfig, loaded: Path, mover: bool) -> None:
    """An explicit ``checkpoint.load`` below newer checkpoints: refuse, or move them aside."""
    if cfg.train.overwrite and not mover:
        return  # RANK 0 moves; looking now could race with it.
    entries = newer_checkpoints(cfg, loaded)
    if not entries:
        return
    if not cfg.train.overwrite:
        names = ", ".join(p.name for p in entries if p.name != LATEST)
        raise ValueError(
            f"checkpoint.load={cfg.checkpoint.load!r} resumes from {loaded.name}, but "
            f"checkpoint.dir={str(cfg.checkpoint_dir)!r} holds newer checkpoints ({names}) "
            "that its first save would put behind `latest`: set train.overwrite=true to "
            "move them aside, or use another checkpoint.dir")
    move_aside(cfg, entries)


def describe_run_dir(cfg: MimoConfig) -> str:
    """What ``mimotron train`` would do with the run directory (for ``mimotron plan``).

    Read-only: nothing is created or moved.

    Raises:
        ValueError: an invalid ``checkpoint.load`` (as ``mimotron train`` would).
        CheckpointError: ``latest`` names a missing or incomplete checkpoint.
    """
    path = resolve_load(cfg.checkpoint.load, cfg.checkpoint_dir, quiet=True)
    if path is not None:
        try:
            check_something_to_train(cfg, path)
        except RunRefused as exc:
            return f"train would refuse: {exc}"
        return f"resumes from {path}"
    try:
        source = pretrained_source(cfg)
    except RunRefused as exc:
        return f"train would refuse: {exc}"
    start = "" if source is None else f" from {describe_pretrained(cfg, source)}"
    entries = previous_run(cfg)
    if not entries:
        return f"starts fresh in {cfg.log_dir}{start}"
    if cfg.train.overwrite:
        return (f"starts fresh in {cfg.log_dir}{start}; train.overwrite=true moves the "
                f"previous run ({len(entries)} entries) into {cfg.log_dir}/{PREVIOUS}<time>/")
    return "train would refuse: " + _refusal(cfg, entries)


MODULE_FILE = "{}.safetensors"
"""A ``mimotron export`` folder's file of one module (with ``config.json``)."""
EXPORT_FORMAT = "mimotron"
"""The ``format`` its files' safetensors metadata names."""


def pretrained_source(cfg: MimoConfig) -> tuple[Path, bool] | None:
    """``checkpoint.pretrained`` resolved: ``(checkpoint folder, False)`` or ``(export
    folder, True)``; None when unset. Reads headers only (no tensor, no collective).

    Raises:
        ValueError: the path is neither a complete mimotron checkpoint nor an export
            folder holding every module of this config (a damaged file named), lies
            inside this run's checkpoint.dir, or is an export with
            ``pretrained_optimizer`` / ``pretrained_schedule`` (one line naming the
            field).
        RunRefused: ``pretrained_schedule`` continues from an iteration that already
            reached train.iters.
        CheckpointError: ``latest`` names a missing or incomplete checkpoint.
    """
    ck = cfg.checkpoint
    if not ck.pretrained:
        return None
    key, path = f"checkpoint.pretrained={ck.pretrained!r}", Path(ck.pretrained)
    if not path.exists():
        raise ValueError(f"{key} is invalid: expected a mimotron checkpoint or a `mimotron "
                         "export` folder (path does not exist)")
    if _inside(path, cfg.checkpoint_dir) is not None:
        raise ValueError(f"{key} lies inside this run's checkpoint.dir "
                         f"({cfg.checkpoint_dir}): a fine-tune is a new run; give it another "
                         "log.dir (or name)")
    if _is_export(path):
        _check_export(cfg, path, key)
        return path, True
    # A run's log.dir stands for its checkpoints (the default checkpoint.dir).
    run_checkpoints = path / "checkpoints"
    try:
        loaded = resolve_checkpoint(run_checkpoints if read_latest(run_checkpoints) is not None
                                    else path)
    except ValueError:
        raise ValueError(f"{key} is invalid: expected a mimotron checkpoint (a folder holding "
                         f"'{LATEST}', an iter_NNNNNNN folder, or a run's log.dir holding "
                         "checkpoints/) or a `mimotron export` folder (config.json and one "
                         "<module>.safetensors per module)") from None
    if ck.pretrained_schedule:
        reached = checkpoint_iteration(loaded)
        if reached is not None and reached >= cfg.train.iters:
            raise RunRefused(
                f"nothing to train: iteration {reached} already reached (checkpoint."
                f"pretrained_schedule=true continues {loaded}, train.iters={cfg.train.iters}): "
                "raise train.iters, or start the schedule afresh (pretrained_schedule=false)")
    return loaded, False


def _is_export(path: Path) -> bool:
    """A folder holding ``config.json`` and a ``mimotron export`` safetensors file."""
    return (path / "config.json").is_file() and any(
        _export_module(f) is not None for f in path.glob("*.safetensors"))


def _export_module(file: Path) -> str | None:
    """The module a safetensors file of a ``mimotron export`` holds (header only)."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 2**27 else {}
    except (OSError, ValueError):
        return None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        return None
    return meta.get("module")


def _check_export(cfg: MimoConfig, path: Path, key: str) -> None:
    """An export folder holds every module of the config; only weights come from it."""
    for what in ("pretrained_optimizer", "pretrained_schedule"):
        if getattr(cfg.checkpoint, what):
            raise ValueError(f"checkpoint.{what}=true is invalid with {key}: an export "
                             "folder holds weights only; load a mimotron checkpoint instead")
    # Headers only, as the launcher may (a damaged file named, not called missing).

    for m in sorted(cfg.modules):
        if (path / MODULE_FILE.format(m)).is_file():
            try:
                check_safetensors(path / MODULE_FILE.format(m))
            except ValueError as exc:
                raise ValueError(f"{key} is invalid: {exc}") from None
    missing = [m for m in sorted(cfg.modules)
               if _export_module(path / MODULE_FILE.format(m)) != m]
    if missing:
        raise ValueError(f"{key} is invalid: the export folder has no "
                         f"{', '.join(MODULE_FILE.format(m) for m in missing)} (this config's "
                         f"modules: {sorted(cfg.modules)})")


def describe_pretrained(cfg: MimoConfig, source: tuple[Path, bool]) -> str:
    """``the weights of PATH`` and what else a fine-tune keeps from it (one phrase)."""
    path, _ = source
    kept = [what for what, on in (("optimizer state", cfg.checkpoint.pretrained_optimizer),
                                  ("iteration and schedules",
                                   cfg.checkpoint.pretrained_schedule)) if on]
    return f"the weights{''.join(', ' + k for k in kept)} of {path}"


def _continues_pretrained(cfg: MimoConfig) -> bool:
    """The run starts fresh but at pretrained's iteration (``pretrained_schedule``)."""
    return cfg.checkpoint.pretrained_schedule and resolve_load(
        cfg.checkpoint.load, cfg.checkpoint_dir, quiet=True) is None


def guard_fresh_start(cfg: MimoConfig, iteration: int, world_size: int) -> None:
    """Library side of the rule: call in ``train_mimo`` before anything is written.

    Args:
        cfg: the run's config.
        iteration: the iteration the run starts at (0 = a fresh start; a run that
            continues ``checkpoint.pretrained``'s schedule starts fresh at its iteration).
        world_size: ranks in the run (several cannot move files without a collective).

    Raises:
        ValueError: a fresh start over a previous run without ``train.overwrite``; or
            with it, on several ranks.
    """
    if iteration > 0 and not _continues_pretrained(cfg):
        return
    entries = previous_run(cfg)
    if not entries:
        return
    if not cfg.train.overwrite:
        raise ValueError(_refusal(cfg, entries))
    if world_size > 1:
        raise ValueError(
            f"train.overwrite=true cannot move the previous run in {cfg.log_dir} aside once "
            f"{world_size} ranks run: start with `mimotron train`, or call "
            "mimotron.run_dir.prepare_run_dir(cfg) in one process before starting the ranks")
    move_aside(cfg, entries)
