"""Resharding: a checkpoint written by one layout resumes in any other.

Saved non-colocated (vision DP 2 with a sharded optimizer | audio | language TP 2, 5
ranks) after 4 of 20 iterations; resumed in vision DP 1 | audio | language PP 2 x DP 2
(6 ranks) and colocated DP 2 (2 ranks). fp32 training is layout independent
(docs/design.md, "The parity contract"), so every run must follow the one-process
reference within 1e-4 relative, before and after the move. The TP-sharded checkpoint
also exports to the same full weights as the reference's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mimotron.checkpoint import read_full_model, read_latest
from mimotron.forked_ranks import run_ranks
from tests.common import RESUMING, colocated_plain
from tests.parity import assert_records_follow, train, training_records


def _noncolocated(**modules: dict[str, int]) -> list[str]:
    """Blocks vision | audio | language in that order, every degree set explicitly."""
    out, offset = [], 0
    for name in ("vision", "audio", "language"):
        par = {"data": 1, "tensor": 1, "pipeline": 1, **modules.get(name, {})}
        out += [f"modules.{name}.parallel.{k}={v}" for k, v in par.items()]
        out.append(f"modules.{name}.parallel.rank_offset={offset}")
        offset += par["data"] * par["tensor"] * par["pipeline"]
    return out


COMMON = RESUMING
# 5 ranks; vision's optimizer state is sharded over its DP group (ZeRO-1), so the
# resumed runs also load sharded state into unsharded optimizers.
SAVED = _noncolocated(vision={"data": 2}, language={"tensor": 2}) + [
    "modules.vision.parallel.shard_optimizer=true"
]
RESUMED = {
    "vision-dp1-language-pp2-dp2": (_noncolocated(language={"pipeline": 2, "data": 2}), 6),
    "colocated-dp2": (colocated_plain(2), 2),
}
SAVE_AT, STOP_AT = 4, 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The one-process reference (saves at 4, stops at 7) and the 5-rank saved run."""
    tmp = tmp_path_factory.mktemp("reshard")
    run_ranks(
        1,
        train,
        COMMON
        + colocated_plain(1)
        + [
            f"log.dir={tmp}/ref",
            f"checkpoint.dir={tmp}/ref/ckpt",
            f"checkpoint.interval={SAVE_AT}",
            f"train.exit_interval={STOP_AT}",
        ],
        timeout_s=120,
    )
    run_ranks(
        5,
        train,
        COMMON
        + SAVED
        + [
            f"log.dir={tmp}/saved",
            f"checkpoint.dir={tmp}/saved/ckpt",
            f"train.exit_interval={SAVE_AT}",
        ],
        timeout_s=240,
    )
    return {"ref": tmp / "ref", "saved": tmp / "saved"}


def test_saved_layout_follows_reference(runs):
    saved = training_records(runs["saved"])
    assert [r["iteration"] for r in saved] == list(range(1, SAVE_AT + 1))
    assert read_latest(runs["saved"] / "ckpt") == SAVE_AT
    assert_records_follow(saved, training_records(runs["ref"]))


def test_each_rank_writes_its_shards_and_replicas_once(runs):
    md = FileSystemReader(str(runs["saved"] / "ckpt" / f"iter_{SAVE_AT:07d}")).read_metadata()
    chunks = {
        k: len(v.chunks)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    # Replicated over vision's 2 DP ranks: one copy. TP-sharded / ZeRO-sharded: 2 shards.
    assert chunks["model.modality_submodules.vision.encoder.pos_embed"] == 1
    assert chunks["model.language_model.layers.0.attn.wq.weight"] == 2
    assert chunks["optimizer.vision.state.encoder.pos_embed.exp_avg"] == 2
    assert chunks["optimizer.language.state.layers.0.attn.wq.weight.exp_avg"] == 2


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_resume_in_another_layout(runs, tmp_path, capfd, name):
    layout, world = RESUMED[name]
    run_ranks(
        world,
        train,
        COMMON
        + layout
        + [
            f"log.dir={tmp_path}",
            f"checkpoint.dir={tmp_path}/ckpt",
            f"checkpoint.load={runs['saved'] / 'ckpt'}",
            f"train.exit_interval={STOP_AT}",
        ],
        timeout_s=240,
    )
    got = training_records(tmp_path)
    assert [r["iteration"] for r in got] == list(range(SAVE_AT + 1, STOP_AT + 1))
    assert_records_follow(got, training_records(runs["ref"]))
    assert "RNG state was re-derived" in capfd.readouterr().out
    assert read_latest(tmp_path / "ckpt") == STOP_AT


def test_tensor_parallel_checkpoint_exports_full_weights(runs):
    """DCP assembles the TP shards: same names, shapes and (within fp32 noise) values."""
    tp, _ = read_full_model(runs["saved"] / "ckpt")
    ref, meta = read_full_model(runs["ref"] / "ckpt" / f"iter_{SAVE_AT:07d}")
    assert meta["iteration"] == SAVE_AT and sorted(tp) == sorted(ref)
    for name, value in ref.items():
        assert tp[name].shape == value.shape, name
        torch.testing.assert_close(tp[name], value, rtol=1e-4, atol=1e-6, msg=name)
