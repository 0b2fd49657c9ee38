"""Record every communication call of one rank, for replay under NCCL's rules.

A :class:`CommRecorder` wraps the ``torch.distributed`` entry points this project and
the torch code it calls (DCP, DTensor set-up) use — point-to-point ops, batched
point-to-point groups and collectives — and logs, per host thread, each call in issue
order together with every ``wait()`` on its work handle. The log is what
:mod:`mimotron.commcheck.replay` needs: which process group (by name, with its global
ranks), which peer, which batch, how many bytes, and where the host blocked.

Recording is a switch (``MIMOTRON_COMM_TRACE=<folder>``, read by the multi-rank test
harness and the launcher): when it is off nothing is wrapped and nothing costs. gloo
behaves as before under the recorder — it only observes.

FSDP2's all-gathers and reduce-scatters are seen (torch calls
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` for them). Not seen by
the recorder: DTensor's functional collectives (``_c10d_functional`` ops, used by
tensor-parallel layers). They run on TP groups whose members execute the same
graph in the same order, and they are waited where their result is used.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TRACE_ENV = "MIMOTRON_COMM_TRACE"
# Set to 1 (the test suite does): every run of the test harness (``run_ranks``) and of
# the launcher (``mimotron train``) records its ranks' communication and replays it
# under NCCL's rules once they succeed.
CHECK_ENV = "MIMOTRON_NCCL_CHECK"

# Single point-to-point ops (send/recv block the host; isend/irecv return a work).
_P2P = {"isend": ("send", False), "irecv": ("recv", False),
        "send": ("send", True), "recv": ("recv", True)}
# Collectives by their torch.distributed name; the object ones are synchronous.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "broadcast", "all_to_all",
                "all_to_all_single", "barrier", "gather", "scatter", "reduce",
                "all_gather_object", "broadcast_object_list", "gather_object",
                "scatter_object_list", "monitored_barrier")


def group_name(group: Any) -> str:
    """A process group's name, equal on every member.

    ``new_group`` numbers groups by call order, the same on every rank. A group made by
    ``split_group`` (:mod:`mimotron.parallel.group_factory` under NCCL) has a name
    hashed from the number of groups the calling rank holds, which differs between
    members; it is named here by its ranks and its place among this rank's groups of
    the same ranks (members make those in the same order).
    """
    pg = group if group is not None else c10d._get_default_group()
    name = str(getattr(pg, "group_name", id(pg)))
    if name.isdigit() or pg not in c10d._world.pg_group_ranks:
        return name
    ranks = sorted(c10d._world.pg_group_ranks[pg])
    same = [g for g, members in c10d._world.pg_group_ranks.items() if sorted(members) == ranks]
    return f"ranks {ranks} #{same.index(pg)}"


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


class _RecordedWork:
    """A work handle that logs its ``wait()``; everything else is the real handle's."""

    def __init__(self, work: Any, op_ids: list[int], recorder: CommRecorder) -> None:
        self._work, self._op_ids, self._recorder = work, op_ids, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._recorder.log_wait(self._op_ids)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommRecorder:
    """Wraps ``torch.distributed``'s communication calls while installed (see module doc).

    Args:
        rank: this process's global rank (written into the trace).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.groups: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._next_id = 0
        self._originals: dict[str, Callable] = {}
        # Ops issued and not yet waited, per (group, thread): another thread issuing on a
        # group while one is in flight there is an error (NCCL orders a group's ops by
        # issue; two threads make that order a race). Handing a group over is fine.
        self._in_flight: dict[tuple[str, str], set[int]] = {}
        self._group_of: dict[int, str] = {}

    # ---- logging -------------------------------------------------------------------------
    def _log(self, event: dict[str, Any]) -> int:
        thread = threading.current_thread().name
        with self._lock:
            op_id = self._next_id
            self._next_id += 1
            event.update(id=op_id, thread=thread)
            self.events.append(event)
            group = event["group"]
            others = [t for (g, t), ids in self._in_flight.items()
                      if g == group and t != thread and ids]
            if others:
                self.events.append({"op": "error", "thread": thread, "text": (
                    f"rank {self.rank} thread {thread} issues {event.get('name', 'p2p')} "
                    f"on group {group} while thread {others[0]} has ops in flight there")})
            self._in_flight.setdefault((group, thread), set()).add(op_id)
            self._group_of[op_id] = group
            return op_id

    def _group(self, group: Any) -> str:
        name = group_name(group)
        if name not in self.groups:
            pg = group if group is not None else c10d._get_default_group()
            self.groups[name] = list(dist.get_process_group_ranks(pg))
        return name

    def log_wait(self, op_ids: list[int]) -> None:
        thread = threading.current_thread().name
        with self._lock:
            self.events.append({"op": "wait", "ids": list(op_ids), "thread": thread})
            for i in op_ids:
                for ids in self._in_flight.values():
                    ids.discard(i)

    # ---- wrappers ------------------------------------------------------------------------
    def _p2p(self, name: str, fn: Callable) -> Callable:
        kind, blocking = _P2P[name]
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            b = sig.bind(*args, **kwargs).arguments
            peer = b.get("dst" if kind == "send" else "src")
            op_id = self._log({"op": "p2p", "kind": kind, "peer": peer, "batch": None,
                               "group": self._group(b.get("group")),
                               "nbytes": _nbytes(b.get("tensor"))})
            work = fn(*args, **kwargs)
            if blocking:
                self.log_wait([op_id])
                return work
            return _RecordedWork(work, [op_id], self) if work is not None else work
        return wrapper

    def _batch(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(p2p_op_list: list) -> Any:
            with self._lock:
                batch = self._next_id
            ids = []
            for op in p2p_op_list:
                kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
                ids.append(self._log({"op": "p2p", "kind": kind, "peer": op.peer,
                                      "batch": batch, "group": self._group(op.group),
                                      "nbytes": _nbytes(op.tensor)}))
            works = fn(p2p_op_list)
            return [_RecordedWork(w, ids, self) for w in works]
        return wrapper

    def _collective(self, name: str, fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            b = sig.bind(*args, **kwargs).arguments
            op_id = self._log({"op": "coll", "name": name, "group": self._group(b.get("group"))})
            work = fn(*args, **kwargs)
            if not b.get("async_op", False) or work is None:
                self.log_wait([op_id])
                return work
            return _RecordedWork(work, [op_id], self)
        return wrapper

    # ---- install / remove ----------------------------------------------------------------
    def install(self) -> None:
        """Wrap the calls on the ``torch.distributed`` module (not ``distributed_c10d``:
        torch's own code calling its siblings there is not logged twice, and
        ``P2POp`` keeps validating the real ``isend``/``irecv``)."""
        assert not self._originals, "recorder installed twice"
        for name in _P2P:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._p2p(name, self._originals[name]))
        self._originals["batch_isend_irecv"] = dist.batch_isend_irecv
        dist.batch_isend_irecv = self._batch(dist.batch_isend_irecv)
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._collective(name, self._originals[name]))

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def dump(self, folder: str | os.PathLike, state: str = "finished") -> Path:
        """Write this rank's trace as ``rank<r>.json`` under ``folder``.

        Args:
            folder: where the run's traces go.
            state: ``"finished"``, or how far a rank got when a hang is being explained
                (``"failed"``, ``"running"``: :mod:`mimotron.commcheck.diverge`).
        """
        path = Path(folder) / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            text = json.dumps({"rank": self.rank, "state": state, "groups": self.groups,
                               "events": self.events})
        # Written whole, then renamed: the parent may read it while a stuck rank writes.
        partial = path.with_suffix(".tmp")
        partial.write_text(text)
        os.replace(partial, path)
        return path


def start_recording(rank: int) -> CommRecorder | None:
    """Install a recorder when ``MIMOTRON_COMM_TRACE`` is set; ``None`` (no cost) if not."""
    if not os.environ.get(TRACE_ENV):
        return None
    recorder = CommRecorder(rank)
    recorder.install()
    return recorder


def finish_recording(recorder: CommRecorder | None) -> None:
    """Remove the recorder and write its trace into the ``MIMOTRON_COMM_TRACE`` folder."""
    if recorder is None:
        return
    recorder.uninstall()
    recorder.dump(os.environ[TRACE_ENV])
