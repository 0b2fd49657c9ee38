"""Run a function on N gloo ranks in forked processes (the multi-rank test harness).

Ranks are forked (not spawned: spawn costs seconds per test) after
``torch.set_num_threads(1)``, because forking a process that already ran multi-threaded
OpenMP work can hang the children. Rendezvous is a ``FileStore`` in a fresh temp dir, so
no ports are used. Each rank's return value comes back to the parent; an exception on
any rank is re-raised in the parent naming the rank and carrying its traceback; a rank
still running after ``timeout_s`` is killed and reported. The package ships this (rather
than ``tests/``) so benchmarks and users' own tests can use it too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """A rank raised, or did not finish in time; the message names the rank."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    conn: Any,
    pg_timeout_s: float,
    args: tuple,
    kwargs: dict,
) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
    )
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(payload)
    finally:
        conn.close()
        # Skip destroy_process_group: a peer may be dead, and teardown could block.
        os._exit(0)


def warm_up_imports() -> None:
    """Import and cache, once in the parent, what every forked rank would load itself.

    scikit-learn and the digits array (the demo data), torch's lazily imported optimizer
    machinery (``torch._dynamo``, pulled in by the first ``AdamW``), and DTensor.
    """
    import torch.distributed.tensor  # noqa: F401

    from mimotron.data.digits import load_digit_images

    load_digit_images()
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.AdamW([p]).step()


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked gloo ranks.

    The default process group is initialised in every rank before ``fn`` runs.

    Args:
        world_size: number of ranks.
        fn: picklable-result function; its return value per rank is collected.
        timeout_s: hard wall-clock limit for the whole group.
        pg_timeout_s: process-group timeout inside the ranks.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        RankError: a rank raised (its traceback is in the message) or timed out.
    """
    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="mimotron-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, store_path, child, pg_timeout_s, args, kwargs),
                daemon=True,
            )
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        return _collect(procs, conns, timeout_s)


def _collect(procs: list, conns: list, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = set(range(len(procs)))
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            if conns[rank].poll(0.01):
                try:
                    status, data = conns[rank].recv()
                except EOFError:
                    status, data = "error", "rank exited without a result"
                pending.discard(rank)
                if status == "ok":
                    results[rank] = pickle.loads(data)
                else:
                    errors[rank] = data
            elif not procs[rank].is_alive() and not conns[rank].poll(0):
                pending.discard(rank)
                errors[rank] = f"rank died with exit code {procs[rank].exitcode}"
        if errors:
            break  # One failure: the others would wait on it until their PG timeout.
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    if errors:
        rank = min(errors)
        raise RankError(f"rank {rank} failed: {errors[rank]}")
    if pending:
        raise RankError(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s")
    return [results[r] for r in range(len(procs))]
