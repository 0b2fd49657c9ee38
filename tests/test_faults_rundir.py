"""Run-directory faults: two launches of one run, a finished run relaunched, run
directories in system folders, and failure folders left in the temp folder.

One real two-rank launch (``finished_run``) is shared: it starts over a stale run lock
and stale failure folders, and is then relaunched finished. The other cases stop before
any rank starts, or launch trivial ranks (``python -c pass``) through the real launcher.
Subprocess timeouts are hang guards, never speed checks.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mimotron.cli.main import main
from mimotron.config import load_config
from tests.common import DIGITS
from tests.launching import COLOCATED, ROOT, TINY, launch_env, run_args

GUARD_S = 240  # Hang guard for one launch on a loaded machine.
LOCK = "mimotron.lock"  # <log.dir>/mimotron.lock, the documented lock file.
FAILURES = "mimotron-failures-"


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its contents (what a refused launch must not touch)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _failure_folders(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.glob(f"{FAILURES}*"))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> dict:
    """A two-rank run to iteration 2 (saved), launched over a lock file left by a dead
    pid, with TMPDIR holding a failure folder of a dead launcher and one of a live one."""
    root = tmp_path_factory.mktemp("finished")
    log_dir, tmp = root / "run", root / "tmp"
    log_dir.mkdir()
    tmp.mkdir()
    dead = _dead_pid()
    stale = {"pid": dead, "host": socket.gethostname(), "since": "earlier"}
    (log_dir / LOCK).write_text(json.dumps(stale))
    (tmp / f"{FAILURES}{dead}-abc").mkdir()  # Its launcher was killed with kill -9.
    (tmp / f"{FAILURES}{os.getpid()}-abc").mkdir()  # A live launcher's: left alone.
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", *run_args(log_dir)],
                          cwd=ROOT, env=launch_env(TMPDIR=str(tmp)), capture_output=True,
                          text=True, timeout=GUARD_S)
    return {"log_dir": log_dir, "tmp": tmp, "dead": dead, "code": proc.returncode,
            "out": proc.stdout + proc.stderr, "folders": _failure_folders(tmp)}


def test_a_stale_run_lock_is_taken_over_with_a_note(finished_run):
    """Item 1: a lock file whose holder died (its pid no longer runs on this host) does
    not block the next launch: it is taken over with a note, and removed at the end."""
    out, dead = finished_run["out"], finished_run["dead"]
    assert finished_run["code"] == 0, out[-4000:]
    assert f"took over the stale run lock {finished_run['log_dir'] / LOCK}" in out, out[-4000:]
    assert f"pid {dead} no longer runs" in out, out[-4000:]
    assert not (finished_run["log_dir"] / LOCK).exists()


def test_no_failure_folder_is_left_and_orphaned_ones_are_removed(finished_run):
    """Item 4: a launch leaves no failure folder of its own, and removes those of a
    launcher that is gone (killed with ``kill -9``, it could not); a live one stays."""
    assert finished_run["code"] == 0, finished_run["out"][-4000:]
    assert finished_run["folders"] == [f"{FAILURES}{os.getpid()}-abc"]


def test_a_launch_is_refused_while_another_holds_the_run_lock(tmp_path, capsys):
    """Item 1: two launches of one run trained side by side, both saving into the same
    folders. While a process holds the run lock (here: this test process), a launch
    is refused with one line naming the holder's pid and host, before any rank starts."""
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}
    with open(tmp_path / LOCK, "w") as lock:
        lock.write(json.dumps(holder))
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code = main(["train", *run_args(tmp_path)])
        err = capsys.readouterr().err.strip()
    assert code != 0, err[-4000:]
    assert len(err.splitlines()) == 1, err
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in err, err
    assert "in use by another run" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]  # No rank wrote anything.


def test_a_finished_run_launched_again_has_nothing_to_train(finished_run, capsys):
    """Item 2: rerunning a finished run "resumed" at iterations 3..2, printed ``final
    loss nan``, appended a duplicate eval record and exited 0. It must say so, exit
    non-zero and leave metrics and checkpoints as they were."""
    log_dir = finished_run["log_dir"]
    assert finished_run["code"] == 0, finished_run["out"][-4000:]
    before = _snapshot(log_dir)
    assert "checkpoints/latest" in before
    code = main(["train", *run_args(log_dir)])
    err = capsys.readouterr().err.strip()
    assert code != 0, err[-4000:]
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mimotron train: nothing to train: iteration 2 already reached"), err
    assert _snapshot(log_dir) == before
    assert main(["plan", *run_args(log_dir)]) == 0  # plan says what train would do
    assert "train would refuse: nothing to train" in capsys.readouterr().out


@pytest.mark.parametrize("override,field", [
    ("log.dir=/", "log.dir='/'"), ("log.dir=/etc/", "log.dir='/etc/'"),
    ("log.dir=/usr", "log.dir='/usr'"), ("log.dir=/lib64", "log.dir='/lib64'"),
    ("log.dir=/var", "log.dir='/var'"), (f"log.dir={Path.home()}", "log.dir="),
    ("checkpoint.dir=/", "checkpoint.dir='/'"),
    ("name=../../../tmp/x", "name='../../../tmp/x'"), ("name=..", "name='..'"),
    ("name=.", "name='.'"), ("name=a/b", "name='a/b'"),
])
def test_run_directories_outside_a_run_folder_are_invalid(override, field):
    """Item 3: ``log.dir = /`` wrote ``/metrics.jsonl``; ``name = "../../../tmp/x"``
    escaped ``runs/``. Config validation refuses both, naming the field and value."""
    with pytest.raises(ValueError, match="is invalid: expected") as err:
        load_config(DIGITS, [override])
    assert str(err.value).startswith(field), err.value


def test_a_system_log_dir_is_one_line_before_anything_runs(capsys):
    """Item 3, through the command: one line, exit 2, nothing planned or launched."""
    assert main(["plan", str(DIGITS), "log.dir=/"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        captured.err.strip()], captured.err
    assert captured.err.startswith("mimotron plan: invalid config: log.dir='/' is invalid")
    assert "placement" not in captured.out


# ``mimotron train`` with trivial ranks, and a SIGTERM to the launcher itself just
# before it runs the ranks or just after they ended (where it had no handler).
_SIGNAL_WINDOW = """
import os, signal, sys
import mimotron.cli.launch as launch
import mimotron.cli.train as train
where, run, report = sys.argv[1], launch.Launcher.run, train._report
def patched_run(self):
    self.argv = [sys.executable, "-c", "pass"]
    if where == "before":
        os.kill(os.getpid(), signal.SIGTERM)
    return run(self)
def patched_report(*args, **kwargs):
    if where == "after":
        os.kill(os.getpid(), signal.SIGTERM)
    return report(*args, **kwargs)
launch.Launcher.run, train._report = patched_run, patched_report
sys.exit(train.run_train(sys.argv[2], sys.argv[3:]))
"""


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_signal_around_the_ranks_leaves_no_failure_folder(tmp_path, where):
    """Item 4: the launcher took SIGTERM only while the ranks ran; one that came after
    it created its failure folder but before the ranks started, or after they ended,
    killed it with the folder left in the temp folder. It is handled (passed on, or
    noted) for the folder's whole life."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNAL_WINDOW, where, COLOCATED, *TINY, "train.iters=2",
         f"log.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=launch_env(TMPDIR=str(tmp)), capture_output=True, text=True,
        timeout=GUARD_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "SIGTERM" in out and "Traceback" not in out, out[-4000:]
    assert _failure_folders(tmp) == []
    assert not (tmp_path / "run" / LOCK).exists()


def test_the_writability_check_never_makes_a_checkpoint_folder_appear(tmp_path, monkeypatch):
    """Every rank lists ``checkpoint.dir`` while rank 0 checks that it can be written.
    The check created the missing folder and removed it again, so a rank that saw it
    exist could fail listing it ("FileNotFoundError", seen under a start-up signal).
    Now a missing folder is checked through its nearest existing parent: it never
    appears, and an unwritable one is still one line naming the key."""
    from mimotron.run_dir import check_writable

    ckpt = tmp_path / "a" / "ckpt"
    cfg = load_config(DIGITS, [f"log.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}"])
    made: list[Path] = []
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args, **kwargs) -> None:
        made.append(Path(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    check_writable(cfg)
    assert ckpt not in made and ckpt.parent not in made, made
    assert not ckpt.parent.exists() and (tmp_path / "run").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cfg = load_config(DIGITS, [f"log.dir={tmp_path / 'run'}",
                               f"checkpoint.dir={blocker / 'ckpt'}"])
    with pytest.raises(ValueError, match=r"^checkpoint.dir=.*file exists and is not a dir"):
        check_writable(cfg)
