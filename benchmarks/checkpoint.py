"""Case 4 - checkpoint: mimotron's save vs ``torch.save``, and how long an async save blocks.

One forked rank builds the digits model with a wider language model (so the state is
tens to hundreds of MB) and takes one training step so the AdamW state exists. Then,
interleaved, each repetition writes into a fresh directory with every side:

* ``sync`` - mimotron's synchronous save (``mimotron.checkpoint.save_checkpoint``: DCP
  write, SHA-256 manifest, ``latest``);
* ``async`` - the same with ``async_save=True``: the time until the call returns (the
  training loop is blocked that long); completion is awaited outside the timing;
* ``torch_save`` - ``torch.save`` of the same state dict into one file, then ``fsync``
  (DCP's file writer fsyncs too, so both sides are equally durable);
* ``dcp_sync`` / ``dcp_async`` - raw ``torch.distributed.checkpoint`` on the same dict,
  to tell mimotron's own cost (manifest hashing, barriers) from DCP's;
* ``dcp_async_reused_stager`` - ``dcp.async_save`` with one long-lived ``DefaultStager``
  (staging buffers reused between saves instead of freshly allocated each time).

``ckpt_save_ratio`` = sync throughput / ``torch.save`` throughput (tensor bytes per
second); ``async_block_ratio`` = async blocking time / sync save time (target <= 0.2).
Without ``mimotron.checkpoint`` (older trees) the raw DCP sides stand in for mimotron's.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from benchmarks.common import (
    CaseResult,
    Options,
    digits_raw,
    engine_stepper,
    fmt_stats,
    interleave,
    make_config,
    one_rank,
    precompute_steps,
    ratio_figure,
    setup_run,
    summarize,
)
from mimotron.forked_ranks import run_ranks

# language (hidden, layers): state bytes ~ 12 * hidden^2 * layers * 4 B * 3 (weights, m, v)
SIZES = {"tiny": (32, 1), "quick": (384, 3), "default": (640, 4)}
Saver = Callable[[Path], Callable[[], None] | None]  # returns a wait function when async


def mimotron_savers(run: Any, group: Any) -> tuple[dict[str, Any], dict[str, Saver]] | None:
    """mimotron's sync and async save of ``run`` and the state dict it writes (or None)."""
    try:
        from mimotron.checkpoint import save_checkpoint
        from mimotron.checkpoint.save import make_stager
        from mimotron.checkpoint.state import build_save_state
    except ImportError:
        return None
    args = (run.model, run.optimizer, run.schedulers, run.global_state, run.infra)
    # As the training loop does: one stager per run, its buffers reused save after save.
    stager = make_stager()
    savers: dict[str, Saver] = {
        "sync": lambda path: save_checkpoint(path, *args) and None,
        "async": lambda path: (
            save_checkpoint(path, *args, async_save=True, process_group=group,
                            stager=stager).wait
        ),
    }
    return build_save_state(*args), savers


def dcp_savers(state: dict[str, Any]) -> dict[str, Saver]:
    """Raw DCP saves of ``state``; the reused stager keeps its staging buffers."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # Pinned/shared memory need an accelerator; staging stays synchronous so the
    # blocking time still covers the copy (the state may change right after).
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )

    def async_wait(res: Any) -> Callable[[], None]:
        return getattr(res, "upload_completion", res).result  # AsyncSaveResponse or Future

    return {
        "dcp_sync": lambda path: dcp.save(state, checkpoint_id=str(path)) and None,
        "dcp_async": lambda path: async_wait(dcp.async_save(state, checkpoint_id=str(path))),
        "dcp_async_reused_stager": lambda path: async_wait(
            dcp.async_save(state, checkpoint_id=str(path), async_stager=stager)
        ),
    }


def torch_save(state: dict[str, Any], path: Path) -> None:
    """The baseline: one ``torch.save`` file, fsynced like DCP's files."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict/list (what a checkpoint must write)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _rank(rank: int, world: int, overrides: list[str], reps: int) -> dict[str, Any]:
    del rank, world
    raw = digits_raw()
    cfg = make_config(
        raw, one_rank(raw) + overrides + ["train.global_batch_size=8", "train.micro_batch_size=8"]
    )
    run = setup_run(cfg)
    engine_stepper(run, precompute_steps(run, 1))()  # creates the AdamW state
    found = mimotron_savers(run, dist.new_group(backend="gloo"))
    if found is None:
        state = {"model": run.model.state_dict(), "optimizer": run.optimizer.sharded_state_dict()}
        savers = dcp_savers(state)
        savers["sync"], savers["async"] = savers["dcp_sync"], savers["dcp_async"]
    else:
        state, savers = found[0], {**found[1], **dcp_savers(found[0])}
    savers["torch_save"] = lambda path: torch_save(state, path)
    root = Path(tempfile.mkdtemp(prefix="mimotron-ckpt-bench-"))
    counter = {"n": 0}

    def timed_save(save: Saver) -> float:
        counter["n"] += 1
        path = root / f"save_{counter['n']}"
        start = time.perf_counter()
        wait = save(path)
        elapsed = time.perf_counter() - start
        if wait is not None:  # async: completion is not blocking time, but must finish
            wait()
        shutil.rmtree(path, ignore_errors=True)
        return elapsed

    # mimotron's saves print a line each: keep the benchmark's output to its table.
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            for save in savers.values():  # warm-up: first-call paths
                timed_save(save)
            times = interleave(
                reps, {name: (lambda s=s: timed_save(s)) for name, s in savers.items()}
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    api = "mimotron.checkpoint.save_checkpoint" if found else "torch.distributed.checkpoint"
    return {
        "times": times,
        "bytes": tensor_bytes(state),
        "api": api,
        "num_params": sum(p.numel() for p in run.model.parameters()),
    }


def run_case(opts: Options) -> CaseResult:
    """``ckpt_save_ratio`` and ``async_block_ratio`` (target <= 0.2)."""
    size = "tiny" if opts.tiny else ("quick" if opts.quick else "default")
    hidden, layers = SIZES[size]
    overrides = [f"modules.language.hidden_size={hidden}", f"modules.language.num_layers={layers}"]
    res = run_ranks(1, _rank, overrides, opts.reps, timeout_s=600)[0]
    t = res["times"]
    stats = {name: summarize(v) for name, v in t.items()}
    mb = res["bytes"] / 1e6
    sync, torch_s, asyn = stats["sync"], stats["torch_save"], stats["async"]
    save_fig = ratio_figure(
        "ckpt_save_ratio",
        t["torch_save"],
        t["sync"],
        "",
        f"{mb:.0f} MB: save {fmt_stats(sync)} ({mb / sync['median']:.0f} MB/s) vs torch.save "
        f"{fmt_stats(torch_s)} ({mb / torch_s['median']:.0f} MB/s)",
    )
    async_fig = ratio_figure(
        "async_block_ratio",
        t["async"],
        t["sync"],
        "<= 0.2",
        f"async save blocks {fmt_stats(asyn)} of a {fmt_stats(sync)} sync save",
    )
    out = CaseResult("checkpoint", [save_fig, async_fig])
    out.measurements = {
        "api": res["api"],
        "state_bytes": res["bytes"],
        "num_params": res["num_params"],
        "seconds": stats,
        "MBps": {n: mb / s["median"] for n, s in stats.items()},
        "dcp_async_block_ratio": stats["dcp_async"]["median"] / stats["dcp_sync"]["median"],
        "dcp_reused_stager_block_ratio": (
            stats["dcp_async_reused_stager"]["median"] / stats["dcp_sync"]["median"]
        ),
        "language_model": {"hidden_size": hidden, "num_layers": layers},
    }
    return out
