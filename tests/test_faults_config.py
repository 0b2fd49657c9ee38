"""Fault injection for issue 13, configuration and run-directory items (5, 6, 8).

Each test reproduces a fault of the issue as a user meets it (the ``mimotron`` command
or the library, in this process) and names its item in the docstring:

* item 5: a rerun into a run directory that holds a previous run clobbered it silently;
  ``latest`` missing beside complete ``iter_*`` folders started a fresh run;
* item 6: non-finite floats and integers beyond int64 passed validation;
* item 8: an unwritable checkpoint directory was found only at the first save; a config
  path that is a directory or not UTF-8 was misreported; an unexpected error printed a
  traceback with no way to ask for one (``--debug``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from mimotron.checkpoint.files import resolve_load, write_latest, write_manifest
from mimotron.cli.main import main
from mimotron.config import (
    CheckpointConfig,
    MimoConfig,
    ModuleConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    load_config,
)
from tests.common import ONE_RANK, SMALL_MODEL

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs" / "digits.toml")
TINY = [*SMALL_MODEL, *ONE_RANK, "eval.iters=1", "log.interval=1", "log.progress=false",
        "train.iters=2"]
INT64 = (-(2**63), 2**63 - 1)


def _iterations(log_dir: Path) -> list[int]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["iteration"] for x in lines if "loss" in json.loads(x)]


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- item 5: previous runs ------------------------------------------------------------


def test_item5_shipped_configs_and_schema_resume_by_default():
    """Item 5: ``checkpoint.load`` defaults to ``auto`` in the schema and every shipped
    config (configs/digits.toml said ``none``)."""
    assert CheckpointConfig().load == "auto"
    shipped = sorted(ROOT.glob("configs/*.toml")) + sorted(ROOT.glob("examples/**/*.toml"))
    assert shipped
    for path in shipped:
        # Read as TOML, not validated: configs/digits_llava.toml names Hugging Face folders
        # that only `make demo-llava` creates. A file that leaves the key out gets the
        # schema's default, checked above.
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        assert raw.get("checkpoint", {}).get("load", "auto") == "auto", path


def test_item5_rerun_refuses_then_overwrite_moves_the_previous_run_aside(tmp_path, capsys):
    """Item 5: a fresh start over a previous run is refused (one line naming the directory
    and ``train.overwrite=true``); with it, the previous run is moved aside and named."""
    run = ["train", DIGITS, *TINY, f"log.dir={tmp_path}", "checkpoint.interval=2"]
    assert main(run) == 0
    capsys.readouterr()
    before = (tmp_path / "metrics.jsonl").read_text()
    # load=none over checkpoints and metrics: today it trains afresh and truncates.
    assert main([*run, "checkpoint.load=none"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(tmp_path) in line and "train.overwrite=true" in line
    assert (tmp_path / "metrics.jsonl").read_text() == before
    # load=auto with metrics but no checkpoint to resume from: refused the same way.
    assert main([*run, "checkpoint.interval=0", f"checkpoint.dir={tmp_path}/other"]) == 2
    assert "train.overwrite=true" in _one_line(capsys.readouterr().err)
    assert main([*run, "checkpoint.load=none", "train.overwrite=true"]) == 0
    err = capsys.readouterr().err
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    assert str(moved) in err
    assert (moved / "metrics.jsonl").read_text() == before
    assert (moved / "checkpoints" / "latest").read_text().strip() == "2"
    assert (moved / "checkpoints" / "iter_0000002" / "manifest.json").is_file()
    assert _iterations(tmp_path) == [1, 2]
    # The new run's own checkpoint; resuming from it (auto) is no fresh start, but the
    # run is finished: nothing to train (test_faults_rundir.py), and nothing written.
    assert main(run) == 2
    assert "nothing to train: iteration 2 already reached" in capsys.readouterr().err
    assert _iterations(tmp_path) == [1, 2]


def test_item5_library_train_mimo_refuses_a_fresh_start_over_a_previous_run(tmp_path):
    """Item 5: library use (``run_training``) gets the same refusal."""
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import run_training

    cfg = load_config(DIGITS, [*TINY, f"log.dir={tmp_path}"])
    run_training(cfg, init_runtime())
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="train.overwrite=true"):
        run_training(cfg, init_runtime())
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_item5_only_rank_0_moves_a_previous_run_under_an_external_launcher(
        tmp_path, monkeypatch, capsys):
    """Item 5: under torchrun every rank runs the pre-launch step; only RANK 0 moves files
    (the others neither move nor refuse, so they cannot race with it)."""
    from mimotron.run_dir import prepare_run_dir

    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')
    cfg = load_config(DIGITS, [*TINY, f"log.dir={tmp_path}", "train.overwrite=true"])
    monkeypatch.setenv("RANK", "1")
    prepare_run_dir(cfg)
    assert (tmp_path / "metrics.jsonl").is_file()
    monkeypatch.setenv("RANK", "0")
    prepare_run_dir(cfg)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert "moved" in capsys.readouterr().err
    cfg.train.overwrite = False
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')
    for rank in ("0", "1"):  # without overwrite every rank refuses alike
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match=str(tmp_path)):
            prepare_run_dir(cfg)


def _checkpoint(root: Path, iteration: int, complete: bool = True) -> Path:
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        write_manifest(path, iteration, {}, {})
    return path


def test_item5_auto_resumes_from_the_newest_complete_checkpoint_without_latest(
        tmp_path, capsys):
    """Item 5: ``latest`` missing beside complete ``iter_*`` folders: ``auto`` resumes from
    the newest complete one (and says ``latest`` was missing) instead of starting fresh."""
    _checkpoint(tmp_path, 4)
    newest = _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 8, complete=False)  # a save that never finished
    assert resolve_load("auto", tmp_path) == newest
    assert "latest" in capsys.readouterr().err
    write_latest(tmp_path, 4)  # when latest exists it still decides (a rewound run)
    assert resolve_load("auto", tmp_path) == tmp_path / "iter_0000004"


# ---- item 6: numbers -------------------------------------------------------------------


def _numeric_keys() -> dict[str, type]:
    """Every float and int config key (``modules.language.*`` for per-module ones), with
    its element type; walked from the schema so a new field is covered unasked."""
    out: dict[str, type] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{f.name}.")
                continue
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            base = args[0] if typing.get_origin(hint) is not None and args else hint
            if base in (int, float):
                out[f"{prefix}{f.name}"] = list if typing.get_origin(hint) is list else base

    for cls, prefix in ((MimoConfig, ""), (ModuleConfig, "modules.language."),
                        (ParallelConfig, "modules.language.parallel."),
                        (OptimizerConfig, "modules.language.optimizer."),
                        (SchedulerConfig, "modules.language.optimizer.")):
        walk(cls, prefix)
    return out


def _elem(key: str) -> type:
    """The element type of a list field (betas: float; layers_per_stage, ranks: int)."""
    return float if key.endswith("betas") else int


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_item6_every_float_field_rejects_non_finite_values(value):
    """Item 6: every float field (``optimizer.eps=inf`` trained a flat loss) rejects
    inf / -inf / nan before launch, naming the field."""
    keys = {k: t for k, t in _numeric_keys().items()
            if t is float or (t is list and _elem(k) is float)}
    assert {"optimizer.eps", "optimizer.lr", "optimizer.initial_loss_scale",
            "train.pg_timeout_s", "modules.language.optimizer.clip_grad"} <= set(keys)
    for key, kind in keys.items():
        item = f"{key}=[{value}, 0.9]" if kind is list else f"{key}={value}"
        with pytest.raises(ValueError, match="finite") as info:
            load_config(DIGITS, [item])
        assert str(info.value).startswith(f"{key}="), (key, str(info.value))


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 99999999999999999999])
def test_item6_every_int_field_rejects_values_beyond_int64(value):
    """Item 6: every int field rejects values beyond int64 (``train.seed`` failed after
    launch, naming no field), naming the field and the range."""
    keys = {k: t for k, t in _numeric_keys().items()
            if t is int or (t is list and _elem(k) is int)}
    assert {"train.seed", "train.iters", "modules.language.parallel.data",
            "profile.ranks"} <= set(keys)
    for key, kind in keys.items():
        item = f"{key}=[{value}]" if kind is list else f"{key}={value}"
        with pytest.raises(ValueError, match=str(INT64[1])) as info:
            load_config(DIGITS, [item])
        assert str(info.value).startswith(f"{key}="), (key, str(info.value))


def test_item6_the_cli_names_the_field_before_launch(capsys):
    """Item 6: ``train.seed=99999999999999999999`` and ``optimizer.eps=inf`` exit 2 with one
    line naming the field (``plan`` alike), before any process group exists."""
    for command in ("train", "plan"):
        for item, key in (("train.seed=99999999999999999999", "train.seed"),
                          ("optimizer.eps=inf", "optimizer.eps")):
            assert main([command, DIGITS, item]) == 2
            assert key in _one_line(capsys.readouterr().err)
    assert not dist.is_initialized()


# ---- item 8: paths and one-line errors ------------------------------------------------


def test_item8_unwritable_directories_are_refused_before_launch(tmp_path, capsys):
    """Item 8: an unwritable ``checkpoint.dir`` (or ``log.dir``) exits 2 naming it, before
    launch; it was found only at the first save."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for key in ("checkpoint.dir", "log.dir"):
        argv = ["train", DIGITS, *TINY, "checkpoint.interval=1", f"log.dir={tmp_path}/run",
                f"{key}={blocker}/sub"]
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert f"{key}=" in line and str(blocker / "sub") in line and "writable" in line
        assert not dist.is_initialized()


def test_item8_config_path_problems_are_named(tmp_path, capsys):
    """Item 8: a config that is a directory, missing or not UTF-8 is reported as such."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    cases = ((tmp_path, "is a directory"), (tmp_path / "nope.toml", "does not exist"),
             (latin1, "not UTF-8"))
    for command in ("plan", "train"):
        for path, says in cases:
            assert main([command, str(path)]) == 2
            line = _one_line(capsys.readouterr().err)
            assert str(path) in line and says in line, line


def test_item8_debug_flag_and_one_line_unexpected_errors(monkeypatch, capsys):
    """Item 8: an unexpected error in the launcher process prints one line pointing at
    ``--debug``; ``mimotron --debug`` exports MIMOTRON_DEBUG=1 and shows the traceback."""
    import mimotron.cli.plan as plan_module

    def broken(*args: Any, **kwargs: Any) -> Any:  # the injected fault
        raise RuntimeError("injected")

    monkeypatch.setattr(plan_module, "check_layout", broken)
    monkeypatch.setenv("MIMOTRON_DEBUG", "0")  # restored after the test; "0" = off
    assert main(["plan", DIGITS]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == "mimotron plan: RuntimeError: injected (run with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="injected"):
        main(["--debug", "plan", DIGITS])
    assert os.environ["MIMOTRON_DEBUG"] == "1"


def test_item8_plan_checks_what_train_checks_before_launch(tmp_path, capsys):
    """Item 8: ``mimotron plan`` rejects a missing ``checkpoint.load`` path as ``train``
    does (it printed a plan), and says what train would do with a previous run."""
    assert main(["plan", DIGITS, f"checkpoint.load={tmp_path}/missing"]) == 2
    assert "checkpoint.load=" in _one_line(capsys.readouterr().err)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')
    assert main(["plan", DIGITS, f"log.dir={tmp_path}"]) == 0
    assert "train would refuse" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").is_file()


def test_item5_explicit_load_below_newer_checkpoints_refuses_or_moves_them(tmp_path, capsys):
    """Item 5: ``checkpoint.load=<iter_4>`` into a checkpoint.dir holding iter_8 (and
    ``latest`` = 8): its first save would move ``latest`` backwards. Refused with one line
    naming the newer folder; with ``train.overwrite=true`` iter_8 and ``latest`` move
    aside and iter_4 stays."""
    from mimotron.run_dir import prepare_run_dir

    ckpt = tmp_path / "ckpt"
    older = _checkpoint(ckpt, 4)
    _checkpoint(ckpt, 8)
    write_latest(ckpt, 8)
    args = [*TINY, f"log.dir={tmp_path}", f"checkpoint.dir={ckpt}", f"checkpoint.load={older}",
            "train.iters=10"]  # Left to train after iteration 4.
    with pytest.raises(ValueError, match=r"iter_0000008.*train\.overwrite=true"):
        prepare_run_dir(load_config(DIGITS, args))
    assert (ckpt / "iter_0000008").is_dir() and (ckpt / "latest").is_file()
    prepare_run_dir(load_config(DIGITS, [*args, "train.overwrite=true"]))
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("previous-")) == [
        "iter_0000004"]
    (moved,) = [p for p in tmp_path.rglob("previous-*") if p.is_dir()]
    assert (moved / "ckpt" / "iter_0000008").is_dir() or (moved / "iter_0000008").is_dir()
    assert "moved" in capsys.readouterr().err
    prepare_run_dir(load_config(DIGITS, args))  # nothing newer left: resumes quietly
