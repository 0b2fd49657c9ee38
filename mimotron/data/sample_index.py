"""The checked-sample index of a LLaVA data set: built once per run, cached, shared.

Checking every sample (:mod:`~mimotron.data.llava_check`) opens every media file and
tokenises every conversation; this module makes that happen **once** and keeps what it
found in an index folder every rank reads instead:

* ``rows.npy``: one row per kept sample (:data:`~mimotron.data.llava_source.ROW_DTYPE`:
  its byte address, token count and media flags), memory-mapped by the ranks, so a rank
  holds a few bytes per sample, never the data file;
* ``keys.npy``: the keys of tar-shard samples (memory-mapped);
* ``samples.jsonl``: a JSON list's items, one per line (the list converted once);
* ``index.json`` (written last): the key, the skipped samples with their reasons, counts.

**Key.** The folder ``<index_dir>/<key>`` is named by a hash of what the check's result
depends on (:func:`index_key`): the data file's (or every shard's) real path, size,
modification and change time (so an edit that puts the size and modification time back
is seen: :mod:`~mimotron.data.llava_source`), the tokenizer folder's files and chat
template, ``seq_length``, the placeholder counts, the system prompt, the root and
``allow_outside_root``, the audio rate. A second run over the same data reuses it;
changing any of these checks again. The media files are not part of the key: a media
file fixed after a run that skipped it stays skipped until the data file changes (touch
it) or the index folder is removed.

**Once per run** (:func:`obtain_index`). ``mimotron train`` checks in the launcher before
any rank starts; the ranks then find the index. Under another launcher (``torchrun``),
rank 0 checks while the others wait on the process group's store (not a collective): rank
0 publishes "done" or its one-line error, which the others raise too, so no rank hangs on
a failed check; a rank 0 that stops making progress for ``timeout_s`` is an error. A
rank that cannot see the folder rank 0 wrote (not a shared filesystem) checks by itself.
An index is written into a temporary folder and renamed into place, so a reader never
sees half of one. A folder of the key that does not read back whole (a file cut short or
deleted) is replaced: moved aside by one rename, the new one renamed in by another, the
old one removed; a reader between the two renames finds no index and checks itself.

**Parallel check.** With ``num_processes > 1`` the chunks (line ranges, shards) are
checked by forked processes (each inherits the tokenizer and checker, nothing is
pickled but the results); the result does not depend on the number of processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mimotron.data.llava_check import BadSample

INDEX_FORMAT = 3
"""Version of the folder's layout and of the checks; another version checks again."""
_META = "index.json"
_STORE_PREFIX = "mimotron/data_index/"
_POLL_S = 0.2

Progress = Callable[[], None]


def index_key(identity: dict[str, Any]) -> str:
    """The hex SHA-256 of ``identity`` (JSON with sorted keys) and the index format."""
    text = json.dumps({"format": INDEX_FORMAT, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class SampleIndex:
    """A data set's checked samples (module docstring), as every rank reads it.

    Attributes:
        folder: the index folder.
        rows: kept samples in data order (memory-mapped when read from the folder).
        keys: tar-shard sample keys by row, or ``None``.
        bad: the samples left out, in data order.
        num_total: samples in the data (kept + bad).
        meta: the rest of ``index.json`` (identity, timings).
    """

    folder: Path
    rows: np.ndarray
    keys: np.ndarray | None
    bad: list[BadSample]
    num_total: int
    meta: dict[str, Any] = field(default_factory=dict)

    def key_of(self, row: int) -> str | None:
        """Tar-shard sample key of ``row`` (``None`` for a JSON/JSONL file)."""
        return None if self.keys is None else bytes(self.keys[row]).decode("utf-8")

    @classmethod
    def read(cls, folder: Path, key: str) -> SampleIndex | None:
        """The index in ``folder`` if it is complete and has key ``key``; else ``None``."""
        try:
            meta = json.loads((folder / _META).read_text())
            if meta.get("key") != key:
                return None
            rows = np.load(folder / "rows.npy", mmap_mode="r")
            keys = np.load(folder / "keys.npy", mmap_mode="r") if meta["has_keys"] else None
            if len(rows) != meta["num_kept"] or (keys is not None and len(keys) != len(rows)):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        bad = [BadSample(*entry) for entry in meta.pop("bad")]
        return cls(folder, rows, keys, bad, int(meta["num_total"]), meta)

    def write(self, key: str) -> None:
        """Write the index into :attr:`folder` (``index.json`` last)."""
        np.save(self.folder / "rows.npy", np.ascontiguousarray(self.rows))
        if self.keys is not None:
            np.save(self.folder / "keys.npy", self.keys)
        meta = {**self.meta, "key": key, "format": INDEX_FORMAT, "num_total": self.num_total,
                "num_kept": len(self.rows), "has_keys": self.keys is not None,
                "bad": [[b.location, b.sample_id, b.reason] for b in self.bad]}  # fmt: skip
        (self.folder / _META).write_text(json.dumps(meta, indent=1) + "\n")


@dataclass
class ChunkResult:
    """What checking one chunk found: kept rows (with keys), bad samples, samples seen."""

    rows: np.ndarray
    keys: list[str]
    bad: list[BadSample]
    num_seen: int


def merge_chunks(folder: Path, results: Sequence[ChunkResult], has_keys: bool,
                 meta: dict[str, Any]) -> SampleIndex:  # fmt: skip
    """The index of the chunks' results, in chunk order."""
    rows = np.concatenate([r.rows for r in results]) if results else np.zeros(0)
    keys = None
    if has_keys:
        names = [k.encode("utf-8") for r in results for k in r.keys]
        keys = np.array(names, dtype=f"S{max((len(n) for n in names), default=1)}")
    return SampleIndex(folder, rows, keys, [b for r in results for b in r.bad],
                       sum(r.num_seen for r in results), meta)  # fmt: skip


# ---- once per run -----------------------------------------------------------------------
def obtain_index(index_dir: Path, key: str, build: Callable[[Path, Progress | None], SampleIndex],
                 validate: Callable[[SampleIndex], None], timeout_s: float,
                 share: bool = True) -> SampleIndex:
    """The index of ``key`` under ``index_dir``: read, or built once and shared.

    Args:
        index_dir: the folder holding index folders (``data.index_dir``).
        key: :func:`index_key` of the data set.
        build: builds the index into the folder it is given, calling ``progress`` now
            and then (without checking what ``validate`` checks).
        validate: raises the run's ``ValueError`` for an index it cannot train on (a bad
            sample without ``skip_bad_samples``, no usable sample); such an index is not
            kept, so a fixed media file is seen by the next run.
        timeout_s: how long a waiting rank accepts no progress from rank 0.
        share: coordinate with the other ranks (``False``: a private folder, this
            process checks alone).

    Raises:
        ValueError: what ``validate`` or ``build`` raise (on every rank: rank 0's line),
            or an index folder that cannot be written.
        RuntimeError: rank 0 failed otherwise, or made no progress for ``timeout_s``.
    """
    final = index_dir / key[:24]
    peers = _Peers.find(key) if share else None
    index = SampleIndex.read(final, key)
    if peers is not None and not peers.is_first:
        if index is None:
            peers.wait(timeout_s)
            index = SampleIndex.read(final, key)
        if index is None:  # rank 0 wrote where this rank cannot see (another node's disk)
            print(f"mimotron: {final} written by rank 0 is not visible here: this rank "
                  "checks the data itself (put data.index_dir on a shared filesystem)",
                  file=sys.stderr, flush=True)  # fmt: skip
            index = _build_and_keep(index_dir, final, key, build, validate, None)
        validate(index)
        return index
    try:
        if index is None:
            index = _build_and_keep(index_dir, final, key, build, validate,
                                    peers.progress if peers else None)  # fmt: skip
        validate(index)
    except BaseException as exc:
        if peers is not None:
            peers.publish(exc)
        raise
    if peers is not None:
        peers.publish(None)
    return index


def _build_and_keep(index_dir: Path, final: Path, key: str,
                    build: Callable[[Path, Progress | None], SampleIndex],
                    validate: Callable[[SampleIndex], None],
                    progress: Progress | None) -> SampleIndex:  # fmt: skip
    """Build into a temporary folder; rename it into place once valid; read it back.

    Folders it creates are removed again when nothing is kept: a refused check leaves no
    trace (no log.dir for a run that never started).
    """
    created = [p for p in (index_dir, *index_dir.parents) if not p.exists()]
    try:
        index_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=index_dir))
    except OSError as exc:
        raise ValueError(f"data.index_dir={str(index_dir)!r} cannot be written: {exc} (set "
                         "data.index_dir to a writable folder)") from None  # fmt: skip
    try:
        begin = time.perf_counter()
        index = build(work, progress)
        index.meta["check_seconds"] = round(time.perf_counter() - begin, 3)
        validate(index)  # Not kept when refused: the next run checks again.
        index.write(key)
        _put_in_place(work, final, key)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        for folder in created:  # innermost first; only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    shutil.rmtree(work, ignore_errors=True)  # gone when renamed; left when another won
    read = SampleIndex.read(final, key)
    assert read is not None, f"the index just written to {final} does not read back"
    return read


def _put_in_place(work: Path, final: Path, key: str) -> None:
    """Rename the index folder ``work`` to ``final``, replacing a damaged one there.

    Raises:
        OSError: ``final`` cannot be replaced (and holds no readable index).
    """
    try:
        os.rename(work, final)
        return
    except OSError:
        if SampleIndex.read(final, key) is not None:  # another process's identical index
            return
    # A damaged folder (a file cut short or deleted): a rename cannot replace a folder
    # that is not empty, so it is moved aside (onto an empty folder, which a rename may
    # replace), then ours is renamed in; each step is atomic.
    aside = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    try:
        with contextlib.suppress(FileNotFoundError):  # another process moved it already
            os.rename(final, aside)
        try:
            os.rename(work, final)
        except OSError:  # another process put its index in place in between
            if SampleIndex.read(final, key) is None:
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


@dataclass
class _Peers:
    """The other ranks of this launch, reached through the process group's store."""

    store: Any
    is_first: bool
    key: str

    @classmethod
    def find(cls, key: str) -> _Peers | None:
        """The store of an initialised multi-rank process group (not the dry run's fake)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        if "fake" in str(dist.get_backend()):  # one process pretends to be every rank
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank() == 0, _STORE_PREFIX + key)

    def progress(self) -> None:
        self.store.add(f"{self.key}/progress", 1)

    def publish(self, error: BaseException | None) -> None:
        """Tell the waiting ranks: done, or rank 0's error (best effort)."""
        if error is None:
            status = "ok"
        elif isinstance(error, ValueError):
            status = f"value:{error}"
        else:
            status = f"other:rank 0 failed while checking the data: " \
                     f"{type(error).__name__}: {error}"
        with contextlib.suppress(Exception):  # a broken store: the waiters time out
            self.store.set(f"{self.key}/status", status)

    def wait(self, timeout_s: float) -> None:
        """Until rank 0 publishes; its error raised here, or a stall after ``timeout_s``."""
        status_key, last, since = f"{self.key}/status", -1, time.monotonic()
        while not self.store.check([status_key]):
            seen = int(self.store.add(f"{self.key}/progress", 0))
            if seen != last:
                last, since = seen, time.monotonic()
            elif time.monotonic() - since > timeout_s:
                raise RuntimeError(f"rank 0 made no progress checking the data for "
                                   f"{timeout_s:g} s (train.pg_timeout_s): see its output")
            time.sleep(_POLL_S)
        status = self.store.get(status_key).decode()
        kind, _, message = status.partition(":")
        if kind == "value":
            raise ValueError(message)
        if kind == "other":
            raise RuntimeError(message)


# ---- parallel check ---------------------------------------------------------------------
def map_chunks(fn: Callable[[Any], ChunkResult], chunks: Sequence[Any], num_processes: int,
               progress: Progress | None = None) -> list[ChunkResult]:
    """``[fn(c) for c in chunks]``, on up to ``num_processes`` forked processes.

    Raises:
        ValueError: the first chunk's (in chunk order) ``ValueError``.
        RuntimeError: a process died, or raised something else.
    """
    # A daemonic process (a test harness's rank) may not have children: check in it.
    if num_processes <= 1 or len(chunks) < 2 or "fork" not in mp.get_all_start_methods() \
            or mp.current_process().daemon:
        out = []
        for chunk in chunks:
            out.append(fn(chunk))
            if progress is not None:
                progress()
        return out
    ctx = mp.get_context("fork")
    counter = ctx.Value("l", 0)
    results: Any = ctx.Queue()
    # Forked: the processes inherit fn (tokenizer, checker, source); no pickling.
    procs = [ctx.Process(target=_worker, args=(fn, chunks, counter, results, os.getpid()),
                         daemon=True) for _ in range(min(num_processes, len(chunks)))]
    got: dict[int, tuple[bool, Any]] = {}
    try:
        for proc in procs:
            proc.start()
        while len(got) < len(chunks):
            try:
                index, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs)
                continue
            got[index] = (ok, value)
            if progress is not None:
                progress()
    finally:
        for proc in procs:
            if proc.pid is None:  # never started
                continue
            if proc.is_alive():
                proc.terminate()
            proc.join()
    for ok, value in (got[i] for i in range(len(chunks))):
        if not ok:
            kind, message = value
            raise ValueError(message) if kind == "value" else RuntimeError(message)
    return [got[i][1] for i in range(len(chunks))]


def _check_alive(procs: list[Any]) -> None:
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"a data check process died (exit code {dead[0].exitcode}): "
                           "out of memory?")
    if all(p.exitcode == 0 for p in procs):
        raise RuntimeError("the data check processes ended without every result")


def _worker(fn: Callable[[Any], ChunkResult], chunks: Sequence[Any], counter: Any,
            results: Any, parent: int) -> None:  # fmt: skip
    """Check chunks until none is left (or the parent is gone)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process
    # A terminal's Ctrl-C reaches the whole process group: the parent stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == parent:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        if index >= len(chunks):
            return
        try:
            results.put((index, True, fn(chunks[index])))
        except ValueError as exc:
            results.put((index, False, ("value", str(exc))))
        except Exception as exc:  # noqa: BLE001 - reported by the parent, named
            results.put((index, False, ("other", f"{type(exc).__name__}: {exc}")))


def default_processes() -> int:
    """Cores this process may run on (the check's default number of processes)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
