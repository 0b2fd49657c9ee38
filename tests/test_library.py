"""Library use: ``train_mimo`` driven by a user's forward step (the example of docs/operations.md).

The test runs ``examples/custom_forward_step.py`` verbatim as ``__main__`` on four forked
ranks (the digits layout: vision | audio | language data-parallel over two ranks), with a
tiny model.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

from mimotron.forked_ranks import run_ranks
from tests.common import SMALL_MODEL

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_forward_step.py"
TINY = [
    *SMALL_MODEL,
    "eval.iters=1", "log.interval=1", "train.iters=3",
]


def _run_example(rank: int, world: int, argv: list[str]) -> None:
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


def test_custom_forward_step_reports_its_auxiliary_losses(tmp_path, capfd):
    run_ranks(4, _run_example, TINY + [f"log.dir={tmp_path}"], timeout_s=180)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3]
    weight = runpy.run_path(str(EXAMPLE))["Z_LOSS_WEIGHT"]
    for rec in train:
        # Both language replicas' micro-batches are in the sums, as in the logged loss.
        assert rec["z_loss"] > 0 and rec["lm_loss"] > 0
        assert rec["loss"] == pytest.approx(rec["lm_loss"] + weight * rec["z_loss"], rel=1e-5)
        assert 0.0 <= rec["train_accuracy"] <= 1.0
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert any("eval_accuracy" in r for r in records)
    assert "final loss" in capfd.readouterr().out
