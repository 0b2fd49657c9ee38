"""Files mimotron writes in a run folder: the run lock between two holders, links planted
under the names it writes, a lock file that is a folder, a TensorBoard folder that fails
mid-run, and a full disk naming the file it could not write.

Contention uses two real holders (a forked process and this one), each through
``RunLock``, ordered by a pipe. Full disks are real where a descriptor can be pointed at
``/dev/full`` (the kernel answers ENOSPC), injected as ``OSError(ENOSPC)`` at the one
system call otherwise.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mimotron.checkpoint.files import LATEST, retire, write_latest, write_manifest
from mimotron.cli.main import main
from mimotron.run_dir import RunRefused
from mimotron.run_files import RunFileError, replacing
from mimotron.run_lock import LOCK_FILE, RunLock
from mimotron.training.metrics import MetricsWriter
from mimotron.training.metrics_file import METRICS_FILE, rewrite_records
from mimotron.training.wandb_sink import RUN_ID_FILE, run_id
from tests.launching import run_args

VICTIM_TEXT = "someone else's file\n"
RECORD = {"iteration": 1, "loss": 0.5}


# ---- the run lock between two holders -----------------------------------------------------


def _hold(log_dir: Path, conn: Any) -> None:
    """A second process: take the run lock, say so, keep it until told, then let go."""
    lock = RunLock(log_dir)
    lock.acquire()
    conn.send("held")
    conn.recv()  # Until the test has tried to take it.
    lock.release()
    conn.send("released")


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    """Two holders through mimotron's own lock: while a forked process holds it, this
    process is refused with one line naming the holder's pid and host; once it lets go,
    the lock can be taken."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    holder = ctx.Process(target=_hold, args=(tmp_path, theirs))
    holder.start()
    try:
        assert ours.poll(60) and ours.recv() == "held"
        with pytest.raises(RunRefused) as refused:
            RunLock(tmp_path).acquire()
    finally:
        ours.send("done")  # Also when the test failed: the holder lets go and ends.
        holder.join(60)
        if holder.is_alive():
            holder.kill()
    assert ours.poll(0) and ours.recv() == "released"
    message = str(refused.value)
    assert "\n" not in message
    assert f"pid {holder.pid} on host {socket.gethostname()}" in message, message
    assert f"lock file {tmp_path / LOCK_FILE}" in message, message
    assert holder.exitcode == 0
    with RunLock(tmp_path):  # Released: taken at once, and the file is ours now.
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


# ---- links planted under the names mimotron writes ---------------------------------------


def _take_lock(log_dir: Path) -> None:
    RunLock(log_dir).acquire()


def _metrics_fresh(log_dir: Path) -> None:
    MetricsWriter(log_dir, 2, progress=False).write(RECORD)


def _metrics_resumed(log_dir: Path) -> None:
    MetricsWriter(log_dir, 2, progress=False, append=True, resumed_at=1).write(RECORD)


def _wandb_fresh(log_dir: Path) -> None:
    run_id(log_dir, resume=False)


def _wandb_resumed(log_dir: Path) -> None:
    run_id(log_dir, resume=True)


WRITERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "lock": (LOCK_FILE, _take_lock),
    "metrics-fresh": (METRICS_FILE, _metrics_fresh),
    "metrics-resumed": (METRICS_FILE, _metrics_resumed),
    "wandb-fresh": (RUN_ID_FILE, _wandb_fresh),
    "wandb-resumed": (RUN_ID_FILE, _wandb_resumed),
}


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_link_under_a_written_name_is_refused(tmp_path, writer, dangling):
    """A link planted in the run folder under a name mimotron writes: the file it points
    to is left as it was (or not created), and the error is one line naming the file
    and saying it is a symlink."""
    name, write = WRITERS[writer]
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    elsewhere.mkdir()
    victim = elsewhere / "victim"
    if not dangling:
        victim.write_text(VICTIM_TEXT)
    (run / name).symlink_to(victim)
    with pytest.raises(ValueError) as refused:  # RunRefused for the lock, else UnsafeRunFile
        write(run)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{run / name} is a symlink (to {victim})" in message, message
    if dangling:
        assert not victim.exists()
    else:
        assert victim.read_text() == VICTIM_TEXT
    assert (run / name).is_symlink()  # Refused, not removed: the user decides.


def test_train_refuses_a_link_at_the_lock_in_one_line(tmp_path, capsys):
    """Through ``mimotron train``: one line, before any rank starts; nothing written."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    assert main(["train", *run_args(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{run / LOCK_FILE} is a symlink" in err and "invalid config" not in err, err
    assert victim.read_text() == VICTIM_TEXT
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]


def test_atomic_writes_replace_a_link_instead_of_following_it(tmp_path):
    """``latest``, the manifest and a rewritten ``metrics.jsonl`` are written to a fresh
    temporary file and renamed over their name: a link there is replaced, its target
    untouched."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    root = tmp_path / "ckpt"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "iter_0000003" / ".metadata").write_bytes(b"dcp")
    for link in (root / LATEST, root / "iter_0000003" / "manifest.json",
                 tmp_path / METRICS_FILE):
        link.symlink_to(victim)
    write_latest(root, 3)
    write_manifest(root / "iter_0000003", 3, {"world_size": 1}, {})
    rewrite_records(tmp_path / METRICS_FILE, [RECORD])
    assert victim.read_text() == VICTIM_TEXT
    assert not (root / LATEST).is_symlink() and (root / LATEST).read_text() == "3\n"
    assert json.loads((root / "iter_0000003" / "manifest.json").read_text())["iteration"] == 3
    assert (tmp_path / METRICS_FILE).read_text() == json.dumps(RECORD) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", METRICS_FILE, "victim"]


def test_a_linked_checkpoint_folder_is_unlinked_not_deleted_through(tmp_path):
    """Re-saving an iteration whose ``iter_*`` name is a link removes the link only."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("{}")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "iter_0000002").symlink_to(elsewhere)
    retire(root, 2)
    assert not (root / "iter_0000002").exists() and not (root / "iter_0000002").is_symlink()
    assert (elsewhere / "manifest.json").read_text() == "{}"


# ---- a lock file that is a folder ---------------------------------------------------------


def test_a_lock_file_that_is_a_folder_says_so(tmp_path, capsys):
    """It was reported as "log.dir is not writable"; it is a folder in the lock's place."""
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(RunRefused) as refused:
        RunLock(tmp_path).acquire()
    assert f"{tmp_path / LOCK_FILE} is a directory, not a plain file" in str(refused.value)
    assert "not writable" not in str(refused.value)
    assert main(["train", *run_args(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory" in err, err


# ---- TensorBoard failing mid-run ----------------------------------------------------------


def _events(folder: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [s.step for s in acc.Scalars("loss")]


def test_tensorboard_failing_mid_run_is_one_line_and_training_goes_on(tmp_path, capfd):
    """Its writes fail (the event file's descriptor now on a full disk): one line naming
    the folder, no thread traceback, and the records go on into ``metrics.jsonl``."""
    writer = MetricsWriter(tmp_path, 3, tensorboard=True, progress=False)
    writer.write({"iteration": 1, "loss": 1.0})
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, writer._tb._file.fileno())  # The kernel answers ENOSPC from now on.
    finally:
        os.close(full)
    writer.write({"iteration": 2, "loss": 0.5})
    writer.write({"iteration": 3, "loss": 0.25})
    writer.close()
    err = capfd.readouterr().err.strip()
    assert err == (f"metrics: TensorBoard cannot write into {tmp_path / 'tensorboard'} "
                   "(No space left on device); training goes on without TensorBoard "
                   "(metrics.jsonl keeps every record)"), err
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(x)["iteration"] for x in lines] == [1, 2, 3]
    assert _events(tmp_path / "tensorboard") == [1]


# ---- a full disk names the file ---------------------------------------------------------


def _enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_under_metrics_names_the_file(tmp_path):
    """``metrics.jsonl``'s descriptor on a full disk: the error names the file; closing
    after it does not raise a second, nameless one."""
    writer = MetricsWriter(tmp_path, 2, progress=False)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, writer._file.fileno())
    finally:
        os.close(full)
    with pytest.raises(RunFileError) as failed:
        writer.write(RECORD)
    writer.close()
    assert failed.value.errno == errno.ENOSPC
    assert str(failed.value) == (f"[Errno 28] cannot write {tmp_path / METRICS_FILE}: "
                                 "No space left on device")


def _profile_trace(path: Path) -> None:
    with replacing(path):
        _enospc()  # The writer that fills the temporary file (a profiler, numpy) fails.


FULL_DISK: dict[str, tuple[str | None, str, Callable[[Path], None]]] = {
    # case: (system call that fails, or None where the write fails itself; file named;
    # the write)
    "lock": ("pwrite", LOCK_FILE, _take_lock),
    "metrics-rewrite": ("fsync", METRICS_FILE,
                        lambda d: rewrite_records(d / METRICS_FILE, [RECORD])),
    "latest": ("fsync", LATEST, lambda d: write_latest(d, 4)),
    "wandb-run-id": ("write", RUN_ID_FILE, _wandb_fresh),
    "profile-trace": (None, "rank0_iter3-4.json",
                      lambda d: _profile_trace(d / "rank0_iter3-4.json")),
}


@pytest.mark.parametrize("case", sorted(FULL_DISK))
def test_a_full_disk_names_the_file_it_could_not_write(tmp_path, monkeypatch, case):
    """ENOSPC at the system call that writes: one line naming the file, no temporary
    file left behind."""
    call, name, write = FULL_DISK[case]
    if call is not None:
        monkeypatch.setattr(os, call, _enospc)
    with pytest.raises(Exception) as failed:  # noqa: PT011 - the type is checked below
        write(tmp_path)
    monkeypatch.undo()
    message = str(failed.value)
    assert "\n" not in message
    assert f"cannot write {tmp_path / name}: No space left on device" in message, message
    assert isinstance(failed.value, RunFileError) or case == "lock"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
