"""Process faults of issue 13: job-wide signals, a dead launcher, blame, one-line errors.

Each test starts the real ``mimotron train`` launcher in its own session (so the test can
signal its whole process group, as a terminal or a scheduler does) and injects one fault
from outside: a signal to every process of the job (Slurm's ``scancel``), SIGINT through
a forwarding wrapper (``timeout``), ``kill -9`` of the launcher, SIGKILL or SIGSTOP of
one rank. The tests wait for files and processes by polling with hang guards; the
subprocess timeouts are hang guards too, never speed checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mimotron.checkpoint import read_latest
from mimotron.checkpoint.files import write_manifest
from mimotron.cli.launch import Launcher
from mimotron.cli.lines import LineWriter
from mimotron.cli.train import _failure_verdict
from mimotron.failures import DEATH_WINDOW_S, FailureRecord, read_failures, root_cause
from tests.common import DIGITS
from tests.launching import COLOCATED, ROOT, TINY, launch_env

GUARD_S = 240  # Hang guard for one launch on a loaded machine.


def _start(args: list[str], wrapper: list[str] = (), **env: str) -> subprocess.Popen:
    """``mimotron train`` (behind ``wrapper``) in a new session: its pid is the group id."""
    return subprocess.Popen(
        [*wrapper, sys.executable, "-m", "mimotron", "train", *args], cwd=ROOT,
        env=launch_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float = GUARD_S) -> str:
    try:
        return proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def _iterations(log_dir: Path) -> list[int]:
    path = log_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["iteration"] for r in lines if "loss" in r]


def _wait_for_iterations(log_dir: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + GUARD_S
    while len(_iterations(log_dir)) < count:
        assert proc.poll() is None, _finish(proc)
        assert time.monotonic() < deadline, "no training progress"
        time.sleep(0.02)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's children lists)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _rank_pids(pid: int, world_size: int) -> dict[int, int]:
    """Global rank -> pid of the ranks below ``pid`` (read from their environment)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        ranks = {}
        for child in _descendants(pid):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0])] = child
        if len(ranks) == world_size:
            return ranks
        assert time.monotonic() < deadline, f"ranks not found: {ranks}"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # A zombie no longer runs (nobody may reap it here).


def _signal_job(pid: int, signum: int) -> None:
    """What ``scancel`` does: signal the process group and every process of the job."""
    everyone = _descendants(pid)
    os.killpg(pid, signum)
    for child in everyone:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)


def _verdict(out: str) -> str:
    found = re.search(r"mimotron train: rank \d failed \(.*", out)
    assert found is not None, out[-4000:]
    return found[0]


def _stop_args(tmp_path: Path, ckpt: Path) -> list[str]:
    return [COLOCATED, *TINY, "train.iters=400", "checkpoint.load=auto",
            f"checkpoint.dir={ckpt}", f"log.dir={tmp_path}"]


def test_job_wide_sigterm_saves_and_reports_the_saved_iteration(tmp_path):
    """Item 1: SIGTERM to every process of the job (scancel) saves, says which iteration,
    exits 0, and a resume continues from exactly that iteration."""
    ckpt = tmp_path / "ckpt"
    proc = _start(_stop_args(tmp_path, ckpt))
    _wait_for_iterations(tmp_path, 2, proc)
    _signal_job(proc.pid, signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 0, out[-4000:]
    found = re.search(r"mimotron train: stopped by SIGTERM; saved iteration (\d+)", out)
    assert found is not None, out[-4000:]
    saved = int(found[1])
    assert read_latest(ckpt) == saved >= 2
    assert _iterations(tmp_path) == list(range(1, saved + 1))
    resumed = subprocess.run(
        [sys.executable, "-m", "mimotron", "train", *_stop_args(tmp_path, ckpt),
         f"train.iters={saved + 2}"],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=GUARD_S)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert _iterations(tmp_path) == list(range(1, saved + 3))


def test_sigint_through_a_forwarding_wrapper_saves(tmp_path):
    """Item 1: SIGINT to a process group holding a wrapper that forwards it (``timeout``
    signals its child and then its group again), so every rank gets two or three copies
    within milliseconds: the ranks still save the last iteration they trained, exit 0.
    (Checked on the files first: a rank that took a copy as "abort" saves nothing.)"""
    ckpt = tmp_path / "ckpt"
    proc = _start(_stop_args(tmp_path, ckpt), wrapper=["timeout", "-s", "INT", "900"])
    _wait_for_iterations(tmp_path, 2, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out = _finish(proc)
    trained = _iterations(tmp_path)
    assert read_latest(ckpt) == trained[-1] >= 2, out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    found = re.search(r"mimotron train: stopped by SIGINT; saved iteration (\d+)", out)
    assert found is not None, out[-4000:]
    assert int(found[1]) == trained[-1]


def test_a_stop_that_cannot_save_says_not_saved_and_fails(tmp_path):
    """Item 1: when the stop's save is impossible (the checkpoint folder became a file),
    the launcher says "not saved" and exits non-zero, never "saved"."""
    ckpt = tmp_path / "ckpt"
    proc = _start(_stop_args(tmp_path, ckpt))
    _wait_for_iterations(tmp_path, 2, proc)
    ckpt.write_text("not a folder")
    _signal_job(proc.pid, signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode != 0, out[-4000:]
    assert "mimotron train: stopped by SIGTERM: not saved" in out, out[-4000:]
    assert "saved iteration" not in out


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_blames_no_rank(tmp_path, signum):
    """Item 1: a job-wide signal while the ranks are still starting (importing torch,
    reading the config) reached them before their handlers existed: SIGTERM killed them
    ("rank 0 failed (killed by signal SIGTERM)"), SIGINT printed a KeyboardInterrupt
    traceback per rank. Now they hold it until their handlers are in place and stop
    before the first step; no rank is blamed and nothing is printed but the stop."""
    proc = _start(_stop_args(tmp_path, tmp_path / "ckpt"))
    _rank_pids(proc.pid, 2)  # The ranks exist: exec'd, with RANK in their environment.
    name = signal.Signals(signum).name
    _signal_job(proc.pid, signum)
    out = _finish(proc)
    assert proc.returncode == 1, out[-4000:]
    assert f"mimotron train: stopped by {name} before training began: nothing to save" \
        in out, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    assert re.search(r"rank \d failed", out) is None, out[-4000:]
    assert _iterations(tmp_path) == []


def test_killing_the_launcher_ends_every_rank(tmp_path):
    """Item 4: ``kill -9`` of the launcher must not leave its ranks training as orphans."""
    proc = _start([COLOCATED, *TINY, "train.iters=100000", f"log.dir={tmp_path}"])
    _wait_for_iterations(tmp_path, 2, proc)
    ranks = _rank_pids(proc.pid, 2)
    proc.kill()
    proc.wait()
    # The test keeps reading end of the output pipe open, as a terminal would stay: an
    # orphan must not get away with dying of a broken pipe.
    deadline = time.monotonic() + 60
    try:
        while any(_alive(pid) for pid in ranks.values()):
            assert time.monotonic() < deadline, f"orphaned ranks still running: {ranks}"
            time.sleep(0.05)
    finally:
        for pid in ranks.values():  # Never leave orphans behind, even when failing.
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


def test_a_rank_killed_from_outside_is_blamed(tmp_path):
    """Item 7 (a regression test): SIGKILL of rank 1 of 2 from outside (the OOM killer)
    names rank 1, with a hint instead of a claim that its error was printed. Its peer's
    error is a recognised peer loss here, so the blame does not depend on whether the
    launcher saw the death before it reported; the late-death case with an
    unrecognised error is the unit test in test_failures.py."""
    proc = _start([COLOCATED, *TINY, "train.iters=100000", "train.pg_timeout_s=60",
                   f"log.dir={tmp_path}"])
    _wait_for_iterations(tmp_path, 2, proc)
    os.kill(_rank_pids(proc.pid, 2)[1], signal.SIGKILL)
    out = _finish(proc)
    assert proc.returncode == 1, out[-4000:]
    verdict = _verdict(out)
    assert verdict.startswith("mimotron train: rank 1 failed (killed by signal SIGKILL; "
                              "out of memory? check `dmesg`)"), verdict
    assert "printed above" not in out
    note = verdict.partition("`dmesg`)")[2]  # The blocked peer is named as collateral:
    # "failed" or "stopped as a consequence", whether or not it reported a peer loss
    # before being stopped (scheduling).
    assert "consequence" in note and re.findall(r"\d", note) == ["0"], verdict


def test_a_stopped_rank_is_named_as_stalled_after_the_timeout(tmp_path):
    """Item 7: a rank stopped with SIGSTOP is named as stalled (not a peer that timed out
    waiting on it), and the job ends instead of hanging; the verdict says how long it
    was stopped: about ``train.pg_timeout_s``, when the launcher or its peers gave up.
    Which of them gives up first is a race; the next test makes the peers win it."""
    timeout_s = 6
    proc = _start([COLOCATED, *TINY, "train.iters=100000", f"train.pg_timeout_s={timeout_s}",
                   f"log.dir={tmp_path}"])
    _wait_for_iterations(tmp_path, 2, proc)
    stopped = _rank_pids(proc.pid, 2)[1]
    os.kill(stopped, signal.SIGSTOP)
    try:
        out = _finish(proc, timeout_s=180)  # A hang guard only.
    finally:
        if _alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    assert proc.returncode == 1, out[-4000:]
    verdict = _verdict(out)
    found = re.match(r"mimotron train: rank 1 failed \(stalled: its process was stopped "
                     r"\(SIGSTOP\?\) for (\d+) s", verdict)
    assert found is not None, verdict
    # Whole seconds, rounded; peers blocked on rank 2 a little before it was stopped may
    # time out that much early.
    assert int(found[1]) >= timeout_s - 1, verdict


# A rank of a 4-rank job for the launcher, without training: rank 2 stops itself
# (SIGSTOP) mid-step; rank 1, its peer, waits until rank 2 is stopped, then records the
# error a gloo timeout on rank 2 gives it (argv[2]) and exits 3, as a rank does; ranks 0
# and 3 wait on rank 2 until the launcher ends them.
_STOPPED_PEER_RANK = """
import os, signal, sys, time
from pathlib import Path
from mimotron.failures import FAILURE_DIR_ENV, record_exception
rank, shared, deadline = int(os.environ["RANK"]), Path(sys.argv[1]), time.monotonic() + 120
if rank == 2:
    (shared / "pid.tmp").write_text(str(os.getpid()))
    (shared / "pid.tmp").rename(shared / "stopped.pid")
    os.kill(os.getpid(), signal.SIGSTOP)
elif rank == 1:
    def stopped():
        try:
            pid = (shared / "stopped.pid").read_text()
            return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "T"
        except (OSError, IndexError):
            return False
    while not stopped():
        assert time.monotonic() < deadline, "rank 2 never stopped"  # A hang guard.
        time.sleep(0.01)
    record_exception(os.environ[FAILURE_DIR_ENV], rank, RuntimeError(sys.argv[2]), 3)
    sys.exit(3)
time.sleep(120)  # A hang guard: the launcher kills this rank.
"""
_GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp"
PEER_TIMEOUTS = {  # What the peer's error says -> how its record is classified.
    # gloo: the operation that timed out, and every other one on its pairs after it.
    "timed-out": (f"{_GLOO}/unbound_buffer.cc:78] Timed out waiting 6000ms for recv "
                  "operation to complete", "peer"),
    "pair-closure": (f"{_GLOO}/pair.cc:534] Application timeout caused pair closure",
                     "peer"),
    # Not recognised as a peer loss, but it names gloo: a stall soon after is its cause.
    "unrecognised": (f"{_GLOO}/pair.cc:1] an error this test has never seen", "error"),
}


@pytest.mark.parametrize("case", sorted(PEER_TIMEOUTS))
def test_a_peer_timing_out_on_a_stopped_rank_before_the_launcher_looks_is_collateral(
        tmp_path, case):
    """Item 7, the race of the test above made certain: a peer's timeout on the stopped
    rank is recorded before the launcher's own stall check could fire (its
    ``pg_timeout_s`` is an hour here). The stopped rank is still named as stalled, the
    peer as collateral. It was blamed when its error was "Application timeout caused pair
    closure" (gloo gives it every operation but the one that timed out) or unrecognised:
    the launcher killed the stopped rank, without a record, as the peer's collateral."""
    message, kind = PEER_TIMEOUTS[case]
    failures, shared = tmp_path / "failures", tmp_path / "shared"
    failures.mkdir()
    shared.mkdir()
    argv = [sys.executable, "-c", _STOPPED_PEER_RANK, str(shared), message]
    launcher = Launcher(argv, 4, str(failures), pg_timeout_s=3600)
    result = launcher.run()
    records = read_failures(failures)
    assert [(r.rank, r.kind) for r in records] == [(1, kind), (2, "stalled")], records
    assert root_cause(records) == records[1]
    assert result.exit_codes[1] == 3 and 2 in launcher.killed, result
    verdict, code = _failure_verdict(result.exit_codes, records, 4, launcher.killed)
    assert verdict.startswith("rank 2 failed (stalled: its process was stopped"), verdict
    assert verdict.endswith("ranks 0, 3 stopped as a consequence)"), verdict
    assert code == 1


def test_a_stall_seen_after_an_unrecognised_timeout_of_a_peer_is_the_cause():
    """A peer's error not recognised as a peer loss but naming a timeout or connection,
    followed by a stall within DEATH_WINDOW_S: the stall is the root cause, as a death
    would be; an error of the rank's own, or a stall much later, keeps the first record."""
    t = 1000.0
    unrecognised = FailureRecord(0, 1, "error", "RuntimeError: heartbeat timeout", 1, t)
    stalled = FailureRecord(1, 2, "stalled", "stalled: its process was stopped", None,
                            t + 0.1)
    assert root_cause([unrecognised, stalled]) == stalled
    own = FailureRecord(0, 1, "error", "ValueError: bad batch shape", 1, t)
    assert root_cause([own, stalled]) == own
    late = FailureRecord(1, 2, "stalled", "stalled", None, t + DEATH_WINDOW_S + 1)
    assert root_cause([unrecognised, late]) == unrecognised


def _fake_checkpoint(root: Path) -> Path:
    """A checkpoint folder whose ``.metadata`` cannot be read: every rank fails to load."""
    path = root / "iter_0000004"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    write_manifest(path, 4, {}, {})
    return path


def test_checkpoint_errors_are_one_line_without_tracebacks(tmp_path):
    """Item 8: a checkpoint error prints one line per rank and no traceback (which
    ``MIMOTRON_DEBUG=1`` brings back), and the verdict names the error."""
    bad = _fake_checkpoint(tmp_path / "ckpt")
    args = [COLOCATED, *TINY, "train.iters=10", f"checkpoint.load={bad}",
            f"log.dir={tmp_path}"]
    one_rank = [DIGITS, *TINY, "train.iters=10", f"checkpoint.load={bad}",
                f"log.dir={tmp_path}/one",
                *[f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
                  for k, v in (("data", 1), ("rank_offset", 0))]]
    # The two launches share nothing but the (read-only) bad checkpoint: both at once.
    proc, debug = _start(args), _start(one_rank, MIMOTRON_DEBUG="1")
    try:
        out = _finish(proc)
    finally:
        debug_out = _finish(debug)
    assert proc.returncode == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "CheckpointError" in _verdict(out)
    reports = [x for x in out.splitlines() if x.startswith("mimotron train: rank")]
    assert 2 <= len(reports) <= 3, out[-4000:]  # rank lines (one may be killed) + verdict
    out = debug_out
    assert debug.returncode == 1, out[-4000:]
    assert "CheckpointError" in out and "Traceback (most recent call last)" in out


def test_rank_output_is_written_in_whole_lines():
    """Item 9: under ``PYTHONUNBUFFERED=1`` ``print`` writes a line's text and its newline
    separately, so another rank can cut in; a rank's streams write whole lines only."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    with open(write_end, "w", buffering=1) as raw:
        raw.reconfigure(write_through=True)  # What -u / PYTHONUNBUFFERED=1 sets up.
        writer = LineWriter(raw)
        print("half", end="", file=writer, flush=True)
        with pytest.raises(BlockingIOError):  # Nothing yet: the line is not complete.
            os.read(read_end, 100)
        print(" a line\nand another", file=writer, flush=True)
        assert os.read(read_end, 100) == b"half a line\nand another\n"
    os.close(read_end)


def test_lines_of_concurrent_ranks_never_interleave(tmp_path):
    """Item 9: four ranks failing at once (each printing a traceback, under
    ``PYTHONUNBUFFERED=1`` as in many containers) never cut each other's lines."""
    proc = _start([DIGITS, *TINY, "train.iters=5", "train.pg_timeout_s=60",
                   f"log.dir={tmp_path}"],
                  MIMOTRON_FAIL_AT_ITER="2", MIMOTRON_FAIL_RANK="2", MIMOTRON_DEBUG="1",
                  PYTHONUNBUFFERED="1")
    out = _finish(proc)
    assert proc.returncode == 1, out[-4000:]
    starts = ("mimotron train:", "Traceback (most recent call last):", "iter ")
    for line in out.splitlines():
        for start in starts:
            # A line that holds the start of another line was cut by it.
            assert start not in line or line.startswith(start), repr(line)
        assert line.count("mimotron train:") <= 1, repr(line)
    assert _verdict(out).startswith("mimotron train: rank 2 failed (exit code 1): "
                                    "InjectedFault")


def test_a_launcher_pid_leaked_into_another_launch_is_not_obeyed(monkeypatch):
    """Item 4: ``MIMOTRON_LAUNCHER_PID`` inherited by a process another launcher started
    (torchrun run from a rank's shell) must not make its ranks die with a stranger: a
    rank whose parent is not the named pid kills itself at once."""
    from mimotron.lifeline import launched_parent

    monkeypatch.setenv("MIMOTRON_LAUNCHER_PID", "999999")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "some-torchrun-job")
    assert launched_parent() == os.getppid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "mimotron-999999")  # What the launcher sets.
    assert launched_parent() == 999999
