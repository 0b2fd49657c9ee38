"""Layout independence: any valid layout trains like one process (fp32, same seed/data).

Each case trains a few iterations through the real engine (``setup_mimo`` +
``train_step_mimo``) on forked gloo ranks and compares per-iteration loss and global
grad norm with a one-rank run of the same config.
"""

from __future__ import annotations

import pytest

from mimotron.testing import run_ranks
from tests.common import NUM_ITERS, colocated, par, train_steps

_par, _colocated, _train = par, colocated, train_steps


def _reference(extra: list[str] = ()) -> list[tuple]:
    return run_ranks(1, _train, _colocated(1) + list(extra), NUM_ITERS, timeout_s=120)[0]


@pytest.fixture(scope="module")
def reference() -> list[tuple]:
    return _reference()


def _assert_matches(results: list[list[tuple]], ref: list[tuple], rel: float) -> None:
    for rank, res in enumerate(results):
        assert len(res) == len(ref)
        for it, (got, want) in enumerate(zip(res, ref, strict=True)):
            assert got[2] is False and want[2] is False
            assert got[3] == want[3], f"rank {rank} iter {it}: token counts differ"
            assert got[0] == pytest.approx(want[0], rel=rel), f"rank {rank} iter {it} loss"
            assert got[1] == pytest.approx(want[1], rel=rel), f"rank {rank} iter {it} grad norm"


def test_reference_learns(reference):
    losses = [r[0] for r in reference]
    assert losses[-1] < losses[0]
    assert all(r[1] > 0 for r in reference)


@pytest.mark.parametrize("dp", [2, 4])
def test_colocated_data_parallel_matches_one_rank(reference, dp):
    results = run_ranks(dp, _train, _colocated(dp), NUM_ITERS, timeout_s=180)
    _assert_matches(results, reference, rel=1e-5)


def test_micro_batch_size_does_not_change_results(reference):
    results = run_ranks(2, _train, _colocated(2) + ["train.micro_batch_size=4"], NUM_ITERS,
                        timeout_s=180)
    _assert_matches(results, reference, rel=1e-5)


def test_one_microbatch_per_step(reference):
    ref = _reference(["train.micro_batch_size=16"])
    _assert_matches([ref], reference, rel=1e-5)


NONCOLOCATED = {
    "fan-in-vision-dp2-to-language-dp1": (
        _par("vision", data=2, rank_offset=0) + _par("audio", data=1, rank_offset=2)
        + _par("language", data=1, rank_offset=3)),
    "fan-out-encoders-dp1-to-language-dp2": (
        _par("vision", data=1, rank_offset=0) + _par("audio", data=1, rank_offset=1)
        + _par("language", data=2, rank_offset=2)),
}


@pytest.mark.parametrize("name", sorted(NONCOLOCATED))
def test_noncolocated_matches_one_rank(reference, name):
    overrides = NONCOLOCATED[name]
    results = run_ranks(4, _train, overrides, NUM_ITERS, timeout_s=180)
    _assert_matches(results, reference, rel=1e-4)
