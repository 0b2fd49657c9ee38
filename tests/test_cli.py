"""The ``mimotron`` command: plan, train (bad config, one rank, two ranks), plot.

``plan`` and config errors run in-process (nothing is launched before validation). The
one-rank ``train`` runs the CLI entry point in a forked rank (it takes the same path as
under ``torchrun``, without paying for a fresh interpreter); the two-rank run goes
through the real launcher in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mimotron.cli.main import main
from mimotron.forked_ranks import run_ranks
from tests.common import ONE_RANK, SMALL_MODEL
from tests.parity import metrics_lines, training_records

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs" / "digits.toml")  # vision | audio | language DP 2: 4 ranks
COLOCATED = str(ROOT / "configs" / "digits_colocated.toml")  # all modules DP 2 on 2 ranks
CONTRACT = ("iteration", "loss", "grad_norm", "lr", "loss_scale", "skipped", "num_zeros",
            "consumed_samples", "tokens_per_second", "step_time_s")
TINY = [
    *SMALL_MODEL,
    "eval.iters=1", "log.interval=1",
]


def test_plan_prints_the_rank_map(capsys):
    assert main(["plan", DIGITS]) == 0
    out = capsys.readouterr().out
    assert "placement: non-colocated, world size 4" in out
    assert "   1  audio       0  0  0  0  first+last" in out
    assert "   3  language    0  0  1  0  first+last" in out
    assert "memory estimate per rank" in out


@pytest.mark.parametrize("command", ["plan", "train"])
@pytest.mark.parametrize("override,names", [
    ("train.iters=0", "train.iters=0"),
    ("modules.audio.parallel.rank_offset=0", "partially overlap modules.audio"),
    ("train.bogus=1", "bogus"),
])
def test_bad_config_exits_2_with_one_line(capsys, command, override, names):
    assert main([command, DIGITS, override]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"mimotron {command}: invalid config:") and names in err
    assert "Traceback" not in captured.err + captured.out


def _cli_rank(rank: int, world: int, argv: list[str]) -> int:
    return main(argv)


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory) -> Path:
    log_dir = tmp_path_factory.mktemp("one_rank")
    argv = ["train", DIGITS, *TINY, *ONE_RANK, "train.iters=3", f"log.dir={log_dir}"]
    assert run_ranks(1, _cli_rank, argv, timeout_s=180) == [0]
    return log_dir


def test_train_one_rank_writes_contract_metrics_and_eval(one_rank_run):
    records = metrics_lines(one_rank_run)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    for rec in train:
        assert all(k in rec for k in CONTRACT), sorted(set(CONTRACT) - set(rec))
    assert len(evals) == 1 and evals[0]["iteration"] == 3
    assert 0.0 <= evals[0]["eval_accuracy"] <= 1.0 and evals[0]["eval_loss"] > 0


def test_plot_writes_non_empty_pngs_comparing_runs(one_rank_run, tmp_path, capsys):
    other = tmp_path / "one_rank"  # Same directory name: labels must still differ.
    other.mkdir()
    (other / "metrics.jsonl").write_text((one_rank_run / "metrics.jsonl").read_text())
    out = tmp_path / "plots"
    assert main(["plot", str(one_rank_run), str(other), "--out", str(out)]) == 0
    names = ("loss.png", "eval.png", "lr.png", "throughput.png")
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    assert capsys.readouterr().out.count("wrote ") == len(names)
    assert main(["plot", str(tmp_path / "missing")]) == 2


def test_train_two_ranks_through_the_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run(
        [sys.executable, "-m", "mimotron", "train", COLOCATED, *TINY, "train.iters=2",
         f"log.dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("placement: colocated, world size 2") == 1  # Banner once.
    assert proc.stdout.count("\nsummary\n") == 1
    assert [r["iteration"] for r in training_records(tmp_path)] == [1, 2]
