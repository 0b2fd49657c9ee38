"""An expert-parallel checkpoint resumes with another EP degree.

Expert parameters are DTensors ``Shard(0)`` over the ``ep`` axis with the global shape
``[E, ...]`` under their layout-independent names, and so is their Adam state; DCP
reshards both. The straight run (every module colocated on 4 ranks, language EP 2 x
expt_dp 2, its optimizer state sharded: dense rows over DP 4, expert rows over expt_dp 2)
saves at iteration 5 and goes on to 10; resumes from its iteration-5 checkpoint with
EP 1 (one rank, unsharded), EP 4 (4 ranks, expert rows over expt_dp 1) and EP 2 x
expert TP 2 (experts also split along their width) must continue
its losses and grad norms within 1e-4 — the first resumed step included, which needs
the optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.forked_ranks import run_ranks
from tests.common import BASE, colocated, par
from tests.moe import MOE
from tests.parity import assert_records_follow, train, training_records

SAVE_AT, STOP_AT = 5, 10
COMMON = BASE + MOE + [
    "eval.iters=1", "log.interval=1", "log.progress=false", "checkpoint.load=auto",
    f"train.iters={STOP_AT}",
]
ZERO = ["modules.language.parallel.shard_optimizer=true"]
RESUMED = {"ep1": (colocated(1), 1),
           "ep4-zero": (colocated(4) + par("language", expert=4) + ZERO, 4),
           "ep2-etp2": (colocated(4) + par("language", expert=2, expert_tensor=2), 4)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("moe_resume")
    run_ranks(4, train, COMMON + colocated(4) + par("language", expert=2) + ZERO + [
        f"log.dir={tmp}", f"checkpoint.dir={tmp}/ckpt", f"checkpoint.interval={SAVE_AT}",
    ], timeout_s=240)
    return tmp


def test_experts_are_saved_in_global_shape_by_their_shards(straight):
    md = FileSystemReader(str(straight / "ckpt" / f"iter_{SAVE_AT:07d}")).read_metadata()
    tensors = {k: v for k, v in md.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    name = "model.language_model.layers.0.mlp.experts.w1"
    assert tuple(tensors[name].size)[0] == 4  # all experts, global indices
    assert len(tensors[name].chunks) == 2  # one shard per EP rank, expt_dp copies once
    # ZeRO-1: each of the 4 ranks writes its rows of its EP shard's Adam state.
    assert len(tensors[f"optimizer.language.state.{name[len('model.language_model.'):]}"
                       ".exp_avg"].chunks) == 4


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_with_another_expert_degree(straight, tmp_path, name):
    layout, world = RESUMED[name]
    run_ranks(world, train, COMMON + layout + [
        f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt",
        f"checkpoint.load={straight / 'ckpt' / f'iter_{SAVE_AT:07d}'}",
    ], timeout_s=240)
    got = training_records(tmp_path)
    assert [r["iteration"] for r in got] == list(range(SAVE_AT + 1, STOP_AT + 1))
    assert_records_follow(got, training_records(straight), 1e-4, lr_rel=None, same=())
