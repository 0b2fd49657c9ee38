"""Fine-tune loading: ``checkpoint.pretrained`` starts a new run from another run's weights.

One stage-1 run (projectors only; one rank, 6 iterations, saved every 2) is shared:

* stage 2 (towers still frozen, the language model trains) from its final checkpoint or
  its ``mimotron export`` folder sets up with exactly those weights in another layout
  and precision (vision FSDP2, language ZeRO-1 with bf16 weights and fp32 masters), no
  optimizer state and schedules at 0; on colocated DP 2 with language TP 2 it starts at
  iteration 1 and trains like the plain loop started from those weights with a fresh
  AdamW;
* keeping the optimizer state and the schedule (``pretrained_optimizer``,
  ``pretrained_schedule``) continues like a resume: iterations 5-6 from the checkpoint
  at 4, in a new log.dir, equal the stage-1 run's bitwise; a relaunch then resumes the
  new run's own checkpoint;
* refusals before any rank starts: a checkpoint of another run that already reached
  train.iters (``checkpoint.load``, or ``pretrained`` with its schedule), and a
  ``pretrained`` inside the run's own checkpoint.dir.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mimotron.checkpoint.export import export_checkpoint, read_full_model
from mimotron.cli.main import main
from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.run_dir import describe_run_dir
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, DIGITS, ONE_RANK, _full, coloc, colocated
from tests.parity import (
    PARITY,
    RECORD_FIELDS,
    assert_matches_reference,
    engine_results,
    train,
    training_records,
)
from tests.reference import frozen, reference_run

STAGE1 = ["modules.vision.freeze=encoder", "modules.audio.freeze=encoder",
          "modules.language.freeze=true"]
STAGE2 = ["modules.vision.freeze=encoder", "modules.audio.freeze=encoder"]
LOOP = ["log.interval=1", "log.progress=false", "eval.iters=1", "checkpoint.load=auto"]
STAGE1_RUN = [*ONE_RANK, *STAGE1, *LOOP, "train.iters=6", "checkpoint.interval=2"]
TP2 = coloc({"data": 2}, {"data": 2}, {"tensor": 2, "data": 1})
NUM_ITERS = 10


@pytest.fixture(scope="module")
def stage1(tmp_path_factory) -> dict[str, Any]:
    """The stage-1 run: records, its checkpoints (2, 4, 6) and final weights."""
    log_dir = tmp_path_factory.mktemp("stage1")
    run_ranks(1, train, [*BASE, *STAGE1_RUN, f"log.dir={log_dir}"], timeout_s=240)
    root = log_dir / "checkpoints"
    weights, _ = read_full_model(root)
    return {"records": training_records(log_dir, RECORD_FIELDS), "root": root,
            "weights": weights,
            "iter4": root / "iter_0000004", "iter6": root / "iter_0000006"}


def _loaded(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """What a fresh set-up holds after loading ``checkpoint.pretrained``: full weights,
    the full fp32 masters of ZeRO-1 modules, and how much optimizer state exists."""
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    masters = run.optimizer.master_weights()
    return {"weights": {n: _full(p.detach()) for n, p in run.model.named_parameters()},
            "masters": {n: _full(masters[id(p)]) for n, p in run.model.named_parameters()
                        if id(p) in masters},
            "optimizer_state": sum(len(i.optimizer.state) for i in
                                   run.optimizer.module_infos.values() if i.is_active),
            "schedule_steps": {n: s.num_steps for n, s in run.schedulers.items()},
            "iteration": run.global_state.train_state.iteration,
            "consumed": run.global_state.train_state.consumed_samples}


def test_stage2_starts_from_stage1_weights_fresh_and_trains_like_the_plain_loop(
        stage1, tmp_path):
    export = tmp_path / "export"
    export_checkpoint(stage1["root"], export)
    # Weights only, into another layout and precision: vision FSDP2, language ZeRO-1 with
    # bf16 weights and fp32 masters, DP 2.
    base = [*colocated(2), *STAGE2, f"log.dir={tmp_path / 'probe'}", "train.precision=bf16",
            "modules.vision.parallel.fsdp=true", "modules.language.parallel.shard_optimizer=true"]
    want = stage1["weights"]
    for source in (stage1["root"].parent, export):  # a run's checkpoints, an export
        for got in run_ranks(2, _loaded, [*base, f"checkpoint.pretrained={source}"],
                             timeout_s=240):
            assert got["weights"].keys() == want.keys()
            for name, w in got["weights"].items():
                assert torch.equal(w, want[name].to(w.dtype)), name
            assert got["masters"] and all(torch.equal(m, want[n])
                                          for n, m in got["masters"].items())
            assert got["optimizer_state"] == 0 and got["iteration"] == got["consumed"] == 0
            assert set(got["schedule_steps"].values()) == {0}

    # Stage 2 on another layout (language TP 2), from the export folder.
    layout = [*TP2, f"log.dir={tmp_path / 'stage2'}", f"checkpoint.pretrained={export}"]
    results = engine_results(PARITY + layout + STAGE2, NUM_ITERS, world=2)
    ref = reference_run(tuple(PARITY + STAGE2), NUM_ITERS, start_from=stage1["weights"])
    assert_matches_reference(results, ref, {"vision", "audio", "language"})
    cfg = load_config(DIGITS, BASE + STAGE2)
    for name, want in stage1["weights"].items():  # the towers: stage 1's, bitwise
        final = next(r["weights"][name] for r in results if name in r["weights"])
        assert torch.equal(final, want) == frozen(cfg, name), name


def test_keeping_optimizer_and_schedule_continues_like_a_resume(stage1, tmp_path):
    new = [*STAGE1_RUN, f"log.dir={tmp_path}", f"checkpoint.pretrained={stage1['iter4']}",
           "checkpoint.pretrained_optimizer=true", "checkpoint.pretrained_schedule=true"]
    run_ranks(1, train, [*BASE, *new], timeout_s=240)
    # Iterations 5 and 6, bitwise.
    assert training_records(tmp_path, RECORD_FIELDS) == stage1["records"][4:]
    weights, meta = read_full_model(tmp_path / "checkpoints")
    assert meta["iteration"] == 6
    assert all(torch.equal(w, stage1["weights"][n]) for n, w in weights.items())
    # Relaunched, the new run resumes its own checkpoint; pretrained is not read again.
    again = load_config(DIGITS, BASE + [*new, "train.iters=8"])
    assert describe_run_dir(again) == f"resumes from {tmp_path / 'checkpoints' / 'iter_0000006'}"


def test_refusals_come_before_any_rank_starts(stage1, tmp_path, capsys):
    finished = str(stage1["iter6"])
    cases = {
        # Another run's finished checkpoint resumed with train.iters already reached.
        "load": ([f"checkpoint.load={finished}"], "nothing to train: iteration 6 already "
                 "reached"),
        "schedule": ([f"checkpoint.pretrained={finished}",
                      "checkpoint.pretrained_schedule=true"],
                     "nothing to train: iteration 6 already reached"),
        # A checkpoint.dir holding the source (one level up: nothing to resume there).
        "inside": ([f"checkpoint.pretrained={stage1['iter4']}",
                    f"checkpoint.dir={stage1['root'].parent}"],
                   "lies inside this run's checkpoint.dir"),
    }
    for name, (extra, message) in cases.items():
        log_dir = tmp_path / name
        args = [DIGITS, *BASE, *STAGE1_RUN, f"log.dir={log_dir}", *extra]
        assert main(["train", *map(str, args)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (name, err)
        assert not log_dir.exists() or not any(log_dir.rglob("*.jsonl")), name
    args = [DIGITS, *BASE, *STAGE1_RUN, f"log.dir={tmp_path / 'plan'}",
            f"checkpoint.pretrained={stage1['root']}"]
    assert main(["plan", *map(str, args)]) == 0
    assert f"starts fresh in {tmp_path / 'plan'} from the weights of {stage1['iter6']}" in (
        capsys.readouterr().out)
