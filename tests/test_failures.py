"""Root-cause attribution: the harness names the rank that failed first, not a collateral one.

A rank blocked in a collective on a peer that raised or died fails too ("Connection
closed by peer"); whichever report reaches the parent first is a matter of scheduling.
These tests check that the error always names the root cause: the rank that raised, the
rank killed by a signal, or, of two genuine errors, the one recorded first (the order is
forced through the failure records, not with sleeps). The CLI launcher's side is in
``tests/test_launch.py``.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch.distributed as dist

from mimotron.checkpoint.files import CheckpointError
from mimotron.failures import (
    DEATH_WINDOW_S,
    FAILURE_DIR_ENV,
    FailureRecord,
    consequence_note,
    is_peer_loss,
    read_failures,
    record_failure,
    root_cause,
)
from mimotron.forked_ranks import RankError, run_groups, run_ranks

COLLATERAL = r"(failed as a consequence: peer lost|stopped as a consequence)"


# ---- classification and ordering (no processes) ------------------------------------------


def test_peer_loss_is_recognised_through_wrapping_errors():
    try:
        try:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as inner:
            raise CheckpointError("saving iteration 3 failed") from inner
    except CheckpointError as exc:
        assert is_peer_loss(exc)
    assert is_peer_loss(dist.DistBackendError("anything"))
    assert not is_peer_loss(ValueError("bad shape"))
    assert not is_peer_loss(CheckpointError("manifest.json is missing"))


def test_records_get_distinct_increasing_sequence_numbers(tmp_path):
    written = [record_failure(tmp_path, r, "error", f"rank {r}") for r in (2, 0, 1)]
    assert [w.seq for w in written] == [0, 1, 2]
    assert [r.rank for r in read_failures(tmp_path)] == [2, 0, 1]
    assert record_failure(None, 0, "error", "not recorded") is None


def test_root_cause_prefers_own_errors_and_deaths_over_earlier_peer_losses():
    peer, error, died = (FailureRecord(0, 0, "peer", "Connection closed by peer"),
                         FailureRecord(1, 1, "error", "ValueError: boom"),
                         FailureRecord(2, 2, "died", "killed by signal SIGKILL"))
    assert root_cause([peer, died, error]) == error
    assert root_cause([peer, died]) == died
    assert root_cause([peer]) == peer and root_cause([]) is None
    note = consequence_note([peer, error, died], error, stopped=[3])
    assert note == (" (rank 0 failed as a consequence: peer lost; rank 2 also failed, "
                    "later; rank 3 stopped as a consequence)")


def test_a_death_seen_late_beats_a_connection_error_it_caused():
    """Rank 2 was SIGKILLed; rank 0's error about the lost connection was not recognised as
    a peer loss and was recorded before the launcher's poll saw the death. The death is
    the root cause when it follows within DEATH_WINDOW_S and the error names a
    connection; an unrelated error, or a death much later, keeps the first record."""
    t = 1000.0
    unrecognised = FailureRecord(0, 0, "error", "RuntimeError: [gloo] socket recv failed",
                                 1, t)
    died = FailureRecord(1, 2, "died", "killed by signal SIGKILL", None, t + 0.2)
    assert root_cause([unrecognised, died]) == died
    own = FailureRecord(0, 0, "error", "ValueError: bad batch shape", 1, t)
    assert root_cause([own, died]) == own
    late = FailureRecord(1, 2, "died", "killed by signal SIGKILL", None,
                         t + DEATH_WINDOW_S + 1)
    assert root_cause([unrecognised, late]) == unrecognised


# ---- the harness ----------------------------------------------------------------------------


def _raise_while_peer_blocks(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1's own error")
    dist.barrier()  # Rank 0 waits on rank 1, which never arrives: connection closed.


def test_own_error_is_named_not_the_rank_blocked_on_it():
    with pytest.raises(RankError) as info:
        run_ranks(2, _raise_while_peer_blocks, timeout_s=120)
    message = str(info.value)
    assert message.startswith("rank 1 failed: ValueError: rank 1's own error"), message
    assert "_raise_while_peer_blocks" in message  # its traceback
    assert re.search(rf"rank 0 {COLLATERAL}", message.splitlines()[0])


def _killed_while_peers_block(rank: int, world: int) -> None:
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_rank_killed_by_a_signal_is_named():
    with pytest.raises(RankError) as info:
        run_ranks(3, _killed_while_peers_block, timeout_s=120)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 2 failed: killed by signal SIGKILL"), first
    note = first.partition(" (")[2]  # both blocked ranks are named as collateral
    assert re.fullmatch(rf"(ranks? [01](, [01])? {COLLATERAL}(; )?)+\)", note), first
    assert "0" in note and "1" in note, first


def _wait_for_record(rank: int, deadline_s: float = 60.0) -> None:
    """Poll the failure records until ``rank`` has one (a hang guard, not a timing check)."""
    directory = os.environ[FAILURE_DIR_ENV]
    deadline = time.monotonic() + deadline_s
    while not any(r.rank == rank for r in read_failures(directory)):
        assert time.monotonic() < deadline, f"rank {rank} never recorded its failure"
        time.sleep(0.01)


def _two_genuine_errors(rank: int, world: int, first: int) -> None:
    if rank != first:
        _wait_for_record(first)
    raise RuntimeError(f"genuine error on rank {rank}")


@pytest.mark.parametrize("first", [1, 0])
def test_of_two_genuine_errors_the_first_is_named(first):
    with pytest.raises(RankError) as info:
        run_ranks(2, _two_genuine_errors, first, timeout_s=120)
    line = str(info.value).splitlines()[0]
    assert line.startswith(f"rank {first} failed: RuntimeError: genuine error on rank "
                           f"{first}"), line
    other = 1 - first
    assert f"rank {other} also failed, later" in line or \
           f"rank {other} stopped as a consequence" in line, line


def _rank_and_world(rank: int, world: int, fail: bool) -> tuple[int, int]:
    if fail:
        raise ValueError(f"group of {world} failed on rank {rank}")
    return rank, world


def test_groups_run_side_by_side_keep_their_own_results_and_errors():
    """``run_groups``: each group has its own world; a failing group is named as such."""
    assert run_groups([(1, _rank_and_world, (False,), {}),
                       (2, _rank_and_world, (False,), {})]) == [[(0, 1)], [(0, 2), (1, 2)]]
    with pytest.raises(RankError, match=r"rank \d failed: ValueError: group of 2 failed"):
        run_groups([(1, _rank_and_world, (False,), {}), (2, _rank_and_world, (True,), {})])
