"""Write a checkpoint with DCP, synchronously or in the background, and commit it.

A save goes through four steps, each issued by every rank of the checkpoint group:

1. rank 0 makes room (an old or partial ``iter_N`` is retired, see ``files.retire``)
   and broadcasts the outcome, so no rank writes into a directory being deleted;
2. ``dcp.save`` (or ``dcp.async_save`` in thread mode, which first copies the state to
   CPU memory so training may change the weights at once): each rank writes its own
   shards; entries several ranks hold are written by one of them. DCP propagates a
   failed write on any rank to every rank;
3. commit: every rank hashes the files it wrote and all ranks exchange the results;
   rank 0 writes ``manifest.json`` (the checkpoint is now complete), then replaces
   ``latest``, then deletes checkpoints beyond ``checkpoint.keep``;
4. rank 0 broadcasts whether the commit worked, so every rank raises alike if not.

In async mode steps 2-4 run on a background thread, over a process group of their own
(gloo): collectives of the training loop keep running on the main thread meanwhile.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from mimotron.checkpoint.files import (
    CheckpointError,
    file_digest,
    iter_dir,
    prune,
    rank_files,
    retire,
    write_latest,
    write_manifest,
)
from mimotron.checkpoint.load import DCP_ERRORS, describe_failure, log
from mimotron.checkpoint.state import build_save_state, layout_signature
from mimotron.optim.scheduler import OptimizerParamScheduler

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer


@dataclass
class SaveHandle:
    """A checkpoint save: finished (sync) or in flight on a background thread (async).

    Attributes:
        iteration: the iteration saved.
        path: its ``iter_NNNNNNN`` directory.
        blocking_s: seconds the caller was blocked (async: building + staging only).
        future: the background job (async), None when the save already finished.
    """

    iteration: int
    path: Path
    blocking_s: float
    future: Future | None = None

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self.future is None or self.future.done()

    def failed(self) -> bool:
        """Whether a finished background save raised (never blocks)."""
        return (
            self.future is not None and self.future.done() and self.future.exception() is not None
        )

    def wait(self) -> None:
        """Block until the save is complete.

        Raises:
            CheckpointError: the background write or commit failed.
        """
        if self.future is None:
            return
        try:
            self.future.result()
        except CheckpointError:
            raise
        except DCP_ERRORS as exc:
            raise CheckpointError(
                f"saving iteration {self.iteration} to {self.path} failed: "
                f"{describe_failure(exc, self.path)}"
            ) from exc


def save_checkpoint(
    root: str | Path,
    model: nn.Module,
    optimizer: MimoOptimizer,
    schedulers: dict[str, OptimizerParamScheduler],
    global_state: Any,
    infra: Any,
    *,
    async_save: bool = False,
    keep: int | None = None,
    process_group: Any = None,
    stager: Any = None,
) -> SaveHandle:
    """Save this run after ``global_state.train_state.iteration`` (collective).

    Args:
        root: the checkpoint directory (``iter_NNNNNNN`` and ``latest`` go there).
        model: this rank's ``MimoModel``.
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module schedulers present on this rank.
        global_state: config, runtime, train state.
        infra: the run's ``MimoModelInfra`` (its rank map goes into the manifest).
        async_save: return once the state is copied; write in the background.
        keep: keep this many complete checkpoints (None = all).
        process_group: group over all ranks for DCP's coordination; None = the default
            group. Async saves need a dedicated gloo group (``dist.new_group(backend=
            "gloo")``): the background thread must not share the training's group.
        stager: for async saves, a long-lived ``make_stager()`` whose staging buffers
            are reused from save to save (None = DCP's default, which allocates anew).

    Returns:
        A handle; call ``wait()`` before the next save and before exiting.

    Raises:
        ValueError: async without a dedicated process group, or ``keep < 1``.
        CheckpointError: a synchronous save failed (on every rank alike).
    """
    if async_save and process_group is None:
        raise ValueError(
            "async_save=True needs process_group: a dedicated gloo group "
            "(dist.new_group(backend='gloo')) for the background thread"
        )
    if keep is not None and keep < 1:
        raise ValueError(f"keep={keep!r} is invalid: expected an integer >= 1 or None")
    start = time.perf_counter()
    state = build_save_state(model, optimizer, schedulers, global_state, infra)
    layout = layout_signature(infra, global_state.runtime.device)
    iteration = global_state.train_state.iteration
    return _write_checkpoint(
        state, Path(root), iteration, layout, process_group, async_save, keep, start, stager
    )


def make_stager(pinned: bool = False) -> Any:
    """A staging helper for async saves that keeps its host buffers between saves.

    DCP's default allocates a fresh copy of the state on every async save; reusing the
    buffers cuts the time training is blocked by about 2.5x on CPU (benchmarks/
    checkpoint.py), at the cost of one copy of the state staying allocated. The next save
    waits for the previous write, so a buffer is never overwritten while being written.

    Args:
        pinned: stage device tensors into pinned host buffers with non-blocking copies
            (``runtime.pins_memory(device)``: an accelerator); off on the CPU.
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Shared memory and async staging need a worker process; pinning needs an accelerator.
    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False,
                                        use_non_blocking_copy=pinned))


def _write_checkpoint(
    state: dict[str, Any],
    root: Path,
    iteration: int,
    layout: dict[str, Any],
    group: Any,
    async_save: bool,
    keep: int | None,
    start: float,
    stager: Any = None,
) -> SaveHandle:
    """Steps 1-4 of the module docstring for an already built state dict."""
    path = iter_dir(root, iteration)
    status: dict[str, Any] = {"ok": True}
    if dist.get_rank(group) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            retire(root, iteration)
        except OSError as exc:
            status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    # Also the barrier: nobody writes into a directory rank 0 may still be deleting.
    _agree(status, group, f"preparing {path} failed")
    if not async_save:
        try:
            dcp.save(state, checkpoint_id=str(path), process_group=group)
        except DCP_ERRORS as exc:
            raise CheckpointError(
                f"saving iteration {iteration} to {path} failed: {describe_failure(exc, path)}"
            ) from exc
        _commit(path, root, iteration, layout, group, keep)
        seconds = time.perf_counter() - start
        log(dist.get_rank(), f"saved iteration {iteration} to {path} in {seconds:.2f} s")
        return SaveHandle(iteration, path, seconds)
    staged = dcp.async_save(
        state,
        checkpoint_id=str(path),
        process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        async_stager=stager,
    )
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mimotron-checkpoint")
    job = executor.submit(_finish_async, staged, path, root, iteration, layout, group, keep, start)
    executor.shutdown(wait=False)  # The thread ends with the job.
    return SaveHandle(iteration, path, time.perf_counter() - start, job)


def _finish_async(
    staged: Future,
    path: Path,
    root: Path,
    iteration: int,
    layout: dict[str, Any],
    group: Any,
    keep: int | None,
    start: float,
) -> None:
    try:
        staged.result()
    except DCP_ERRORS as exc:
        raise CheckpointError(
            f"saving iteration {iteration} to {path} failed: {describe_failure(exc, path)}"
        ) from exc
    _commit(path, root, iteration, layout, group, keep)
    log(
        dist.get_rank(),
        f"iteration {iteration} written to {path} in the background "
        f"({time.perf_counter() - start:.2f} s)",
    )


def _commit(
    path: Path, root: Path, iteration: int, layout: dict[str, Any], group: Any, keep: int | None
) -> None:
    """Steps 3-4: manifest, ``latest``, retention; the same outcome on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    try:
        local: dict[str, Any] = {
            "ok": True,
            "files": {n: file_digest(path / n) for n in rank_files(path, rank)},
        }
    except OSError as exc:
        local = {"ok": False, "error": f"rank {rank}: {exc}"}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local, group=group)
    status: dict[str, Any] = {"ok": True}
    if rank == 0:
        try:
            failed = [g["error"] for g in gathered if not g["ok"]]
            if failed:
                raise CheckpointError("; ".join(failed))
            files = {n: d for g in gathered for n, d in g["files"].items()}
            write_manifest(path, iteration, layout, files)
            write_latest(root, iteration)
            if keep is not None:
                prune(root, iteration, keep)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    _agree(status, group, f"committing iteration {iteration} to {path} failed")


def _agree(status: dict[str, Any], group: Any, what: str) -> None:
    """Broadcast rank 0's outcome; every rank raises alike when it failed."""
    box = [status]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    if not box[0]["ok"]:
        raise CheckpointError(f"{what}: {box[0]['error']}")
