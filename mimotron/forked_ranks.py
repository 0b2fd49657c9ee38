"""Run a function on N gloo ranks in forked processes (the multi-rank test harness).

Ranks are forked (not spawned: spawn costs seconds per test) after
``torch.set_num_threads(1)``, because forking a process that already ran multi-threaded
OpenMP work can hang the children. Rendezvous is a ``FileStore`` in a fresh temp dir, so
no ports are used. Each rank's return value comes back to the parent. When ranks fail,
the parent raises one :class:`RankError` naming the root cause, not whichever report
arrived first: each failing rank records its failure in a shared directory before
anything can close its connections, and the parent records ranks that die without a
report when it sees them die (:mod:`mimotron.failures`). The earliest own error or death
is the root cause (its traceback is in the message); ranks that failed because a peer
vanished are listed as collateral. A rank still running after ``timeout_s`` is killed
and reported. When communication is recorded (``MIMOTRON_NCCL_CHECK=1``) a hang is
named instead: on a gloo timeout, peers lost with no rank's own error, or the deadline,
the ranks' traces so far (a failed rank writes its own, a stuck one on request) show
who waits for whom in which operation (:mod:`mimotron.commcheck.diverge`). The package
ships this (rather than ``tests/``) so benchmarks and users'
own tests can use it too.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mimotron.commcheck import (
    CHECK_ENV,
    TRACE_ENV,
    CommRecorder,
    finish_recording,
    replay_folder,
    start_recording,
)
from mimotron.commcheck.diverge import FAILED, RUNNING, explain_hang_folder
from mimotron.failures import (
    FAILURE_DIR_ENV,
    FailureRecord,
    consequence_note,
    death_summary,
    first_per_rank,
    read_failures,
    record_exception,
    record_failure,
    root_cause,
)
from mimotron.runtime import forget_dtensor_plans

# Set to 1 (the test suite does): every run records its ranks' communication and the
# parent replays it under NCCL's rules (:mod:`mimotron.commcheck`) after they succeed.
NCCL_CHECK_ENV = CHECK_ENV
# gloo's words for an operation that waited ``pg_timeout_s`` (the rank's own or its pair's).
_TIMEOUT_MARKERS = ("Timed out", "timed out", "timeout caused pair closure")
# How long stuck ranks get to write their traces when a hang is being explained.
_DUMP_WAIT_S = 10.0


class RankError(RuntimeError):
    """A rank raised, or did not finish in time; the message names the rank."""


class NcclDeadlockError(AssertionError):
    """The ranks finished on gloo, but their communication would hang under NCCL."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    tmp: str,
    conn: Any,
    pg_timeout_s: float,
    dump_request: Any,
    args: tuple,
    kwargs: dict,
) -> None:
    torch.set_num_threads(1)
    recorder = None
    failure_dir = os.path.join(tmp, "failures")
    if os.environ.get(NCCL_CHECK_ENV) == "1":
        os.environ[TRACE_ENV] = os.path.join(tmp, "trace")
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
        **{FAILURE_DIR_ENV: failure_dir},
    )
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        forget_dtensor_plans()  # the parent's, inherited through fork
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        # gloo's full mesh can be complete on one rank while a peer still finishes its
        # handshake: without this barrier a rank whose function returns at once may exit
        # and close a connection its peer is still opening ("Connection closed by peer"
        # inside init_process_group). Not recorded: it is the harness's, not the test's.
        dist.barrier()
        recorder = start_recording(rank)
        if recorder is not None:
            _dump_when_asked(recorder, dump_request)
        result = fn(rank, world_size, *args, **kwargs)
        finish_recording(recorder)
        payload = ("ok", pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        # Record first: until this process exits its connections are open, so no peer
        # can have failed "because of" this rank before the record exists.
        record_exception(failure_dir, rank, exc)
        if recorder is not None:  # how far it got, should its peers hang
            with contextlib.suppress(Exception):
                recorder.dump(os.environ[TRACE_ENV], FAILED)
        payload = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    try:
        conn.send(payload)
    finally:
        conn.close()
        # Skip destroy_process_group: a peer may be dead, and teardown could block.
        os._exit(0)


def _dump_when_asked(recorder: CommRecorder, request: Any) -> None:
    """Write the trace so far when the parent asks (it explains a hang), from a thread:
    the main thread may be blocked in a collective that never returns. ``request`` is
    this rank's end of a pipe: a message asks, its closing (the parent is done) does not.
    """
    def dump() -> None:
        with contextlib.suppress(EOFError, OSError):
            request.recv_bytes()
            recorder.dump(os.environ[TRACE_ENV], RUNNING)

    threading.Thread(target=dump, name="trace-on-request", daemon=True).start()


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
        RankError: a rank failed or timed out. The message names the root cause (the
            first rank to raise an error of its own, or a rank that died without a
            report; its traceback follows) and lists the ranks that failed or were
            stopped as a consequence.
    """
    return run_groups([(world_size, fn, args, kwargs)], timeout_s=timeout_s,
                      pg_timeout_s=pg_timeout_s)[0]


def _start_frozen(process: mp.process.BaseProcess) -> None:
    """Fork ``process`` with this process's objects frozen out of its garbage collector.

    What the parent holds may include cyclic garbage from a process group it already
    destroyed (a fake-backend dry run, an in-process measurement); collected in a forked
    child, whose copy lacks the parent's threads, its destructors can crash the rank (a
    segfault while garbage-collecting). Frozen objects are never collected in the child.
    """
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()


def run_groups(
    groups: list[tuple[int, Callable[..., Any], tuple, dict]],
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
) -> list[list[Any]]:
    """Several independent :func:`run_ranks` calls at once, each with its own group.

    The groups share nothing (each has its own store and failure directory), so their
    results are what one call each would give; running them together only uses the
    cores that single-rank runs leave idle.

    Args:
        groups: ``(world_size, fn, args, kwargs)`` per group.
        timeout_s: hard wall-clock limit for all groups together.
        pg_timeout_s: process-group timeout inside the ranks.

    Returns:
        Per group, the per-rank return values.

    Raises:
        RankError: as :func:`run_ranks`, for the first group (in order) that failed.
    """
    torch.set_num_threads(1)
    ctx = mp.get_context("fork")
    deadline = time.monotonic() + timeout_s
    with contextlib.ExitStack() as stack:
        started = []
        try:
            for world_size, fn, args, kwargs in groups:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mimotron-store-"))
                os.mkdir(os.path.join(tmp, "failures"))
                procs, conns, requests = [], [], []
                started.append((procs, conns, os.path.join(tmp, "failures"), requests))
                for rank in range(world_size):
                    parent, child = ctx.Pipe(duplex=False)
                    asked, ask = ctx.Pipe(duplex=False)  # "write your trace" (a hang)
                    p = ctx.Process(
                        target=_rank_main,
                        args=(fn, rank, world_size, tmp, child, pg_timeout_s, asked,
                              args, kwargs),
                        daemon=True,
                    )
                    _start_frozen(p)
                    child.close()
                    asked.close()
                    procs.append(p)
                    conns.append(parent)
                    requests.append(stack.enter_context(ask))
            results = [_collect(procs, conns, max(deadline - time.monotonic(), 0.0), failures,
                                requests)
                       for procs, conns, failures, requests in started]
            for _, _, failures, _ in started:
                _check_nccl_rules(os.path.join(os.path.dirname(failures), "trace"))
            return results
        finally:
            for procs, _, _, _ in started:  # A group left behind by another's failure.
                for p in procs:
                    if p.is_alive():
                        p.kill()
                    p.join(timeout=5)


def _check_nccl_rules(trace_dir: str) -> None:
    """Replay a successful run's traces under NCCL's rules (when recorded)."""
    if not os.path.isdir(trace_dir):
        return
    report = replay_folder(trace_dir)
    if not report.ok:
        kept = shutil.copytree(trace_dir, tempfile.mkdtemp(prefix="mimotron-nccl-trace-"),
                               dirs_exist_ok=True)
        raise NcclDeadlockError(f"{report.text}\n(traces kept in {kept}; "
                                f"python -m mimotron.commcheck {kept} replays them)")


def _poll(proc: Any, conn: Any) -> tuple[str, Any] | None:
    """``("ok", result)``, ``("error", text)``, ``("died", exit code)`` or None (running)."""
    if conn.poll(0.01):
        try:
            status, data = conn.recv()
        except EOFError:
            proc.join(timeout=5)  # The pipe closed: the process is on its way out.
            return "died", proc.exitcode
        return (status, pickle.loads(data)) if status == "ok" else (status, data)
    if not proc.is_alive() and not conn.poll(0):
        return "died", proc.exitcode
    return None


def _collect(procs: list, conns: list, timeout_s: float, failure_dir: str,
             requests: list | None = None) -> list[Any]:
    """Gather results; on failure, wait until the root cause is known, then raise it.

    A hang (ranks still running at the deadline, or failed ranks that only timed out
    or lost a peer, one of them by a timeout) is explained from the ranks' traces when
    they are recorded (:func:`_explain_hang`): the error then names the ranks and the
    operation where their communication diverges.
    """
    deadline = time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = set(range(len(procs)))
    hang: str | None = None
    explained = False
    root = None
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            polled = _poll(procs[rank], conns[rank])
            if polled is None:
                continue
            pending.discard(rank)
            status, data = polled
            if status == "ok":
                results[rank] = data
            elif status == "died":
                errors[rank] = death_summary(data)
                record_failure(failure_dir, rank, "died", errors[rank])
            else:
                errors[rank] = data
        # Collateral failures alone do not settle it: the rank they lost is either dead
        # (seen on a later pass) or recorded its own error before its connections closed.
        # A root cause still pending recorded its failure and is sending its traceback.
        root = root_cause(_failures(failure_dir, errors, results)) if errors else None
        if root is not None and root.kind != "peer" and root.rank in errors:
            break
        if root is not None and not explained and any(
                m in e for e in errors.values() for m in _TIMEOUT_MARKERS):
            explained, hang = True, _explain_hang(procs, pending, requests, failure_dir)
            if hang is not None:
                break
    if not explained and ((pending and time.monotonic() >= deadline) or (
            errors and not pending and root is not None and root.kind == "peer")):
        # Still running at the deadline, or only lost peers (one may have finished
        # while another waited on it): whoever waits for whom is the cause.
        hang = _explain_hang(procs, pending, requests, failure_dir)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    if hang is not None:
        first = (f"\nfirst failure: rank {root.rank}: {errors[root.rank].splitlines()[0]}"
                 if root is not None and root.rank in errors else "")
        raise RankError(hang + first)
    if errors:
        raise _rank_error(_failures(failure_dir, errors, results), errors, sorted(pending),
                          timeout_s if time.monotonic() >= deadline else None)
    if pending:
        raise RankError(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f} s")
    return [results[r] for r in range(len(procs))]


def _explain_hang(procs: list, pending: set[int], requests: list | None, failure_dir: str
                  ) -> str | None:
    """Why the ranks hang, from their traces (``None`` when not recorded or not shown).

    Ranks that failed wrote their trace; the ones still running write theirs on request
    (a thread: their main thread is blocked). :mod:`mimotron.commcheck.diverge` compares
    them: who waits for whom, in which operation.
    """
    if requests is None or os.environ.get(NCCL_CHECK_ENV) != "1":
        return None
    trace_dir = os.path.join(os.path.dirname(failure_dir), "trace")
    for r in pending:
        with contextlib.suppress(OSError):  # a rank that exited meanwhile
            requests[r].send_bytes(b"1")
    until = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < until and any(
            procs[r].is_alive() and not os.path.exists(os.path.join(trace_dir, f"rank{r}.json"))
            for r in pending):
        time.sleep(0.05)  # polling files the ranks write; no ordering depends on it
    if not os.path.isdir(trace_dir):
        return None
    text = explain_hang_folder(trace_dir, len(procs))
    if text is None:
        return None
    kept = shutil.copytree(trace_dir, tempfile.mkdtemp(prefix="mimotron-hang-trace-"),
                           dirs_exist_ok=True)
    return (f"ranks hang: their communication diverges\n{text}\n(traces kept in {kept}; "
            f"python -m mimotron.commcheck.diverge {kept} explains them again)")


def _failures(failure_dir: str, errors: dict[int, str],
              results: dict[int, Any]) -> list[FailureRecord]:
    """Failures, one per rank: the records (a rank's report may still be on its way), then
    failed ranks that recorded nothing. Ranks that returned a result are left out (code
    under test, e.g. the CLI, may record an error it then handles)."""
    records = first_per_rank([r for r in read_failures(failure_dir) if r.rank not in results])
    recorded = {r.rank for r in records}
    after = max((r.seq for r in records), default=-1) + 1
    return records + [FailureRecord(after + i, rank, "error", errors[rank].splitlines()[0])
                      for i, rank in enumerate(sorted(set(errors) - recorded))]


def _rank_error(records: list[FailureRecord], errors: dict[int, str], pending: list[int],
                timed_out_s: float | None) -> RankError:
    root = root_cause(records)
    assert root is not None
    if root.kind == "peer" and pending and timed_out_s is not None:
        # Only collateral failures, and ranks that never finished: they are the cause.
        note = consequence_note(records, None)
        return RankError(f"ranks {pending} did not finish within {timed_out_s:.0f} s{note}")
    note = consequence_note(records, root,
                            stopped=[r for r in pending if r not in {x.rank for x in records}])
    text = errors.get(root.rank, root.summary)
    first, _, rest = text.partition("\n")
    return RankError(f"rank {root.rank} failed: {first}{note}\n{rest}".rstrip("\n"))
