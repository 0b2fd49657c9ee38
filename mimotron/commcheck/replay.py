"""Replay recorded communication under NCCL's rules and report deadlocks.

gloo buffers sends, so a CPU run completes orders of communication that hang on GPUs.
This module replays the traces of :mod:`mimotron.commcheck.record` (one per rank) with
NCCL's semantics instead:

* **Rendezvous point-to-point.** A send completes only together with its receive: the
  k-th send from A to B on a channel pairs with the k-th receive on B from A, and both
  must be running at once. Their byte counts must agree.
* **In-order streams.** A single ``isend``/``irecv`` runs on the stream of its
  (process group, peer) pair; a ``batch_isend_irecv`` group runs on the process group's
  own stream (as torch's NCCL backend does: coalesced point-to-point uses the group's
  communicator) and, being ordered after everything queued for its peers, on those
  peers' streams too. A collective runs on its group's stream. An operation runs only
  when it is at the head of every stream it is queued on; it leaves them when it ends.
* **Groups start as one unit.** The ops of one ``batch_isend_irecv`` run together; the
  unit ends when each has met its partner.
* **Collectives.** The k-th collective of a group ends when every member's k-th
  collective of that group is running; their names must agree.
* **Host waits.** ``wait()`` (and every synchronous call) stops that host thread until
  the operation ended; each thread of a rank is a host of its own.
* **One thread per group at a time.** A group's operations are ordered by issue, so a
  thread issuing on a group while another thread's operation there is in flight is an
  error (the recorder notes it; handing a group from one thread to the next is fine).

Batched and single point-to-point ops use different NCCL communicators, so they never
pair with each other: mixing them on one pair of ranks is reported as a hang too.
:func:`replay` returns a :class:`ReplayReport`; its ``text`` names the stuck ranks and
the operations at the head of their streams.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Host = tuple[int, str]  # (rank, thread name)


@dataclass
class _Unit:
    """One launch on the device: a single op, a batch of p2p ops, or a collective."""

    rank: int
    ops: list[dict[str, Any]]
    streams: list[tuple]
    done: bool = False
    matched: set[int] = field(default_factory=set)  # op ids whose partner ran with them

    def describe(self) -> str:
        if self.ops[0]["op"] == "coll":
            return f"{self.ops[0]['name']} on group {self.ops[0]['group']}"
        parts = [f"{o['kind']} {'to' if o['kind'] == 'send' else 'from'} {o['peer']} "
                 f"({o['nbytes']} B)" for o in self.ops]
        batch = "batch " if self.ops[0]["batch"] is not None else ""
        return f"{batch}[{', '.join(parts)}]"


@dataclass
class ReplayReport:
    """The outcome of a replay: ``ok`` when every host ran to its end and every op ended."""

    ok: bool
    text: str
    num_ops: int = 0
    errors: list[str] = field(default_factory=list)


class _Replay:
    def __init__(self, traces: list[dict[str, Any]]) -> None:
        self.groups: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.hosts: dict[Host, list[dict[str, Any]]] = defaultdict(list)
        for tr in traces:
            self.groups.update(tr["groups"])
            for ev in tr["events"]:
                if ev["op"] == "error":  # found while recording (a group shared by threads)
                    self.errors.append(ev["text"])
                else:
                    self.hosts[(tr["rank"], ev["thread"])].append(ev)
        self.pc: dict[Host, int] = dict.fromkeys(self.hosts, 0)
        self.streams: dict[tuple, deque[_Unit]] = defaultdict(deque)
        self.unit_of: dict[tuple[int, int], _Unit] = {}  # (rank, op id) -> unit
        self.channels: dict[tuple, list[tuple[int, dict]]] = defaultdict(list)
        self.colls: dict[tuple, list[_Unit]] = defaultdict(list)  # (group, rank) -> issued
        self.num_ops = 0

    # ---- issuing ---------------------------------------------------------------------------
    def _issue(self, rank: int, events: list[dict[str, Any]]) -> None:
        first = events[0]
        if first["op"] == "coll":
            streams = [("group", first["group"])]
            unit = _Unit(rank, events, streams)
            first["_seq"] = len(self.colls[(first["group"], rank)])
            self.colls[(first["group"], rank)].append(unit)
        elif first["batch"] is None:
            streams = [("pair", first["group"], first["peer"])]
            unit = _Unit(rank, events, streams)
        else:
            peers = sorted({e["peer"] for e in events})
            streams = [("group", first["group"])] + [("pair", first["group"], p) for p in peers]
            unit = _Unit(rank, events, streams)
        for ev in events:
            self.num_ops += 1
            self.unit_of[(rank, ev["id"])] = unit
            if ev["op"] == "p2p":
                mode = "pair" if ev["batch"] is None else "batch"
                src, dst = (rank, ev["peer"]) if ev["kind"] == "send" else (ev["peer"], rank)
                channel = self.channels[(ev["group"], src, dst, mode, ev["kind"])]
                ev["_seq"] = len(channel)  # the k-th send pairs with the k-th receive
                channel.append((rank, ev))
        for s in streams:
            self.streams[(rank, *s)].append(unit)

    def _advance(self, host: Host) -> bool:
        """Run one host thread until it waits on an unfinished op or ends."""
        rank, events, moved = host[0], self.hosts[host], False
        while self.pc[host] < len(events):
            ev = events[self.pc[host]]
            if ev["op"] == "wait":
                if not all(self.unit_of[(rank, i)].done for i in ev["ids"]):
                    return moved
                self.pc[host] += 1
            else:
                batch, j = [ev], self.pc[host] + 1
                while (ev["op"] == "p2p" and ev["batch"] is not None and j < len(events)
                       and events[j].get("batch") == ev["batch"]):
                    batch.append(events[j])
                    j += 1
                self._issue(rank, batch)
                self.pc[host] = j
            moved = True
        return moved

    # ---- completing ----------------------------------------------------------------------
    def _active(self, unit: _Unit) -> bool:
        return not unit.done and all(self.streams[(unit.rank, *s)][0] is unit
                                     for s in unit.streams)

    def _partner(self, rank: int, ev: dict[str, Any]) -> tuple[int, dict] | None:
        mode = "pair" if ev["batch"] is None else "batch"
        src, dst = (rank, ev["peer"]) if ev["kind"] == "send" else (ev["peer"], rank)
        other = "recv" if ev["kind"] == "send" else "send"
        theirs = self.channels[(ev["group"], src, dst, mode, other)]
        k = ev["_seq"]
        return theirs[k] if k < len(theirs) else None

    def _try_p2p(self, unit: _Unit) -> None:
        for ev in unit.ops:
            if ev["id"] in unit.matched:
                continue
            partner = self._partner(unit.rank, ev)
            if partner is None:
                continue
            prank, pev = partner
            punit = self.unit_of[(prank, pev["id"])]
            if self._active(punit):
                if ev["nbytes"] != pev["nbytes"]:
                    self.errors.append(
                        f"rank {unit.rank} {ev['kind']}s {ev['nbytes']} B "
                        f"{'to' if ev['kind'] == 'send' else 'from'} rank {prank}, which "
                        f"{pev['kind']}s {pev['nbytes']} B")
                unit.matched.add(ev["id"])
                punit.matched.add(pev["id"])

    def _try_coll(self, unit: _Unit) -> None:
        group = unit.ops[0]["group"]
        k = unit.ops[0]["_seq"]
        peers = []
        for r in self.groups[group]:
            issued = self.colls[(group, r)]
            if k >= len(issued) or not self._active(issued[k]):
                return
            peers.append(issued[k])
        names = {u.ops[0]["name"] for u in peers}
        if len(names) > 1:
            self.errors.append(f"collective #{k} of group {group} differs between ranks: "
                               f"{sorted(names)}")
        for u in peers:
            u.matched.add(u.ops[0]["id"])

    def _complete(self) -> bool:
        active = [u for q in list(self.streams.values()) if q for u in [q[0]]
                  if self._active(u)]
        for u in active:
            (self._try_coll if u.ops[0]["op"] == "coll" else self._try_p2p)(u)
        moved = False
        for u in {id(u): u for u in active}.values():
            if not u.done and len(u.matched) == len(u.ops):
                u.done, moved = True, True
                for s in u.streams:
                    popped = self.streams[(u.rank, *s)].popleft()
                    assert popped is u
        return moved

    def run(self) -> ReplayReport:
        while True:
            moved = any([self._advance(h) for h in self.hosts])
            if not (self._complete() or moved):
                break
        stuck = self._stuck()
        ok = not stuck and not self.errors
        text = "no deadlock" if ok else "\n".join(stuck + self.errors)
        return ReplayReport(ok, text, self.num_ops, self.errors)

    def _stuck(self) -> list[str]:
        lines = []
        for host, events in sorted(self.hosts.items()):
            if self.pc[host] < len(events):
                ev = events[self.pc[host]]
                waits = [self.unit_of[(host[0], i)].describe() for i in ev.get("ids", [])]
                lines.append(f"rank {host[0]} ({host[1]}) blocked at event "
                             f"{self.pc[host]} waiting for {'; '.join(waits)}")
        for (rank, *stream), q in sorted(self.streams.items(), key=lambda x: str(x[0])):
            if q:
                lines.append(f"rank {rank} stream {tuple(stream)}: head {q[0].describe()}"
                             + (f" (+{len(q) - 1} queued)" if len(q) > 1 else ""))
        if lines:
            lines.insert(0, "deadlock under NCCL's rules:")
        return lines


def replay(traces: list[dict[str, Any]]) -> ReplayReport:
    """Replay every rank's trace (as written by ``CommRecorder.dump``) under NCCL's rules."""
    return _Replay(traces).run()


def replay_folder(folder: str | Path) -> ReplayReport:
    """Replay the ``rank*.json`` traces of one run."""
    paths = sorted(Path(folder).glob("rank*.json"))
    assert paths, f"no traces in {folder}"
    return replay([json.loads(p.read_text()) for p in paths])
