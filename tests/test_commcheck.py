"""The NCCL-rules replay (``mimotron.commcheck``): it finds the hangs gloo hides.

The recorded fixture ``data/demo_trace_buffered_sends.json.gz`` is one training step of
the demo layout (vision on rank 0, audio on rank 1, language DP 2 on ranks 2-3) as the
transfer layer issued it before it grouped its operations: every receive posted ahead
and every operation a single ``isend``/``irecv``. gloo ran it; the replay must show that
NCCL would not, naming the ranks and the operations at the heads of their streams. The
hand-written traces pin each rule; the live runs record real gloo ranks through the
harness and check the verdict end to end.
"""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mimotron.commcheck import replay
from mimotron.commcheck.record import CommRecorder
from mimotron.forked_ranks import NCCL_CHECK_ENV, NcclDeadlockError, RankError, run_ranks

FIXTURE = Path(__file__).parent / "data" / "demo_trace_buffered_sends.json.gz"
WORLD = {"0": [0, 1]}


class _Trace:
    """Builds one rank's trace by hand, in the recorder's format."""

    def __init__(self, rank: int) -> None:
        self.rank, self.events, self._id = rank, [], 0

    def _add(self, thread: str = "MainThread", **ev: object) -> int:
        self._id += 1
        self.events.append({**ev, "id": self._id, "thread": thread})
        return self._id

    def p2p(self, kind: str, peer: int, batch: int | None = None, nbytes: int = 4,
            group: str = "0") -> int:
        return self._add(op="p2p", kind=kind, peer=peer, batch=batch, group=group,
                         nbytes=nbytes)

    def coll(self, name: str, group: str = "0", thread: str = "MainThread") -> int:
        return self._add(op="coll", name=name, group=group, thread=thread)

    def wait(self, *ids: int, thread: str = "MainThread") -> None:
        self.events.append({"op": "wait", "ids": list(ids), "thread": thread})

    def dump(self, groups: dict[str, list[int]] = WORLD) -> dict:
        return {"rank": self.rank, "groups": groups, "events": self.events}


def _pair() -> tuple[_Trace, _Trace]:
    return _Trace(0), _Trace(1)


# ---- the recorded hazard -------------------------------------------------------------------
def test_the_demo_step_with_receives_posted_ahead_deadlocks() -> None:
    traces = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    report = replay(traces)
    assert not report.ok
    lines = report.text.splitlines()
    assert lines[0] == "deadlock under NCCL's rules:"
    # Vision (rank 0) waits for its gradient from the language model before its
    # activation went out; the language ranks wait for that activation.
    assert "rank 0 (MainThread) blocked at event 11 waiting for [recv from 2 (64 B)]" in lines
    assert "rank 2 (MainThread) blocked at event 3 waiting for [recv from 0 (64 B)]" in lines
    assert any(ln.startswith("rank 0 stream ('pair', '0', 2): head [recv from 2")
               and "queued" in ln for ln in lines)


# ---- rules, one by one ---------------------------------------------------------------------
def test_crossing_single_sends_deadlock_but_one_batch_each_passes() -> None:
    a, b = _pair()
    for me, peer in ((a, 1), (b, 0)):  # each sends, then waits for its receive
        me.p2p("send", peer)
        me.wait(me.p2p("recv", peer))
    report = replay([a.dump(), b.dump()])
    assert not report.ok and "rank 0 stream ('pair', '0', 1): head [send to 1" in report.text
    a, b = _pair()
    for me, peer in ((a, 1), (b, 0)):
        s, r = me.p2p("send", peer, batch=1), me.p2p("recv", peer, batch=1)
        me.wait(s, r)
    assert replay([a.dump(), b.dump()]).ok


def test_receive_then_send_on_one_stream_waits_for_the_peer() -> None:
    """A receive posted first holds back this rank's send to the same peer."""
    a, b = _pair()
    r = a.p2p("recv", 1)
    a.p2p("send", 1)
    a.wait(r)
    b.wait(b.p2p("recv", 0))  # b waits for a's send first: a's receive never starts
    b.p2p("send", 0)
    report = replay([a.dump(), b.dump()])
    assert not report.ok
    assert "rank 1 (MainThread) blocked at event 1 waiting for [recv from 0 (4 B)]" \
        in report.text


def test_batched_and_single_ops_never_pair() -> None:
    a, b = _pair()
    a.wait(a.p2p("send", 1, batch=1))
    b.wait(b.p2p("recv", 0))
    assert not replay([a.dump(), b.dump()]).ok


def test_collectives_in_different_orders_deadlock() -> None:
    groups = {"0": [0, 1], "g1": [0, 1]}
    a, b = _pair()
    a.coll("all_reduce", "0")
    a.wait(a.coll("all_reduce", "g1"))
    b.wait(b.coll("all_reduce", "g1"))
    b.wait(b.coll("all_reduce", "0"))
    # Different groups are different streams: this order is fine...
    assert replay([a.dump(groups), b.dump(groups)]).ok
    a, b = _pair()
    a.wait(a.coll("all_reduce"))
    b.wait(b.coll("broadcast"))
    report = replay([a.dump(), b.dump()])
    assert not report.ok and "differs between ranks" in report.text
    a, b = _pair()  # ...but a batched send is queued behind its group's collective
    a.coll("all_reduce")
    a.wait(a.p2p("send", 1, batch=1))
    b.wait(b.p2p("recv", 0, batch=1))
    b.wait(b.coll("all_reduce"))
    assert not replay([a.dump(), b.dump()]).ok


def test_byte_counts_must_agree() -> None:
    a, b = _pair()
    a.wait(a.p2p("send", 1, batch=1, nbytes=8))
    b.wait(b.p2p("recv", 0, batch=1, nbytes=4))
    report = replay([a.dump(), b.dump()])
    assert not report.ok and "sends 8 B to rank 1, which recvs 4 B" in report.text


def test_threads_are_hosts_of_their_own() -> None:
    """A background thread's wait does not stop the main thread."""
    groups = {"0": [0, 1], "save": [0, 1]}
    a, b = _pair()
    a.coll("barrier", "save", thread="saver")
    a.wait(a.coll("all_reduce"))
    b.wait(b.coll("all_reduce"))
    b.wait(b.coll("barrier", "save", thread="saver"), thread="saver")
    assert replay([a.dump(groups), b.dump(groups)]).ok


def test_an_unmatched_send_is_reported_at_the_end() -> None:
    a, b = _pair()
    a.p2p("send", 1, batch=1)
    b.coll("barrier")
    a.coll("barrier")
    report = replay([a.dump(), b.dump()])
    assert not report.ok and "head batch [send to 1 (4 B)]" in report.text


# ---- live: recorded from gloo ranks by the harness -------------------------------------
def _posted_ahead(rank: int, world: int) -> None:
    """Each rank posts its receive before its send, then waits: fine on gloo."""
    peer = 1 - rank
    got = torch.empty(4)
    work = dist.irecv(got, peer)
    dist.isend(torch.full((4,), float(rank)), peer).wait()
    work.wait()
    assert got[0].item() == peer


def _grouped(rank: int, world: int) -> None:
    peer, got = 1 - rank, torch.empty(4)
    ops = [dist.P2POp(dist.distributed_c10d.isend, torch.full((4,), float(rank)), peer),
           dist.P2POp(dist.distributed_c10d.irecv, got, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got[0].item() == peer


def test_the_harness_fails_a_run_that_would_hang_on_nccl(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv(NCCL_CHECK_ENV, "1")
    stuck = r"rank 0 \(MainThread\) blocked at event 2 waiting for \[send to 1"
    with pytest.raises(NcclDeadlockError, match=stuck):
        run_ranks(2, _posted_ahead, timeout_s=60)
    run_ranks(2, _grouped, timeout_s=60)


def _two_threads_on_one_group(rank: int, world: int) -> None:
    """A background thread's all-reduce while the main thread's is still in flight."""
    work = dist.all_reduce(torch.ones(1), async_op=True)
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)), name="saver")
    thread.start()
    thread.join()
    work.wait()


def _handed_over(rank: int, world: int) -> None:
    """The main thread's op ends before the background thread uses the group."""
    dist.all_reduce(torch.ones(1))
    thread = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)), name="saver")
    thread.start()
    thread.join()


def test_one_group_from_two_threads_at_once_is_reported(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv(NCCL_CHECK_ENV, "1")
    with pytest.raises(NcclDeadlockError, match="thread saver issues all_reduce on group 0 "
                       "while thread MainThread has ops in flight there"):
        run_ranks(2, _two_threads_on_one_group, timeout_s=60)
    run_ranks(2, _handed_over, timeout_s=60)


def _trained_with_and_without_recorder(rank: int, world: int) -> dict:
    """Two identical training runs on this rank, the second under a recorder."""
    from tests.common import engine_run, noncolocated

    layout = noncolocated({}, {}, {"data": 2})  # bridges (p2p) and DP collectives
    plain = engine_run(rank, world, layout, 2)
    rec = CommRecorder(rank)
    original = dist.isend
    rec.install()
    try:
        assert dist.isend is not original and dist.isend.__name__ == "isend"
        recorded = engine_run(rank, world, layout, 2)
    finally:
        rec.uninstall()
    assert dist.isend is original
    kinds = {ev.get("kind", ev.get("name")) for ev in rec.events if ev["op"] != "wait"}
    return {"plain": plain, "recorded": recorded, "kinds": kinds}


def test_the_recorder_observes_without_changing_results(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv(NCCL_CHECK_ENV, raising=False)  # the harness records nothing itself
    for rank, r in enumerate(run_ranks(4, _trained_with_and_without_recorder, timeout_s=120)):
        # It saw the run's transfers and collectives ...
        assert {"send", "recv", "all_reduce"} <= r["kinds"], (rank, r["kinds"])
        # ... and every loss, gradient and weight is bitwise what the unrecorded run made.
        plain, recorded = r["plain"], r["recorded"]
        assert recorded["steps"] == plain["steps"], rank
        assert recorded["grad_sq"] == plain["grad_sq"], rank
        assert recorded["weights"].keys() == plain["weights"].keys(), rank
        for name, w in plain["weights"].items():
            assert torch.equal(recorded["weights"][name], w), (rank, name)


# ---- a hang on gloo, named from the ranks' traces -----------------------------------------
def _skips_a_collective(rank: int, world: int) -> None:
    """Rank 1 skips the second all-reduce on the group of ranks 0 and 1 (as a rank without
    images once skipped its FSDP backward) and goes on to the world's barrier."""
    pair = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(1))
    if rank < 2:
        dist.all_reduce(torch.ones(1), group=pair)
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=pair)
    dist.barrier()


def _never_sent(rank: int, world: int, both: bool) -> None:
    """Rank 0 waits for a message rank 1 never sends (a skipped bridge transfer); with
    ``both``, rank 1 waits likewise for one from rank 0."""
    if rank == 0 or both:
        dist.irecv(torch.empty(4), 1 - rank).wait()


def test_a_skipped_collective_is_named_when_the_ranks_time_out(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    monkeypatch.setenv(NCCL_CHECK_ENV, "1")
    with pytest.raises(RankError) as err:
        run_ranks(3, _skips_a_collective, timeout_s=60, pg_timeout_s=3)
    lines = str(err.value).splitlines()
    assert lines[0] == "ranks hang: their communication diverges"
    # The cause first (rank 0 waits for rank 1, which waits for rank 0), then rank 2.
    assert lines[1] == ("rank 0 waits in all_reduce #2 of group 1 (ranks [0, 1]) for ranks "
                        "[1] (rank 1 issued 1 there)")
    assert lines[2] == ("rank 1 waits in barrier #2 of group 0 (ranks [0, 1, 2]) for ranks "
                        "[0] (rank 0 issued 1 there)")
    assert lines[3] == ("rank 2 waits in barrier #2 of group 0 (ranks [0, 1, 2]) for ranks "
                        "[0] (rank 0 issued 1 there)")


def test_a_receive_never_sent_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """gloo waits for a receive without a timeout: a peer that finished closes the
    connection; peers that both wait are asked for their traces at the deadline."""
    monkeypatch.setenv(NCCL_CHECK_ENV, "1")
    waits = r"rank {} waits in recv #1 from rank {} on group 0 \(ranks \[0, 1\]\) " \
            r"for ranks \[{}\] \(rank {} sent 0\)\n"
    with pytest.raises(RankError, match=r"ranks hang: their communication diverges\n"
                       + waits.format(0, 1, 1, 1) + r"\(traces kept in "):
        run_ranks(2, _never_sent, False, timeout_s=60)
    with pytest.raises(RankError, match=r"ranks hang: their communication diverges\n"
                       + waits.format(0, 1, 1, 1) + waits.format(1, 0, 0, 0)):
        run_ranks(2, _never_sent, True, timeout_s=6)


def test_collectives_that_differ_at_one_index_are_named() -> None:
    """A rank that skipped a unit's gather and reduce-scatter and went on to the next
    collective on the group: the first index where the members differ is named."""
    from mimotron.commcheck.diverge import explain_hang

    a, b = _pair()
    for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
        a.coll(name, group="1")
    b.coll("all_gather_single", group="1")
    b.coll("all_reduce", group="1")
    groups = {**WORLD, "1": [0, 1]}
    text = explain_hang([{**a.dump(groups), "state": "running"},
                         {**b.dump(groups), "state": "running"}])
    assert text == ("collective #2 of group 1 (ranks [0, 1]) differs between ranks: "
                    "rank 0 reduce_scatter_single, rank 1 all_reduce\n"
                    "rank 0 waits in all_reduce #3 of group 1 (ranks [0, 1]) for ranks [1] "
                    "(rank 1 issued 2 there)")
    # Finished ranks wait for nobody, and the same collectives everywhere show nothing.
    assert explain_hang([a.dump(groups), a.dump(groups) | {"rank": 1}]) is None
