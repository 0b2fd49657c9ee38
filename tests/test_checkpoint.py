"""Checkpoints: exact resume, async == sync, failed and killed saves, damage, SIGTERM, export.

Every run uses the small model of ``tests/common.py`` (fp32 unless said otherwise)
and the real loop (``run_training``), so periodic saves, ``exit_interval``, retention
and ``checkpoint.load = "auto"`` are exercised as a user would. One straight 20-iteration
run (module fixture) is the reference; it also leaves a checkpoint for the damage and
export tests.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.checkpoint import (
    CheckpointError,
    CheckpointManager,
    SafeLoadPlanner,
    StopSignals,
    export_checkpoint,
    load_exported,
    maybe_load_checkpoint,
    read_full_model,
    read_latest,
    resolve_load,
    save_checkpoint,
)
from mimotron.checkpoint.files import (
    checkpoint_iterations,
    is_complete,
    prune,
    retire,
    write_latest,
    write_manifest,
)
from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.data import build_datasets
from mimotron.data.collate import collate
from mimotron.data.tokenizer import CharTokenizer
from mimotron.forked_ranks import RankError, run_groups, run_ranks
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS, colocated_plain
from tests.parity import train, training_records

REPO = Path(__file__).resolve().parents[1]


# Per-module lr (vision differs), warm-up then cosine decay over 20 iterations.
TRAIN = (
    BASE
    + colocated_plain(1)
    + [
        "train.iters=20",
        "eval.iters=1",
        "log.interval=1",
        "log.progress=false",
        "modules.vision.optimizer.lr=1e-3",
        "checkpoint.load=auto",
    ]
)
FIELDS = (
    "iteration",
    "loss",
    "grad_norm",
    "lr",
    "loss_scale",
    "skipped",
    "num_zeros",
    "consumed_samples",
)


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, Any]:
    """20 iterations in one go; the final save (interval 20) is iter_0000020."""
    tmp = tmp_path_factory.mktemp("straight")
    run_ranks(
        1,
        train,
        TRAIN + [f"log.dir={tmp}", f"checkpoint.dir={tmp}/ckpt", "checkpoint.interval=20"],
        timeout_s=120,
    )
    return {"records": training_records(tmp, FIELDS), "checkpoint": tmp / "ckpt" / "iter_0000020"}


def test_resume_is_bitwise_exact(straight, tmp_path):
    """10 + 10 (the second half saving asynchronously) == 20 straight, every field."""
    ckpt = tmp_path / "ckpt"
    first = TRAIN + [
        f"log.dir={tmp_path}",
        f"checkpoint.dir={ckpt}",
        "checkpoint.interval=4",
        "checkpoint.keep=2",
    ]
    run_ranks(1, train, first + ["train.exit_interval=10"], timeout_s=120)
    # Saves at 4, 8 and 10 (exit); keep=2 removed 4 once 10 was complete.
    assert read_latest(ckpt) == 10 and _dirs(ckpt) == ["iter_0000008", "iter_0000010"]
    assert len(training_records(tmp_path, FIELDS)) == 10
    run_ranks(1, train, first + ["checkpoint.async_save=true"], timeout_s=120)
    assert read_latest(ckpt) == 20 and _dirs(ckpt) == ["iter_0000016", "iter_0000020"]
    got, want = training_records(tmp_path, FIELDS), straight["records"]
    assert [r["iteration"] for r in got] == list(range(1, 21))
    assert got == want  # bitwise: losses, grad norms, per-module lr, loss scale, ...
    assert got[12]["lr"]["vision"] != got[12]["lr"]["language"]


def test_fp16_resume_restores_loss_scaler(tmp_path):
    """fp16: the dynamic loss scale (and its trackers) resume exactly."""
    fp16 = [x for x in TRAIN if not x.startswith("train.iters")] + [
        "train.iters=6",
        "train.precision=fp16",
        "optimizer.loss_scale_window=3",
        "optimizer.initial_loss_scale=4096.0",
        "optimizer.hysteresis=1",
    ]
    split = fp16 + [f"log.dir={tmp_path}/b", f"checkpoint.dir={tmp_path}/ckpt"]
    # The straight run and the first half are independent: side by side.
    run_groups([(1, train, (fp16 + [f"log.dir={tmp_path}/a", "checkpoint.load=none"],), {}),
                (1, train, (split + ["train.exit_interval=3"],), {})], timeout_s=120)
    run_ranks(1, train, split, timeout_s=120)
    want, got = training_records(tmp_path / "a", FIELDS), training_records(tmp_path / "b", FIELDS)
    assert got == want
    assert len({r["loss_scale"] for r in want}) > 1  # the scale moved: the test can fail


# ---- async == sync ----------------------------------------------------------------------


def _steps(run: Any, num: int) -> None:
    ts = run.global_state.train_state
    for _ in range(num):
        train_step_mimo(
            default_forward_step,
            run.train_data_iterator,
            run.model,
            run.optimizer,
            run.schedulers,
            run.global_state,
            run.communicator,
            infra=run.infra,
        )
        ts.iteration += 1
        ts.consumed_samples += run.global_state.cfg.train.global_batch_size


def _pieces(run: Any) -> tuple:
    return run.model, run.optimizer, run.schedulers, run.global_state, run.infra


def _async_vs_sync(rank: int, world: int, overrides: list[str], root: str) -> dict[str, Any]:
    run = setup_mimo(load_config(DIGITS, overrides), init_runtime())
    _steps(run, 3)
    group = dist.new_group(backend="gloo")
    save_checkpoint(f"{root}/sync", *_pieces(run), process_group=group)
    # Hold the background write until a training step (collectives and the optimizer's
    # in-place update included) has run: the save must not block training, and must
    # write the copy taken at save time.
    stepped, write = threading.Event(), FileSystemWriter.write_data

    def gated(self, plan, planner):  # noqa: ANN001
        assert stepped.wait(60), "the training step did not run while the save was pending"
        return write(self, plan, planner)

    FileSystemWriter.write_data = gated
    handle = save_checkpoint(f"{root}/async", *_pieces(run), async_save=True, process_group=group)
    _steps(run, 1)
    pending_after_step = not handle.done()
    stepped.set()
    handle.wait()
    after = {k: v.clone() for k, v in run.model.state_dict().items()}
    return {"after": after, "pending_after_step": pending_after_step}


def _read_all(path: Path) -> dict[str, Any]:
    """Every entry of a checkpoint, read in this process."""
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    template = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        if isinstance(m, TensorStorageMetadata)
        else ""
        for k, m in md.items()
    }
    with warnings.catch_warnings():  # "no process group": intended, one process reads all
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, checkpoint_id=str(path), planner=SafeLoadPlanner(), no_dist=True)
    return template


def test_async_save_equals_sync_save(tmp_path):
    results = run_ranks(2, _async_vs_sync, BASE + colocated_plain(2), str(tmp_path), timeout_s=120)
    sync = _read_all(tmp_path / "sync" / "iter_0000003")
    asynchronous = _read_all(tmp_path / "async" / "iter_0000003")
    assert sorted(sync) == sorted(asynchronous)
    for key, value in sync.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, asynchronous[key]), key
        else:
            assert value == asynchronous[key], key
    # The async checkpoint holds iteration 3, not the weights the 4th step produced.
    assert all(r["pending_after_step"] for r in results)
    after = results[0]["after"]
    name = "language_model.layers.0.mlp.w1.weight"
    assert name in after and not torch.equal(asynchronous["model." + name], after[name])
    assert read_latest(tmp_path / "async") == 3 and read_latest(tmp_path / "sync") == 3


# ---- failed and killed saves ------------------------------------------------------------


def _fail_writes_on_rank_1(rank: int) -> None:
    if rank == 1:

        def broken(self, plan, planner):  # noqa: ANN001, ARG001
            raise OSError("simulated disk failure")

        FileSystemWriter.write_data = broken


def _failing_saves(rank: int, world: int, overrides: list[str], root: str) -> dict[str, Any]:
    cfg = load_config(DIGITS, overrides + [f"checkpoint.dir={root}", "checkpoint.load=auto"])
    run = setup_mimo(cfg, init_runtime())
    _steps(run, 2)
    group = dist.new_group(backend="gloo")
    save_checkpoint(root, *_pieces(run), process_group=group)
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    _steps(run, 1)
    _fail_writes_on_rank_1(rank)
    out: dict[str, Any] = {}
    try:
        save_checkpoint(root, *_pieces(run), process_group=group)
    except CheckpointError as exc:
        out["sync_error"] = str(exc)
    # In the background: the loop's world-agreed check fails every rank together.
    cfg.checkpoint.async_save = True
    manager = CheckpointManager(*_pieces(run))
    manager.save()
    try:
        # Poll until the failure surfaces, however long the background save takes (no
        # fixed number of polls): after_step is collective, so the ranks stay in step, and
        # run_ranks' timeout is the hang guard.
        while True:
            manager.after_step()
            time.sleep(0.01)  # the poll interval, not an ordering assumption
    except CheckpointError as exc:
        out["async_error"] = str(exc)
    finally:
        manager.close()
    out["latest"] = read_latest(Path(root))
    out["resumed"] = maybe_load_checkpoint(*_pieces(run))
    out["weights_restored"] = all(
        torch.equal(v, saved[k]) for k, v in run.model.state_dict().items()
    )
    return out


def test_failed_write_keeps_latest_and_auto_resume_uses_it(tmp_path):
    results = run_ranks(2, _failing_saves, BASE + colocated_plain(2), str(tmp_path), timeout_s=120)
    for out in results:
        assert "iteration 3" in out["sync_error"]
        assert "async_error" in out
        assert out["latest"] == 2 and out["resumed"] == 2 and out["weights_restored"]
    assert not is_complete(tmp_path / "iter_0000003")


def _killed_mid_save(rank: int, world: int, overrides: list[str], root: str) -> None:
    run = setup_mimo(load_config(DIGITS, overrides), init_runtime())
    _steps(run, 2)
    save_checkpoint(root, *_pieces(run))
    _steps(run, 1)
    if rank == 1:
        FileSystemWriter.write_data = lambda *a, **k: os._exit(17)
    save_checkpoint(root, *_pieces(run))


def _resumed_iteration(rank: int, world: int, overrides: list[str]) -> int:
    return setup_mimo(
        load_config(DIGITS, overrides), init_runtime()
    ).global_state.train_state.iteration


def test_rank_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    layout = BASE + colocated_plain(2)
    # Rank 0, blocked on rank 1 in the save, fails too: it must be named as collateral.
    with pytest.raises(RankError, match=r"^rank 1 failed: exited with code 17"):
        run_ranks(2, _killed_mid_save, layout, str(tmp_path), timeout_s=120)
    assert read_latest(tmp_path) == 2 and not is_complete(tmp_path / "iter_0000003")
    resume = layout + [f"checkpoint.dir={tmp_path}", "checkpoint.load=auto"]
    assert run_ranks(2, _resumed_iteration, resume, timeout_s=120) == [2, 2]


# ---- damaged checkpoints ----------------------------------------------------------------


def _damaged_copy(src: Path, dst: Path, damage: str) -> Path:
    shutil.copytree(src, dst)
    data = sorted(dst.glob("*.distcp"))[0]
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "metadata":
        (dst / ".metadata").write_bytes(b"garbage")
    elif damage == "manifest":
        (dst / "manifest.json").unlink()
    return dst / (
        "manifest.json"
        if damage == "manifest"
        else ".metadata"
        if damage == "metadata"
        else data.name
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata", "manifest"])
def test_damaged_checkpoint_names_the_file(straight, tmp_path, damage):
    bad_file = _damaged_copy(straight["checkpoint"], tmp_path / "iter_0000020", damage)
    with pytest.raises(CheckpointError, match=re.escape(str(bad_file))):
        read_full_model(tmp_path / "iter_0000020")


def test_damaged_checkpoint_fails_every_rank_before_reading(straight, tmp_path):
    bad_file = _damaged_copy(straight["checkpoint"], tmp_path / "iter_0000020", "flip")
    with pytest.raises(RankError, match=rf"(?s)CheckpointError.*{re.escape(str(bad_file))}"):
        run_ranks(
            1,
            _resumed_iteration,
            TRAIN + [f"checkpoint.load={tmp_path}/iter_0000020"],
            timeout_s=120,
        )


# ---- SIGTERM ----------------------------------------------------------------------------


def _cli(overrides: list[str]) -> subprocess.Popen:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"  # as the reference's forked rank: same float order
    return subprocess.Popen(
        [sys.executable, "-m", "mimotron", "train", str(DIGITS), *overrides],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _sigterm_after_two_lines(overrides: list[str], log_dir: Path) -> tuple[int, str]:
    """Start ``mimotron train``, SIGTERM it once two metrics lines exist; (code, output)."""
    proc = _cli(overrides)
    metrics = log_dir / "metrics.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    return proc.returncode, out


def test_sigterm_saves_exits_0_and_resume_continues_exactly(straight, tmp_path):
    overrides = TRAIN + [f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"]
    returncode, out = _sigterm_after_two_lines(overrides, tmp_path)
    assert returncode == 0, out
    stopped = read_latest(tmp_path / "ckpt")
    assert stopped is not None and 2 <= stopped < 20, out
    assert "SIGTERM" in out
    iterations = [r["iteration"] for r in training_records(tmp_path, FIELDS)]
    assert iterations == list(range(1, stopped + 1))
    # Resume in a forked rank (a second interpreter start would cost seconds).
    run_ranks(1, train, overrides, timeout_s=120)
    assert training_records(tmp_path, FIELDS) == straight["records"]


def test_sigterm_to_the_launcher_saves_on_every_rank_and_exits_0(tmp_path):
    # Two ranks under torch's launcher: the signal reaches the launcher, which passes it on.
    overrides = TRAIN + colocated_plain(2) + ["train.iters=400", f"log.dir={tmp_path}",
                                         f"checkpoint.dir={tmp_path}/ckpt"]
    returncode, out = _sigterm_after_two_lines(overrides, tmp_path)
    assert returncode == 0, out
    found = re.search(r"stopped by SIGTERM; saved iteration (\d+)", out)
    assert found is not None, out
    stopped = read_latest(tmp_path / "ckpt")
    assert stopped == int(found[1]) and 2 <= stopped < 400, out


def _signal_after_the_stop_save(rank: int, world: int, overrides: list[str]) -> list[Any]:
    """A stop save, then repeats of the signal: during the save's wait and after it."""

    # No duplicate window: every repeat counts as insisting, as one >1 s later would.
    stop = StopSignals(duplicate_window_s=0.0).install()
    run = setup_mimo(load_config(DIGITS, overrides), init_runtime())
    manager = CheckpointManager(*_pieces(run))  # Adopts ``stop``.
    _steps(run, 1)
    signal.raise_signal(signal.SIGTERM)
    stopping = manager.after_step()  # Saves iteration 1 and stops.
    manager.finish()
    # The save is complete: a scheduler's repeat during the final eval, the summary or
    # destroy_process_group must not kill the rank (before the fix it died of SIGTERM).
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGINT)
    manager.close()
    stop.restore()
    return [stopping, stop.saving_iteration,
            read_latest(Path(run.global_state.cfg.checkpoint_dir))]


def test_a_signal_after_the_stop_save_is_complete_is_ignored(tmp_path):
    overrides = TRAIN + [f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"]
    assert run_ranks(1, _signal_after_the_stop_save, overrides, timeout_s=120) == [
        [True, 1, 1]]


def test_a_signal_during_the_stop_save_aborts_and_says_which_save():
    """Only a signal while the stop's save is written aborts (KeyboardInterrupt for SIGINT);
    the handler notes the iteration and the signal for the rank's failure record."""
    # The handler StopSignals restores before re-raising is the one it found: make it
    # Python's own, whatever an earlier test in this worker process left in place.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    stop = StopSignals(duplicate_window_s=0.0).install()
    try:
        signal.raise_signal(signal.SIGTERM)  # The stop request.
        signal.raise_signal(signal.SIGTERM)  # A copy before the save: ignored.
        stop.begin_save(7)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert (stop.received, stop.aborted_by, stop.saving_iteration) == (
            signal.SIGTERM, signal.SIGINT, 7)
    finally:
        stop.restore()
        signal.signal(signal.SIGINT, before)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


# ---- export -----------------------------------------------------------------------------


def _logits(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    lm = model.language_model
    embeds = {n: model.encode(n, batch) for n in model.modality_submodules}
    present = {n: model.present_mask(n, batch) for n in model.modality_submodules}
    return lm(
        model.merge_embeddings(batch["tokens"], lm.embed_tokens(batch["tokens"]), embeds, present)
    )


def _batch(cfg: Any) -> dict[str, torch.Tensor]:
    task, _ = build_datasets(cfg, CharTokenizer())
    return collate(
        task.stream(cfg.train.seed).samples(0, 8),
        cfg.data.seq_length,
        pad_id=task.pad_id,
        image_shape=task.image_shape,
        audio_shape=task.audio_shape,
    )


def _loaded_logits(rank: int, world: int, overrides: list[str]) -> torch.Tensor:
    run = setup_mimo(load_config(DIGITS, overrides), init_runtime())
    with torch.no_grad():
        return _logits(run.model.eval(), _batch(run.global_state.cfg))


def test_export_matches_the_distributed_load(straight, tmp_path):
    ckpt = straight["checkpoint"]
    assert cli_main(["export", str(ckpt.parent), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".mimotron-export.json",  # what the export wrote (it may replace only those)
        "audio.safetensors",
        "config.json",
        "language.safetensors",
        "vision.safetensors",
    ]
    cfg, model = load_exported(tmp_path / "out")
    with torch.no_grad():
        exported = _logits(model.eval(), _batch(cfg))
    (loaded,) = run_ranks(1, _loaded_logits, TRAIN + [f"checkpoint.load={ckpt}"], timeout_s=120)
    assert torch.equal(exported, loaded)
    assert export_checkpoint(ckpt, tmp_path / "again")["language"].is_file()


def test_export_cli_rejects_a_non_checkpoint(tmp_path, capsys):
    assert cli_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "iter_NNNNNNN" in capsys.readouterr().err


# ---- pure units: directory rules, checkpoint.load values, signals -----------------------


def _fake_checkpoint(root: Path, iteration: int, complete: bool = True) -> None:
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        write_manifest(path, iteration, {}, {})


def test_prune_keeps_newest_complete_and_never_newer(tmp_path):
    for it in (2, 4, 6, 8, 12):
        _fake_checkpoint(tmp_path, it)
    _fake_checkpoint(tmp_path, 7, complete=False)  # a failed save
    write_latest(tmp_path, 8)
    assert prune(tmp_path, 8, keep=2) == [2, 4, 7]
    assert sorted(checkpoint_iterations(tmp_path)) == [6, 8, 12]  # 12: a rewound run's


def test_retire_moves_latest_before_deleting(tmp_path):
    _fake_checkpoint(tmp_path, 3)
    _fake_checkpoint(tmp_path, 5)
    write_latest(tmp_path, 5)
    retire(tmp_path, 5)  # about to be rewritten: latest must not name it meanwhile
    assert read_latest(tmp_path) == 3 and not (tmp_path / "iter_0000005").exists()
    retire(tmp_path, 3)
    assert read_latest(tmp_path) is None


def test_checkpoint_load_values(tmp_path):
    assert resolve_load("none", tmp_path) is None
    assert resolve_load("auto", tmp_path) is None  # nothing there yet: start fresh
    _fake_checkpoint(tmp_path, 4)
    write_latest(tmp_path, 4)
    assert resolve_load("auto", tmp_path) == tmp_path / "iter_0000004"
    assert resolve_load(str(tmp_path), tmp_path / "elsewhere") == tmp_path / "iter_0000004"
    assert resolve_load(str(tmp_path / "iter_0000004"), tmp_path) == tmp_path / "iter_0000004"
    with pytest.raises(ValueError, match="checkpoint.load='latest-please' is invalid"):
        resolve_load("latest-please", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="iter_NNNNNNN"):
        resolve_load(str(tmp_path / "empty"), tmp_path)
    write_latest(tmp_path, 9)  # names a checkpoint that is not there
    with pytest.raises(CheckpointError, match="iteration 9"):
        resolve_load("auto", tmp_path)


def test_stop_signals_ignore_repeats_until_the_save_began():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        stop = StopSignals((signal.SIGTERM,), duplicate_window_s=0.0).install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM and stop.name == "SIGTERM" and seen == []
        os.kill(os.getpid(), signal.SIGTERM)  # a forwarded copy: still stopping cleanly
        assert seen == [] and stop.installed
        stop.saving = True
        os.kill(os.getpid(), signal.SIGTERM)  # insisting during the save: passed on
        assert seen == [signal.SIGTERM] and not stop.installed
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stop_signals_treat_quick_repeats_as_copies_even_while_saving():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        stop = StopSignals((signal.SIGTERM,), duplicate_window_s=3600.0).install()
        os.kill(os.getpid(), signal.SIGTERM)
        stop.saving = True
        os.kill(os.getpid(), signal.SIGTERM)  # within the window: the same request
        assert stop.installed and stop.received == signal.SIGTERM
        stop.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _full_disk_save(rank: int, world: int, overrides: list[str], root: str) -> str:
    """Both ranks' writes fail as a full device makes them fail: torch's stream writer
    reports a short write, Python's own write ENOSPC."""
    run = setup_mimo(load_config(DIGITS, overrides), init_runtime())
    _steps(run, 1)
    errors = [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 "
                           "vs 598"), OSError(errno.ENOSPC, "No space left on device")]

    def full(self, plan, planner):  # noqa: ANN001, ARG001
        raise errors[rank]

    FileSystemWriter.write_data = full
    try:
        save_checkpoint(root, *_pieces(run))
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def test_a_full_disk_is_one_message_naming_the_folder_on_every_rank(tmp_path):
    """Was 'rank 0: RuntimeError: ... unexpected pos 704 vs 598; rank 1: OSError: [Errno
    28] ...': the same words for the same cause, with the folder and its free space."""
    messages = run_ranks(2, _full_disk_save, BASE + colocated_plain(2), str(tmp_path),
                         timeout_s=120)
    folder = tmp_path / "iter_0000001"
    for text in messages:
        for rank in (0, 1):
            assert f"rank {rank}: no space left on the device holding {folder} (" in text
        assert "unexpected pos" not in text and "bytes free)" in text
