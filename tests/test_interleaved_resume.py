"""A checkpoint saved with interleaving resumes without it, and the other way round.

Checkpoints name layers by global index and a rank holding model chunks holds a plain
set of them, so ``virtual_pipeline`` is a schedule choice that checkpoints do not see.
Language model of 4 layers: a one-process reference saves at iteration 2; the layout
``vision | audio | language PP 2 x VP 2`` (4 ranks) trains to 2 and saves; that
checkpoint resumes in ``language PP 2`` (``virtual_pipeline = 1``), and the reference's
resumes in ``PP 2 x VP 2``. Every run follows the reference's loss, grad norm and lr,
and its evaluation (every 2 iterations: the interleaved forward-only plan, chunk after
chunk) gives the reference's eval loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mimotron.checkpoint import read_latest
from mimotron.forked_ranks import run_ranks
from tests.common import RESUMING, colocated_plain, noncolocated
from tests.parity import assert_records_follow, train, training_records

SAVE_AT, ITERS = 2, 4
BASE_RUN = RESUMING + [f"train.iters={ITERS}", "modules.language.num_layers=4",
                     "train.micro_batch_size=4", "eval.interval=2"]
PP2 = noncolocated({}, {}, {"pipeline": 2})
PP2VP2 = noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2})


def _train(world: int, layout: list[str], out: Path, *extra: str) -> list[dict]:
    run_ranks(world, train, BASE_RUN + layout + [f"log.dir={out}", f"checkpoint.dir={out}/ckpt",
                                                *extra], timeout_s=240)
    return training_records(out)


def _eval_losses(out: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["eval_loss"] for r in lines if "eval_loss" in r}


def _assert_evals_follow(out: Path, ref: Path) -> None:
    got, want = _eval_losses(out), _eval_losses(ref)
    assert got, f"{out.name}: no evaluation ran"
    for it, loss in got.items():
        assert loss == pytest.approx(want[it], rel=1e-4), (out.name, it)


def test_virtual_pipeline_checkpoints_load_both_ways(tmp_path):
    ref = _train(1, colocated_plain(1), tmp_path / "ref", f"checkpoint.interval={SAVE_AT}")
    saved = _train(4, PP2VP2, tmp_path / "vp2", f"train.exit_interval={SAVE_AT}")
    assert [r["iteration"] for r in saved] == [1, 2]
    assert read_latest(tmp_path / "vp2" / "ckpt") == SAVE_AT
    assert_records_follow(saved, ref)
    _assert_evals_follow(tmp_path / "vp2", tmp_path / "ref")
    iter_dir = f"iter_{SAVE_AT:07d}"
    for layout, source, name in ((PP2, tmp_path / "vp2", "to-vp1"),
                                 (PP2VP2, tmp_path / "ref", "to-vp2")):
        got = _train(4, layout, tmp_path / name, f"checkpoint.load={source / 'ckpt' / iter_dir}")
        assert [r["iteration"] for r in got] == list(range(SAVE_AT + 1, ITERS + 1)), name
        assert_records_follow(got, ref)
        _assert_evals_follow(tmp_path / name, tmp_path / "ref")
