"""Which rank failed first: root-cause attribution for multi-rank failures.

When one rank fails, its peers blocked on it in a collective fail too ("Connection
closed by peer", a timeout, a checkpoint error wrapping either). Whoever *reports* first
is a matter of scheduling, so the harness (:func:`mimotron.forked_ranks.run_ranks`) and the
CLI launcher (``mimotron train``) do not trust arrival order. Instead every failing rank,
first thing in its ``except`` block and before anything that could close its
connections, appends a :class:`FailureRecord` to a shared directory (the one named by
``MIMOTRON_FAILURE_DIR``). Appending claims the next sequence number atomically (a hard
link that fails if the name exists), so the records form one total order across
processes. A rank that dies without reporting (a signal, ``os._exit``) is recorded by
the parent that notices the death.

Each record is classified: ``"error"`` (the rank's own failure), ``"peer"`` (a
consequence of a peer vanishing: :func:`is_peer_loss`), ``"died"`` (no report) or
``"stalled"`` (the launcher found the process stopped, e.g. by SIGSTOP, while its peers
waited on it). The root cause (:func:`root_cause`) is the earliest record of any kind but
``"peer"``; only when there is none is it the earliest ``"peer"`` record. The other
failed ranks are named as collateral (:func:`consequence_note`).

A death is recorded only when the parent *sees* it (the CLI launcher polls every 50 ms, the
harness likewise), so it can land after the error of a peer that lost the dead rank. A
stall lands after its peers' errors as a rule: they time out after ``pg_timeout_s`` of
waiting, which began up to a step before the rank was stopped, and the launcher records
the stall only when that failure shows. Either is harmless when the peer's error is
recognised as a peer loss. When it is not (a message outside :data:`PEER_LOSS_MARKERS`),
:func:`root_cause` still prefers the death or stall if it was recorded within
:data:`DEATH_WINDOW_S` of the error and the error's text names a connection, socket,
peer, store or timeout (:func:`mentions_connection`). What remains open: an unrecognised
error whose text names none of these, recorded before a peer's death or stall was seen,
is blamed instead of that peer.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURE_DIR_ENV = "MIMOTRON_FAILURE_DIR"
KINDS = ("error", "peer", "died", "stalled", "aborted")
# Text of the errors a rank gets when a peer it waits on is gone (gloo, c10d stores).
# gloo reports a timeout as "Timed out waiting ..." in the operation that timed out and
# as "Application timeout caused pair closure" in every other operation on its pairs.
PEER_LOSS_MARKERS = (
    "Connection closed by peer", "Connection reset by peer", "Connection refused",
    "Broken pipe", "Timed out", "timed out", "Socket Timeout", "failed on another rank",
    "timeout caused pair closure",
)


# Words in an error's text that point at a lost connection rather than the rank itself
# (a stopped peer shows as a timeout).
_CONNECTION_RE = re.compile(
    r"\b(connection|connect|connected|disconnected|socket|peer|store|tcpstore|gloo|nccl|"
    r"broken pipe|eof|timeout)\b", re.IGNORECASE)
DEATH_WINDOW_S = 5.0
"""A death or stall recorded this long after a connection-like error is taken as its cause."""


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failure, in the order the ranks failed.

    Attributes:
        seq: position in the total order of failures (0 = first).
        rank: the global rank that failed.
        kind: ``"error"`` (its own), ``"peer"`` (a peer vanished), ``"died"`` (no report)
            or ``"stalled"`` (stopped while its peers waited).
        summary: one line: the exception, or how the process ended.
        exit_code: the exit code the rank meant to return, when it knew one.
        at: wall-clock time (``time.time()``) the record was written, if known.
    """

    seq: int
    rank: int
    kind: str
    summary: str
    exit_code: int | None = None
    at: float | None = None


def mentions_connection(text: str) -> bool:
    """Whether an error's text names a connection, socket, peer, store or timeout problem."""
    return _CONNECTION_RE.search(text) is not None


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) says a peer vanished, not this rank.

    Args:
        exc: the exception a rank caught.

    Returns:
        True for c10d's distributed errors and for gloo/store messages about closed or
        reset connections and timeouts, anywhere in the ``__cause__``/``__context__``
        chain.
    """
    import torch.distributed as dist

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if any(marker in str(current) for marker in PEER_LOSS_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``, for records and one-line reports."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def record_failure(directory: str | os.PathLike | None, rank: int, kind: str, summary: str,
                   exit_code: int | None = None) -> FailureRecord | None:
    """Append a failure to ``directory``, claiming the next sequence number atomically.

    Best effort: a failure to record (no directory, a full disk) must not hide the
    rank's own error, so it returns None instead of raising.

    Args:
        directory: the shared failure directory; None = do not record.
        rank: the failing global rank.
        kind: one of :data:`KINDS`.
        summary: one line describing the failure.
        exit_code: the exit code the rank will return, if known.

    Returns:
        The record written, or None when nothing was recorded.
    """
    assert kind in KINDS, kind
    if directory is None:
        return None
    root = Path(directory)
    tmp = root / f".tmp-{rank}-{os.getpid()}"
    try:
        seq = 0
        while True:
            record = FailureRecord(seq, rank, kind, summary, exit_code, time.time())
            tmp.write_text(json.dumps(asdict(record)))
            try:
                os.link(tmp, root / f"{seq:06d}.json")  # Fails if the name is taken.
                return record
            except FileExistsError:
                seq += 1
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def record_exception(directory: str | os.PathLike | None, rank: int, exc: BaseException,
                     exit_code: int | None = None) -> FailureRecord | None:
    """Record ``exc`` as this rank's failure, classified by :func:`is_peer_loss`.

    Args:
        directory: the shared failure directory; None = do not record.
        rank: this global rank.
        exc: the exception caught.
        exit_code: the exit code the rank will return, if known.

    Returns:
        The record written, or None.
    """
    kind = "peer" if is_peer_loss(exc) else "error"
    return record_failure(directory, rank, kind, one_line(exc), exit_code)


def read_failures(directory: str | os.PathLike) -> list[FailureRecord]:
    """The records in ``directory``, in failure order (unreadable entries are skipped)."""
    records = []
    for path in sorted(Path(directory).glob("[0-9]*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            records.append(FailureRecord(**json.loads(path.read_text())))
    return sorted(records, key=lambda r: r.seq)


def death_summary(exit_code: int | None) -> str:
    """How a process that reported nothing ended, from its exit code.

    SIGKILL comes with a hint: nobody else sends it unasked, and the kernel's
    out-of-memory killer does not tell the process.
    """
    if exit_code is not None and exit_code < 0:
        with contextlib.suppress(ValueError):
            name = signal.Signals(-exit_code).name
            hint = "; out of memory? check `dmesg`" if name == "SIGKILL" else ""
            return f"killed by signal {name}{hint}"
        return f"killed by signal {-exit_code}"
    return f"exited with code {exit_code} without reporting an error"


def root_cause(records: list[FailureRecord]) -> FailureRecord | None:
    """The earliest own error, death or stall; the earliest peer loss only if there is none.

    One exception, for deaths and stalls seen late (see the module docstring): when the
    earliest is an ``"error"`` whose text mentions a connection (:func:`mentions_connection`)
    and a ``"died"`` or ``"stalled"`` record follows within :data:`DEATH_WINDOW_S`, that
    record is the root cause.

    Args:
        records: failures, at most one per rank, in any order.

    Returns:
        The root-cause record, or None when ``records`` is empty.
    """
    ordered = sorted(records, key=lambda r: r.seq)
    primary = [r for r in ordered if r.kind != "peer"]
    first = (primary or ordered or [None])[0]
    if first is None or first.kind != "error" or not mentions_connection(first.summary):
        return first
    for later in primary:
        if later.kind in ("died", "stalled") and first.at is not None and later.at is not None \
                and later.at - first.at <= DEATH_WINDOW_S:
            return later
    return first


def first_per_rank(records: list[FailureRecord]) -> list[FailureRecord]:
    """Keep each rank's first record (a rank may record twice, e.g. CLI inside the harness)."""
    seen: dict[int, FailureRecord] = {}
    for record in sorted(records, key=lambda r: r.seq):
        seen.setdefault(record.rank, record)
    return sorted(seen.values(), key=lambda r: r.seq)


def _ranks(ranks: list[int]) -> str:
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(str(r) for r in sorted(ranks))}"


def consequence_note(records: list[FailureRecord], root: FailureRecord | None,
                     stopped: list[int] | None = None) -> str:
    """`` (ranks 0, 2 failed as a consequence: peer lost)``-style note on the other ranks.

    Which collateral ranks reported before being stopped depends on scheduling, so
    callers should treat "failed as a consequence" and "stopped as a consequence" alike.

    Args:
        records: all failures (one per rank).
        root: the root cause (excluded from the note).
        stopped: ranks still running that were stopped after the failure.

    Returns:
        The note with a leading space, or ``""`` when there is nothing to add.
    """
    others = [r for r in records if root is None or r.rank != root.rank]
    parts = []
    peers = [r.rank for r in others if r.kind == "peer"]
    if peers:
        parts.append(f"{_ranks(peers)} failed as a consequence: peer lost")
    later = [r.rank for r in others if r.kind != "peer"]
    if later:
        parts.append(f"{_ranks(later)} also failed, later")
    if stopped:
        parts.append(f"{_ranks(stopped)} stopped as a consequence")
    return f" ({'; '.join(parts)})" if parts else ""
