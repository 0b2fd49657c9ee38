"""The checkpoint directory: ``iter_NNNNNNN`` folders, ``latest``, manifests, retention.

A checkpoint is complete once its ``manifest.json`` exists: rank 0 writes it (atomically)
only after every rank reported its files written, and only then replaces ``latest``. A
crash at any earlier point leaves ``latest`` naming the previous complete checkpoint.
The manifest records each file's size and SHA-256 so a truncated or corrupted file is
found, and named, before anything is read from it; it also records the rank map the
checkpoint was written with, so a loader knows before any collective whether per-rank
state (RNG) maps onto its own layout.

The manifest is about integrity (truncation, bit rot, a partial copy), not
authenticity: it is not signed, and whoever can write a checkpoint file can rewrite the
manifest to match. Safety against a crafted checkpoint comes from how files are read:
DCP's ``.metadata`` with a restricted unpickler
(:mod:`~mimotron.checkpoint.safe_metadata`), everything else with
``torch.load(weights_only=True)``, so no checkpoint file can run code. A crafted file
can still hold wrong weights: load checkpoints only from folders you trust to hold
your own runs.

Only rank 0 writes here; everything is plain files, so this module has no collectives.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from mimotron.run_files import write_atomic

MANIFEST = "manifest.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or is missing, incomplete or corrupted."""


def iter_dir(root: Path, iteration: int) -> Path:
    """``<root>/iter_NNNNNNN``: the checkpoint written after ``iteration``."""
    return Path(root) / f"iter_{iteration:07d}"


def parse_iteration(path: Path) -> int | None:
    """The iteration of an ``iter_NNNNNNN`` directory name, or None."""
    match = _ITER_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def _atomic_write(path: Path, text: str) -> None:
    """Write a file so readers see the old or the new content, never a partial one.

    Through a fresh temporary file (never a planted name or link, see
    :mod:`mimotron.run_files`); a failure (a full disk) names ``path``.
    """
    write_atomic(path, text)


def read_latest(root: Path) -> int | None:
    """The iteration named by ``<root>/latest``, or None when there is no such file.

    Raises:
        CheckpointError: the file exists but does not hold an iteration number.
    """
    path = Path(root) / LATEST
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} is corrupted: expected an iteration number, got {text!r}")
    return int(text)


def write_latest(root: Path, iteration: int) -> None:
    """Point ``<root>/latest`` at ``iteration`` (atomic replace)."""
    _atomic_write(Path(root) / LATEST, f"{iteration}\n")


def is_complete(path: Path) -> bool:
    """Whether a checkpoint directory was finished by every rank (has its manifest)."""
    return (Path(path) / MANIFEST).is_file()


def checkpoint_iterations(root: Path) -> dict[int, Path]:
    """Every ``iter_NNNNNNN`` directory under ``root`` (complete or not), by iteration."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        it = parse_iteration(child)
        if it is not None and child.is_dir():
            found[it] = child
    return found


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory a user path means: a root holding ``latest``, or one dir.

    Raises:
        ValueError: the path is neither (the message says what is valid).
        CheckpointError: ``latest`` names a checkpoint that is missing or incomplete.
    """
    path = Path(path)
    latest = read_latest(path) if path.is_dir() else None
    if latest is not None:
        target = iter_dir(path, latest)
        if not is_complete(target):
            raise CheckpointError(
                f"{path / LATEST} names iteration {latest}, but {target} is missing or "
                f"incomplete (no {MANIFEST})"
            )
        return target
    if (path / DCP_METADATA).is_file() or (path / MANIFEST).is_file():
        if not is_complete(path):
            raise CheckpointError(
                f"checkpoint {path} is incomplete: {path / MANIFEST} is missing (it is "
                "written last, after every rank finished); use an earlier checkpoint"
            )
        return path
    raise ValueError(
        f"checkpoint {str(path)!r} is invalid: expected a checkpoint directory holding "
        f"'{LATEST}' or one iter_NNNNNNN directory"
    )


def resolve_load(spec: str, default_root: Path, quiet: bool = False) -> Path | None:
    """Resolve ``checkpoint.load``: ``"auto"``, ``"none"`` or a path.

    Args:
        spec: the config value.
        default_root: ``cfg.checkpoint_dir`` (where ``"auto"`` looks).
        quiet: do not print that ``latest`` was missing (a check before the load).

    Returns:
        The checkpoint directory to load, or None to start fresh.

    Raises:
        ValueError: an invalid value (names the field, the value and what is valid).
        CheckpointError: ``latest`` names a missing or incomplete checkpoint.

    ``"auto"`` without ``latest`` (deleted, or lost with a crash) resumes from the newest
    complete ``iter_*`` folder, if any, rather than starting a fresh run that would
    overwrite them.
    """
    if spec == "none":
        return None
    if spec == "auto":
        if read_latest(default_root) is not None:
            return resolve_checkpoint(default_root)
        return _newest_complete(default_root, quiet)
    if not spec or not Path(spec).exists():
        raise ValueError(
            f'checkpoint.load={spec!r} is invalid: expected "auto", "none", a checkpoint '
            f"directory holding '{LATEST}' or an iter_NNNNNNN directory (path does not exist)"
        )
    try:
        return resolve_checkpoint(spec)
    except ValueError as exc:
        raise ValueError(f"checkpoint.load={spec!r} is invalid: {exc}") from None


def _newest_complete(root: Path, quiet: bool) -> Path | None:
    """The newest complete ``iter_*`` folder of ``root`` (``latest`` is missing), or None."""
    complete = {it: p for it, p in checkpoint_iterations(root).items() if is_complete(p)}
    if not complete:
        return None
    path = complete[max(complete)]
    # Every rank resolves the same path; one of them says so (RANK unset: one process).
    if not quiet and os.environ.get("RANK", "0") == "0":
        print(f"mimotron: {Path(root) / LATEST} is missing; resuming from the newest "
              f"complete checkpoint, {path}", file=sys.stderr, flush=True)
    return path


# ---- manifest ---------------------------------------------------------------------------


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of one file."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": os.path.getsize(path), "sha256": digest}


def rank_files(path: Path, rank: int) -> list[str]:
    """The data files DCP's file system writer produced for ``rank`` (``__<rank>_*``)."""
    return sorted(p.name for p in Path(path).glob(f"__{rank}_*.distcp"))


def write_manifest(
    path: Path, iteration: int, layout: dict[str, Any], files: dict[str, dict[str, Any]]
) -> None:
    """Record the data files (plus DCP's ``.metadata``) and mark the checkpoint complete."""
    files = {**files, DCP_METADATA: file_digest(Path(path) / DCP_METADATA)}
    manifest = {
        "format": "mimotron-dcp",
        "version": FORMAT_VERSION,
        "iteration": iteration,
        "layout": layout,
        "files": dict(sorted(files.items())),
    }
    _atomic_write(Path(path) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint.

    Raises:
        CheckpointError: missing, unreadable, or of an unknown format (names the file).
    """
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} is incomplete: {file} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is corrupted: {exc}") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != "mimotron-dcp"
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{file} is corrupted: not a mimotron checkpoint manifest")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{file} has format version {manifest['version']}; this mimotron reads up to "
            f"{FORMAT_VERSION}"
        )
    return manifest


def verify_file(path: Path, name: str, expected: dict[str, Any]) -> str | None:
    """Compare one file with its manifest entry; an error message naming it, or None."""
    file = Path(path) / name
    if not file.is_file():
        return f"checkpoint file {file} is missing"
    size = os.path.getsize(file)
    if size != expected.get("bytes"):
        return (
            f"checkpoint file {file} is truncated or corrupted: {size} bytes, the "
            f"manifest says {expected.get('bytes')}"
        )
    if file_digest(file)["sha256"] != expected.get("sha256"):
        return f"checkpoint file {file} is corrupted: its SHA-256 does not match the manifest"
    return None


# ---- before and after a save (rank 0 only) ----------------------------------------------


def retire(root: Path, iteration: int) -> None:
    """Make room for a new ``iter_<iteration>``: delete an old or partial one safely.

    When ``latest`` names it, ``latest`` is first moved to the newest other complete
    checkpoint before it (or removed), so ``latest`` never names a directory being
    rewritten. A link under that name is removed, never deleted through.
    """
    target = iter_dir(root, iteration)
    if not target.exists() and not target.is_symlink():
        return
    if read_latest(root) == iteration:
        older = [
            it for it, p in checkpoint_iterations(root).items() if it < iteration and is_complete(p)
        ]
        if older:
            write_latest(root, max(older))
        else:
            (Path(root) / LATEST).unlink()
    if target.is_symlink():  # Not mimotron's folder: only the link goes.
        target.unlink()
        return
    # The manifest goes first: a crash mid-delete leaves an incomplete dir, never a
    # "complete" one with files missing.
    (target / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(target)


def prune(root: Path, current: int, keep: int) -> list[int]:
    """Delete older checkpoints once ``current`` is complete; keep ``keep`` in all.

    Complete checkpoints before ``current`` beyond the newest ``keep - 1`` are deleted,
    as are incomplete ones before ``current`` (failed saves). Newer ones (from a run
    that was rewound) are left alone.

    Returns:
        The iterations deleted.
    """
    found = checkpoint_iterations(root)
    older = sorted(it for it in found if it < current)
    complete = [it for it in older if is_complete(found[it])]
    kept = set(complete[-(keep - 1) :]) if keep > 1 else set()
    deleted = [it for it in older if it not in kept]
    for it in deleted:
        if found[it].is_symlink():  # A link is removed, never deleted through.
            found[it].unlink(missing_ok=True)
            continue
        (found[it] / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(found[it], ignore_errors=True)
    return deleted
