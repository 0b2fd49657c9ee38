"""Colocated ranks issue every group's collectives in the same order, with the same shapes.

A colocated rank runs several modules, each with its own TP/DP groups, plus world
collectives (the bridge, the step's reductions). A rank that issued a collective its
peers did not, or in another order, would hang or — worse — pair unrelated tensors. Under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps every process group so that, before each
collective, the members compare fingerprints (sequence number, op, shapes, dtypes) and
raise on any difference. The layout below (encoder TP with DP next to a TP language
model and a ZeRO-1 DP encoder, micro-batches small enough that slices are empty,
overlapped gradient reduction and parameter gathers) trains under that check; the
replay under NCCL's rules checks the same property for every multi-rank test.

The step's scalars (token count, found-inf, grad norm and zero slots, loss sums) cost
two world collectives per step; a non-colocated layout, which has no bridge traffic on
the world group, is counted.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mimotron.config import load_config
from mimotron.forked_ranks import RankError, run_ranks
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, DIGITS, coloc, engine_run, noncolocated, train_step

SMALL_MB = ["train.micro_batch_size=4"]
LAYOUTS = {
    # Audio TP 2 x DP 2 beside a TP 2 x DP 2 language model and DP 4 vision, with
    # overlap: buckets launched from gradient hooks (DTensor placements aligned there),
    # ZeRO-1 reduce-scatters in the backward and all-gathers landing in the next forward.
    "overlap-vision-zero-dp4-audio-language-tp2dp2": coloc(
        {"data": 4}, {"tensor": 2, "data": 2}, {"tensor": 2, "data": 2})
    + ["modules.vision.parallel.shard_optimizer=true", "train.grad_bucket_mb=0.01",
       "train.overlap_grad_reduce=true", "train.overlap_param_gather=true"],
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


WORLD_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                     "reduce_scatter_tensor", "all_to_all", "barrier")


def _world_collectives_per_step(rank: int, world: int, overrides: list[str]) -> list[int]:
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    calls: list[str] = []
    for name in WORLD_COLLECTIVES:  # this forked rank only
        original = getattr(dist, name)

        def counting(*args, _original=original, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if kwargs.get("group") in (None, dist.group.WORLD):
                calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    per_step = []
    for _ in range(3):
        before = len(calls)
        train_step(run)
        per_step.append(len(calls) - before)
    return per_step


def test_a_step_costs_two_world_collectives():
    # Token count before the schedule; found-inf, norm/zero slots and loss sums after.
    layout = noncolocated({}, {}, {"data": 2}) + ["modules.language.parallel.shard_optimizer=true"]
    results = run_ranks(4, _world_collectives_per_step, layout, timeout_s=240)
    assert results == [[2, 2, 2]] * 4
