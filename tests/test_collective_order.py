"""Colocated ranks issue every group's collectives in the same order, with the same shapes.

A colocated rank runs several modules, each with its own TP/DP groups, plus world
collectives (the bridge, the step's reductions). A rank that issued a collective its
peers did not, or in another order, would hang or — worse — pair unrelated tensors. Under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps every process group so that, before each
collective, the members compare fingerprints (sequence number, op, shapes, dtypes) and
raise on any difference. The layouts below (encoder TP with DP next to a TP or DP
language model, micro-batches small enough that slices are empty) train under that check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimotron.testing import RankError, run_ranks
from tests.common import coloc, engine_run

SMALL_MB = ["train.micro_batch_size=4"]
LAYOUTS = {
    "audio-tp2dp2-language-tp2dp2": coloc({"data": 4}, {"tensor": 2, "data": 2},
                                          {"tensor": 2, "data": 2}),
    "vision-tp2dp2-language-dp4": coloc({"tensor": 2, "data": 2}, {"data": 4}, {"data": 4}),
}


@pytest.fixture
def detail_debug(monkeypatch):
    """Fingerprint checks on every process group created while the fixture is active."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    dist.set_debug_level_from_env()
    yield
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    dist.set_debug_level_from_env()


def _mismatched(rank: int, world: int) -> None:
    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(3 + rank), group=group)


def test_detail_mode_detects_a_mismatch(detail_debug):
    # The check is live: shapes that differ between ranks are reported, not summed.
    with pytest.raises(RankError, match="mismatch between collectives"):
        run_ranks(2, _mismatched, timeout_s=60)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_colocated_collectives_line_up(detail_debug, name):
    results = run_ranks(4, engine_run, LAYOUTS[name] + SMALL_MB, 4, timeout_s=240)
    assert sum(r["empty_encoder_outputs"] for r in results) > 0  # empty slices were run
    assert all(not skipped for r in results for _, _, skipped, _ in r["steps"])
