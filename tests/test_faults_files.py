"""Issue 13, faults of files on disk: torn metrics, tampered checkpoints, plot and export.

Each test reproduces one fault of the issue (its docstring names the item) through the
real entry point: a resumed run, ``mimotron train`` / ``export`` / ``plot``, or the
metrics writer itself. One short 2-iteration run (module fixture) leaves the metrics
file and checkpoint the tests damage copies of.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mimotron.checkpoint import CheckpointError, export_checkpoint, read_full_model
from mimotron.cli.main import main as cli_main
from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.runtime import init_runtime
from mimotron.training.loop import run_training
from mimotron.training.metrics import MetricsWriter, TrainingDivergedError, check_divergence
from mimotron.training.state import TrainState
from tests.common import BASE, DIGITS, ONE_RANK

REPO = Path(__file__).resolve().parents[1]
RUN = [*BASE, *ONE_RANK, "eval.iters=1", "log.interval=1", "log.progress=false",
       "checkpoint.load=auto", "checkpoint.interval=2"]


def _run(rank: int, world: int, overrides: list[str]) -> None:
    run_training(load_config(DIGITS, overrides), init_runtime())


def _lines(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """2 iterations, saved at 2: ``<dir>/metrics.jsonl`` and ``<dir>/ckpt/iter_0000002``."""
    tmp = tmp_path_factory.mktemp("short")
    run_ranks(1, _run, RUN + ["train.iters=2", f"log.dir={tmp}", f"checkpoint.dir={tmp}/ckpt"],
              timeout_s=120)
    return tmp


def _copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- item 2: torn metrics line ---------------------------------------------------------


def test_resume_drops_a_torn_final_metrics_line(short_run, tmp_path, capfd):
    """Item 2: a disk-full crash tore the last metrics line; resume drops it and goes on."""
    run = _copy_run(short_run, tmp_path / "run")
    metrics = run / "metrics.jsonl"
    kept = metrics.read_text()
    with metrics.open("a") as f:
        f.write('{"iteration": 3, "loss": 0.4, "grad_no')  # The disk filled up here.
    overrides = RUN + ["train.iters=3", f"log.dir={run}", f"checkpoint.dir={run}/ckpt"]
    run_ranks(1, _run, overrides, timeout_s=120)
    text = metrics.read_text()
    assert text.startswith(kept) and text.endswith("\n")
    assert [r["iteration"] for r in _lines(run) if "loss" in r] == [1, 2, 3]
    err = capfd.readouterr().err
    notes = [x for x in err.splitlines() if "torn" in x]
    assert len(notes) == 1 and str(metrics) in notes[0], err
    assert f"line {len(kept.splitlines()) + 1}" in notes[0], err


def test_garbage_inside_metrics_names_the_file_and_line(tmp_path):
    """Item 2: any other damage of metrics.jsonl names the file and the line."""
    from mimotron.training.metrics_file import MetricsFileError

    w = MetricsWriter(tmp_path, 10, progress=False)
    for it in (1, 2, 3):
        w.write({"iteration": it, "loss": 1.0})
    w.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "}garbage{", lines[2]]) + "\n")
    with pytest.raises(MetricsFileError, match=rf"^{path} line 2 is not JSON"):
        MetricsWriter(tmp_path, 10, progress=False, append=True, resumed_at=3)
    path.write_text("\n".join([lines[0], "[1, 2]", lines[2]]) + "\n")
    with pytest.raises(MetricsFileError, match=rf"^{path} line 2 is not a JSON object"):
        MetricsWriter(tmp_path, 10, progress=False, append=True, resumed_at=3)


def test_appending_after_a_line_without_newline_starts_a_fresh_line(tmp_path):
    """Item 2: a complete last line without its newline is kept; the next one follows it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "loss": 1.0}\n{"iteration": 2, "loss": 0.5}')
    w = MetricsWriter(tmp_path, 10, progress=False, append=True)
    w.write({"iteration": 3, "loss": 0.25})
    w.close()
    assert [r["iteration"] for r in _lines(tmp_path)] == [1, 2, 3]


# ---- item 3: tampered checkpoint -------------------------------------------------------


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a crafted ``.metadata`` would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _tamper(ckpt: Path, marker: Path) -> None:
    """Replace ``.metadata`` with a crafted pickle and rewrite the manifest to match."""
    data = pickle.dumps(_Payload(marker))
    (ckpt / ".metadata").write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_crafted_metadata_is_refused_by_train_and_export(short_run, tmp_path):
    """Item 3: a crafted ``.metadata`` whose checksum matches is refused, never run."""
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(_Payload(marker)))  # The payload works when unpickled...
    assert marker.exists()
    marker.unlink()
    run = _copy_run(short_run, tmp_path / "run")
    ckpt = run / "ckpt" / "iter_0000002"
    _tamper(ckpt, marker)
    refused = f"{ckpt / '.metadata'} refused: refusing to unpickle global posix.system"
    with pytest.raises(CheckpointError, match=refused):
        read_full_model(ckpt)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "mimotron", "export", str(run / "ckpt"),
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert refused in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mimotron", "train", str(DIGITS), *RUN,
                           "train.iters=4", f"log.dir={run}", f"checkpoint.dir={run}/ckpt"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0 and refused in proc.stderr, proc.stdout + proc.stderr
    assert not marker.exists()


# ---- items 8 and 9: plot -----------------------------------------------------------------


@pytest.mark.parametrize("content,error", [
    ('{"iteration": 1, "loss": 1.0}\nnot json\n{"iteration": 2, "loss": 0.5}\n',
     "line 2 is not JSON"),
    ('{"iteration": 1, "loss": 1.0}\n\n[1, 2]\n', "line 3 is not a JSON object"),
    ('{"loss": 1.0}\n', "line 1 has no integer 'iteration'"),
    ("", "no metrics in"),
    ("\n\n", "no metrics in"),
])
def test_plot_bad_metrics_exits_2_with_one_line(tmp_path, capsys, content, error):
    """Item 8: plot on a garbage line, a JSON list or an empty file: one line naming it."""
    (tmp_path / "metrics.jsonl").write_text(content)
    assert cli_main(["plot", str(tmp_path), "--out", str(tmp_path / "plots")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"mimotron plot: {tmp_path / 'metrics.jsonl'}") or \
        err.startswith(f"mimotron plot: no metrics in {tmp_path / 'metrics.jsonl'}"), err
    assert error in err
    assert not (tmp_path / "plots").exists()


def test_plot_skips_a_torn_final_line_of_a_live_run(tmp_path, capsys):
    """Item 8: plotting while a run writes (or after a crash) tolerates a torn last line."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"iteration": 1, "loss": 1.0, "lr": {"language": 0.1}}\n{"iteration": 2, "lo')
    assert cli_main(["plot", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "torn" in captured.err and captured.out.count("wrote ") == 4


# ---- items 8 and 9: export ---------------------------------------------------------------


def test_export_to_an_unwritable_folder_is_one_line_before_reading(short_run, tmp_path,
                                                                    capsys, monkeypatch):
    """Item 8: export into a folder it cannot write: one line naming it, exit non-zero."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    ckpt = short_run / "ckpt"
    assert cli_main(["export", str(ckpt), str(blocker / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(blocker) in err and "not a directory" in err
    # Checked before the checkpoint is read: a non-checkpoint reports the folder first.
    assert cli_main(["export", str(tmp_path / "nothing"), str(blocker / "out")]) == 2
    assert str(blocker) in capsys.readouterr().err
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs a user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert cli_main(["export", str(ckpt), str(locked)]) == 2
        assert f"{locked} is not writable" in capsys.readouterr().err
    # Any other failure: one line, the traceback only with MIMOTRON_DEBUG=1.
    monkeypatch.setattr("mimotron.checkpoint.export.save_file", _disk_full)
    assert cli_main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "mimotron export: OSError: [Errno 28] No space left on device", err
    monkeypatch.setenv("MIMOTRON_DEBUG", "1")
    assert cli_main(["export", str(ckpt), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith("No space left on device")


def _disk_full(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device")


def test_exported_files_honour_the_umask_alike(short_run, tmp_path):
    """Item 9: safetensors files got 0600 while config.json got 0644; both follow umask."""
    previous = os.umask(0o027)
    try:
        written = export_checkpoint(short_run / "ckpt", tmp_path / "out")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()}
    assert set(modes) == {f"{m}.safetensors" for m in written} | {"config.json",
                                                                    ".mimotron-export.json"}
    assert set(modes.values()) == {0o640}, modes


# ---- item 9: non-finite values -----------------------------------------------------------


def test_non_finite_metrics_are_written_as_null(tmp_path, capsys):
    """Item 9: metrics.jsonl held bare NaN / Infinity (not JSON); now null."""
    w = MetricsWriter(tmp_path, 10)
    record = {"iteration": 1, "loss": math.nan, "grad_norm": math.inf, "lr": {"a": 1e-3},
              "tokens_per_second": 10.0, "step_time_s": 1.0,
              "time_s": {"forward": -math.inf}, "peak_memory_bytes_per_rank": [1, math.nan]}
    w.write(record)
    w.console(record, elapsed_s=1.0)
    w.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    (line,) = [json.loads(x, parse_constant=_reject) for x in text.splitlines()]
    assert line["loss"] is None and line["grad_norm"] is None
    assert line["time_s"] == {"forward": None} and line["peak_memory_bytes_per_rank"] == [1, None]
    assert "loss nan" in capsys.readouterr().out  # The console still says what it was.


def _reject(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


# ---- item 8: the fp16 loss-scale stop message --------------------------------------------


def test_fp16_stop_with_a_finite_loss_blames_the_loss_scale_not_the_lr():
    """Item 8: a finite loss under fp16 means loss-scale overflow: lowering lr won't help."""
    ts = TrainState(iteration=7, consecutive_skips=3, nan_iters=0)
    with pytest.raises(TrainingDivergedError) as finite:
        check_divergence(ts, 2.5, 3, "fp16")
    message = str(finite.value)
    assert "optimizer.lr" not in message and "loss scale" in message
    assert "bf16" in message and "optimizer.min_loss_scale" in message
    with pytest.raises(TrainingDivergedError) as nan:
        check_divergence(ts, math.nan, 3, "fp16")
    assert "optimizer.lr" in str(nan.value)
    with pytest.raises(TrainingDivergedError) as fp32:
        check_divergence(ts, 2.5, 3, "fp32")
    assert "loss scale" not in str(fp32.value) and "optimizer.lr" in str(fp32.value)


def test_restricted_unpickler_reads_every_dtype_and_refuses_other_globals(tmp_path):
    """Item 3: what DCP pickles (any dtype, layout, size, path) loads; nothing else does."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from mimotron.checkpoint.safe_metadata import load_metadata

    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8,
              torch.bool, torch.complex64)
    md = {f"t{i}": TensorStorageMetadata(
        TensorProperties(dtype=d, layout=torch.strided, memory_format=torch.channels_last),
        torch.Size([2, 3]), [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))])
        for i, d in enumerate(dtypes)}
    md["b"] = BytesStorageMetadata()
    metadata = Metadata(md, planner_data={"t0": ("t0",)},
                        storage_data={MetadataIndex("t0", torch.Size([0, 0])):
                                      _StorageInfo("__0_0.distcp", 0, 10)},
                        storage_meta=StorageMeta(checkpoint_id=tmp_path, save_id="x"))
    good = tmp_path / "good.metadata"
    good.write_bytes(pickle.dumps(metadata))
    assert load_metadata(good) == metadata
    for payload in (pickle.dumps(getattr), pickle.dumps(torch.load),
                    pickle.dumps(Metadata({"x": _Payload(tmp_path / "m")}))):
        bad = tmp_path / "bad.metadata"
        bad.write_bytes(payload)
        with pytest.raises(CheckpointError, match=rf"{bad} refused: refusing to unpickle"):
            load_metadata(bad)
    assert not (tmp_path / "m").exists()


def test_restricted_unpickler_cannot_patch_an_admitted_class_or_function(tmp_path):
    """Item 3: ``BUILD`` on an admitted class or function would set attributes on it for
    the whole process (``pathlib.Path.exists = frozenset`` makes every path "missing");
    only a DCP metadata object's state may be set."""
    import pathlib

    import torch.serialization

    from mimotron.checkpoint.safe_metadata import load_metadata

    exists, cache = pathlib.PosixPath.exists, dict(torch.serialization._get_layout.cache)
    payloads = (  # PROTO 2, GLOBAL target, state (None, {name: value}), BUILD, STOP.
        b"\x80\x02cpathlib\nPosixPath\nN}\x8c\x06existscbuiltins\nfrozenset\ns\x86b.",
        b"\x80\x02ctorch.serialization\n_get_layout\nN}\x8c\x05cache}s\x86b.",
        # A Metadata instance (NEWOBJ) may not have its class swapped either.
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81N}\x8c\x09"
        b"__class__ccollections\nOrderedDict\ns\x86b.",
    )
    try:
        for payload in payloads:
            bad = tmp_path / "bad.metadata"
            bad.write_bytes(payload)
            with pytest.raises(CheckpointError, match=rf"{bad} refused: refusing to set"):
                load_metadata(bad)
        assert pathlib.PosixPath.exists is exists
        assert torch.serialization._get_layout.cache == cache
    finally:
        pathlib.PosixPath.exists = exists
        torch.serialization._get_layout.cache = cache
