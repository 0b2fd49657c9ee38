"""Load a checkpoint into a run of any valid layout (the resume path).

Order on every rank, so no rank can be left waiting in a collective:

1. resolve the path and read the manifest and DCP's ``.metadata`` (after checking its
   SHA-256, with a restricted unpickler: see :mod:`~mimotron.checkpoint.safe_metadata`):
   plain files, no collectives;
2. build this rank's template (model, optimizer, schedules, meta, RNG when the rank map
   is unchanged) and check it against the checkpoint's keys and global shapes; check a
   share of the data files against the manifest (rank ``r`` of ``W`` checks files
   ``r, r+W, ...``);
3. one ``all_gather_object`` of the problems found (including model tensors saved in
   a dtype that does not load into them, :mod:`mimotron.models.weight_checks`): if any
   rank found one, every rank raises the same error, naming the files or keys;
4. one ``dcp.load``: each rank reads just its shards (DCP re-cuts DTensors); the
   metadata again through the restricted unpickler, tensors and non-tensor entries with
   ``weights_only=True``, so nothing in a checkpoint can run code;
5. the model tensors this rank read checked for NaN and infinities, and a second
   ``all_gather_object`` so that every rank refuses them alike;
6. hand the results to the optimizer, schedulers, train state and RNG.

When the rank map differs from the saved one (another TP/PP/DP split or placement),
per-rank RNG state has no counterpart; it is re-derived from ``(seed, iteration, rank)``
and rank 0 says so.
"""

from __future__ import annotations

import errno
import io
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from mimotron.checkpoint.files import (
    DCP_METADATA,
    CheckpointError,
    read_manifest,
    resolve_checkpoint,
    verify_file,
)
from mimotron.checkpoint.lora_base import check_base
from mimotron.checkpoint.safe_metadata import SafeFileSystemReader, load_metadata
from mimotron.checkpoint.state import (
    META,
    MODEL,
    LoadRequest,
    apply_loaded,
    build_load_request,
    describe_layout,
    layout_signature,
    rederive_rng,
)
from mimotron.models.weight_checks import capped, dtype_problem, nonfinite_problems
from mimotron.optim.scheduler import OptimizerParamScheduler

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer

# DCP reports failures as CheckpointException, a BaseException: catch it explicitly. (Here,
# not in files.py: that module is read by the launcher, which never imports DCP.)
DCP_ERRORS = (Exception, CheckpointException)


def describe_failure(exc: BaseException, path: Path | None = None) -> str:
    """One line per failing rank for DCP's exception (its own text is full tracebacks).

    A write that failed for lack of space reads the same on every rank that saw it,
    naming ``path`` (the checkpoint folder) and the space left there: torch's stream
    writer reports a short write as ``unexpected pos A vs B`` where Python's own write
    says ``[Errno 28]``.
    """
    if isinstance(exc, CheckpointException):
        return "; ".join(f"rank {rank}: {_one_failure(err, path)}"
                         for rank, (err, _) in sorted(exc.failures.items()))
    return _one_failure(exc, path)


def _one_failure(err: BaseException, path: Path | None) -> str:
    if path is not None and _out_of_space(err):
        return f"no space left on the device holding {path} ({_free_space(path)} free)"
    return f"{type(err).__name__}: {err}"


def _out_of_space(err: BaseException | None) -> bool:
    """ENOSPC anywhere in the chain, or torch's short-write error (a full device)."""
    while err is not None:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if re.search(r"unexpected pos \d+ vs \d+|file write failed", str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


def _free_space(path: Path) -> str:
    """Free bytes on the file system of ``path`` (its nearest existing folder)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return "unknown"
    return f"{shutil.disk_usage(existing).free:,} bytes"


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries load with ``weights_only=True``.

    Every object mimotron stores is JSON text, which ``weights_only`` accepts; anything
    else in a checkpoint is refused instead of unpickled.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Deserialize one non-tensor entry without arbitrary unpickling."""
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def log(rank: int, message: str) -> None:
    """Print a checkpoint message once (from global rank 0)."""
    if rank == 0:
        print(f"checkpoint: {message}", flush=True)


def read_metadata(path: Path, manifest: dict[str, Any]) -> Metadata:
    """DCP's metadata, after its checksum matched, with a restricted unpickler.

    The checksum only finds damage (truncation, bit rot): whoever can write the file can
    rewrite the manifest too. What keeps a crafted file from running code is
    :class:`~mimotron.checkpoint.safe_metadata.MetadataUnpickler`.

    Raises:
        CheckpointError: the file is missing, damaged, unreadable or refused (names it).
    """
    expected = manifest["files"].get(DCP_METADATA)
    if expected is None:
        raise CheckpointError(f"{path / 'manifest.json'} is corrupted: no {DCP_METADATA} entry")
    problem = verify_file(path, DCP_METADATA, expected)
    if problem:
        raise CheckpointError(problem)
    return load_metadata(path / DCP_METADATA)


def verify_share(path: Path, manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """Check this rank's share of the data files against the manifest."""
    names = sorted(n for n in manifest["files"] if n != DCP_METADATA)
    problems = [verify_file(path, n, manifest["files"][n]) for n in names[rank::world_size]]
    return [p for p in problems if p]


def agree_on_problems(problems: list[str], what: str, group: Any = None) -> None:
    """Collective: raise the same ``CheckpointError`` on every rank if any rank found one."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    found = sorted({p for rank_problems in gathered for p in rank_problems})
    if found:
        raise CheckpointError(f"cannot load {what}:\n  " + "\n  ".join(found))


def load_checkpoint(
    checkpoint: str | Path,
    model: nn.Module,
    optimizer: MimoOptimizer,
    schedulers: dict[str, OptimizerParamScheduler],
    global_state: Any,
    infra: Any,
    process_group: Any = None,
) -> int:
    """Restore a run from a checkpoint (collective over the world).

    Args:
        checkpoint: a checkpoint root holding ``latest``, or one ``iter_NNNNNNN`` dir.
        model: this rank's ``MimoModel`` (loaded in place).
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module schedulers present on this rank.
        global_state: its ``train_state`` is restored (iteration, consumed samples).
        infra: the run's ``MimoModelInfra`` (rank map, for the RNG decision).
        process_group: group over all ranks; None = the default group.

    Returns:
        The iteration the checkpoint was written after; training continues at the next.

    Raises:
        ValueError: the path is not a checkpoint.
        CheckpointError: missing, incomplete or corrupted (names the file), or it does
            not fit this model (names the keys). Raised on every rank alike.
    """
    path = resolve_checkpoint(checkpoint)
    runtime = global_state.runtime
    optimizer.finish_param_gather()  # a late all-gather would overwrite the loaded rows
    manifest = read_manifest(path)
    metadata = read_metadata(path, manifest)
    here = layout_signature(infra, runtime.device)
    same_layout = manifest.get("layout") == here
    fresh_scalers = {n: i.loss_scaler.state_dict() for n, i in optimizer.module_infos.items()}
    req = build_load_request(model, optimizer, schedulers, global_state, metadata, same_layout)
    read_checkpoint(path, manifest, req, runtime.rank, process_group, metadata)
    # Adapters belong to the base they were trained on: the same refusal on every rank.
    check_base(json.loads(req.state[META]), global_state.cfg, path)
    meta, fresh = apply_loaded(req, optimizer, schedulers, global_state)
    say_fresh(fresh, path, infra)
    iteration = checked_iteration(path, meta, manifest)
    _after_load(path, meta, manifest, here, same_layout, fresh_scalers, optimizer, global_state)
    return iteration


def read_checkpoint(path: Path, manifest: dict[str, Any], req: LoadRequest, rank: int,
                    process_group: Any = None, metadata: Metadata | None = None) -> None:
    """Check a request and this rank's share of the files, agree, then ``dcp.load`` it.

    Collective over ``process_group``: every rank raises the same ``CheckpointError``
    when any rank found a problem, before anything is read; and again after the read
    when any rank's model tensors hold NaN or infinities.

    Args:
        path: the checkpoint directory.
        manifest: its manifest.
        req: this rank's request (:func:`~mimotron.checkpoint.state.build_load_request`).
        rank: global rank, for the messages.
        process_group: group over all ranks; None = the default group.
        metadata: the checkpoint's DCP metadata: model tensors saved in a dtype that
            does not load into this rank's are refused (None: not checked).
    """
    world = dist.get_world_size(process_group)
    problems = [f"rank {rank}: {e}" for e in req.errors]
    if metadata is not None:
        problems += _dtype_problems(path, req, metadata)
    problems += verify_share(path, manifest, dist.get_rank(process_group), world)
    agree_on_problems(problems, str(path), process_group)
    try:
        dcp.load(
            req.state,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            process_group=process_group,
        )
    except DCP_ERRORS as exc:
        raise CheckpointError(f"reading checkpoint {path} failed: {describe_failure(exc)}") from exc
    # This rank's part of each model tensor (DCP re-cut them), on the device: one pass.
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in req.state.items()
             if k.startswith(MODEL) and isinstance(v, torch.Tensor)}
    found = nonfinite_problems(str(path), local)
    agree_on_problems([f"rank {rank}: {p}" for p in capped(found)], str(path), process_group)


def _dtype_problems(path: Path, req: LoadRequest, metadata: Metadata) -> list[str]:
    """Model tensors the checkpoint saved in a dtype that does not load into this rank's."""
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in req.state.items():
        md = saved.get(key)
        if key.startswith(MODEL) and isinstance(value, torch.Tensor) and \
                isinstance(md, TensorStorageMetadata):
            bad = dtype_problem(str(path), key, md.properties.dtype, value.dtype)
            problems += [bad] if bad else []
    return problems


def say_fresh(fresh: list[str], path: Path, infra: Any) -> None:
    """One line per module that had no optimizer state or schedule in the checkpoint."""
    for name in fresh:
        role = infra.roles[name]
        if role.tp == role.pp == role.dp == 0:  # One message per module, not per rank.
            print(
                f"checkpoint: module {name!r} had no optimizer state or schedule in "
                f"{path} (frozen when saved): it starts fresh",
                flush=True,
            )


def checked_iteration(path: Path, meta: dict[str, Any], manifest: dict[str, Any]) -> int:
    """The iteration a checkpoint holds, which its manifest must name too."""
    iteration = int(meta["iteration"])
    if iteration != manifest.get("iteration"):
        raise CheckpointError(
            f"{path}: manifest says iteration {manifest.get('iteration')}, "
            f"the checkpoint holds {iteration}"
        )
    return iteration


def _after_load(
    path: Path,
    meta: dict[str, Any],
    manifest: dict[str, Any],
    here: dict[str, Any],
    same_layout: bool,
    fresh_scalers: dict[str, Any],
    optimizer: MimoOptimizer,
    global_state: Any,
) -> None:
    """Fix up what does not carry over (precision change, RNG on a new layout) and log."""
    cfg, ts, rank = global_state.cfg, global_state.train_state, global_state.runtime.rank
    restore_fresh_scalers(meta, fresh_scalers, optimizer, global_state)
    log(
        rank,
        f"resumed from {path} at iteration {ts.iteration} ({ts.consumed_samples} samples consumed)",
    )
    if not same_layout:
        rederive_rng(cfg.train.seed, ts.iteration, rank)
        saved = manifest.get("layout")
        log(
            rank,
            "the layout differs from the saved one, so RNG state was re-derived from "
            f"(seed, iteration, rank); saved: "
            f"{describe_layout(saved) if saved else 'unknown'}; now: {describe_layout(here)}",
        )


def restore_fresh_scalers(meta: dict[str, Any], fresh_scalers: dict[str, Any],
                          optimizer: MimoOptimizer, global_state: Any) -> None:
    """After loading optimizer state saved under another precision, start loss scaling
    afresh: a constant fp32 scale of 1 must not become fp16's starting scale (or back)."""
    cfg, rank = global_state.cfg, global_state.runtime.rank
    saved_precision = meta["config"]["train"]["precision"]
    if saved_precision == cfg.train.precision:
        return
    for name, info in optimizer.module_infos.items():
        info.loss_scaler.load_state_dict(fresh_scalers[name])
    log(rank, f"precision changed ({saved_precision} -> {cfg.train.precision}): loss "
        "scaling starts afresh")
