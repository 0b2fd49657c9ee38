"""Name the cause of a hang from the ranks' partial traces: who waits for whom, and where.

When ranks hang on gloo (a collective one rank skipped: an FSDP reduce-scatter, a ZeRO
gather, a bridge transfer), every waiting rank eventually fails with a timeout that
names no cause, or the job never ends. The multi-rank harness then collects each rank's
communication trace as far as it got (:mod:`mimotron.commcheck.record`: a failed rank
writes it before reporting, a stuck rank on request) and :func:`explain_hang` compares
them:

* **Where each rank is blocked.** The operations its last ``wait()`` is for, or its
  last operation if nothing waited for it afterwards (a synchronous call that never
  returned). A rank whose trace says it finished is blocked nowhere.
* **Whom it waits for.** Blocked in the ``k``-th collective of a group, it waits for the
  members that issued fewer than ``k`` there; blocked in its ``k``-th receive from a
  peer on a group, for that peer if it sent fewer than ``k``.
* **Collectives that differ.** The first index of a group where members issued different
  collectives (a rank that skipped one and went on to the next on the same group).

The report lists the differing collectives first, then the waits of the ranks others
wait for (the cycle or the rank at the end of the chain: the cause), then the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# How a rank's trace ended (``CommRecorder.dump``'s ``state``).
FINISHED, FAILED, RUNNING = "finished", "failed", "running"


@dataclass(frozen=True)
class _Op:
    """One issued operation of a rank, with its place in its group or channel."""

    rank: int
    event: dict[str, Any]
    index: int  # 1-based: the index-th collective of the group / message of the channel

    def describe(self, groups: dict[str, list[int]]) -> str:
        ev = self.event
        where = f"group {ev['group']} (ranks {groups.get(ev['group'], '?')})"
        if ev["op"] == "coll":
            return f"{ev['name']} #{self.index} of {where}"
        direction = "to" if ev["kind"] == "send" else "from"
        return f"{ev['kind']} #{self.index} {direction} rank {ev['peer']} on {where}"


class _Traces:
    """Every rank's operations indexed by group (collectives) and channel (p2p)."""

    def __init__(self, traces: list[dict[str, Any]]) -> None:
        self.groups: dict[str, list[int]] = {}
        self.by_id: dict[tuple[int, int], _Op] = {}
        self.colls: dict[tuple[str, int], list[_Op]] = {}  # (group, rank) -> in order
        self.msgs: dict[tuple[str, int, int, str], int] = {}  # (group, src, dst, kind) -> n
        self.state: dict[int, str] = {}
        self.last: dict[int, list[_Op]] = {}  # rank -> the ops it is blocked on
        for tr in traces:
            self.groups.update(tr["groups"])
            self.state[tr["rank"]] = tr.get("state", FINISHED)
            self._index(tr["rank"], tr["events"])

    def _index(self, rank: int, events: list[dict[str, Any]]) -> None:
        waited: set[int] = set()
        last_event: dict[str, Any] | None = None
        for ev in events:
            if ev["op"] == "wait":
                waited.update(ev["ids"])
            elif ev["op"] in ("coll", "p2p"):
                self.by_id[(rank, ev["id"])] = _Op(rank, ev, self._count(rank, ev))
            if ev["op"] != "error" and ev.get("thread") == "MainThread":
                last_event = ev
        if self.state[rank] == FINISHED or last_event is None:
            self.last[rank] = []
        elif last_event["op"] == "wait":  # logged before the wait itself
            self.last[rank] = [self.by_id[(rank, i)] for i in last_event["ids"]]
        else:  # a synchronous call logs its wait once it returns: it did not
            self.last[rank] = [self.by_id[(rank, last_event["id"])]]

    def _count(self, rank: int, ev: dict[str, Any]) -> int:
        if ev["op"] == "coll":
            seq = self.colls.setdefault((ev["group"], rank), [])
            seq.append(_Op(rank, ev, len(seq) + 1))
            return len(seq)
        src, dst = (rank, ev["peer"]) if ev["kind"] == "send" else (ev["peer"], rank)
        key = (ev["group"], src, dst, ev["kind"])
        self.msgs[key] = self.msgs.get(key, 0) + 1
        return self.msgs[key]

    def issued(self, group: str, rank: int) -> int:
        return len(self.colls.get((group, rank), []))

    def waits_for(self, op: _Op) -> list[int]:
        """Ranks that have not issued the counterpart of ``op`` (known ranks only)."""
        ev = op.event
        if ev["op"] == "coll":
            return [r for r in self.groups.get(ev["group"], []) if r in self.state
                    and r != op.rank and self.issued(ev["group"], r) < op.index]
        if ev["kind"] == "send" or ev["peer"] not in self.state:
            return []  # sends are buffered on gloo: a blocked send waits for nobody
        sent = self.msgs.get((ev["group"], ev["peer"], op.rank, "send"), 0)
        return [ev["peer"]] if sent < op.index else []


def _differing(tr: _Traces) -> list[str]:
    """Per group, the first index where its members issued different collectives."""
    lines = []
    for group, members in sorted(tr.groups.items()):
        seqs = {r: tr.colls.get((group, r), []) for r in members if r in tr.state}
        for i in range(min((len(s) for s in seqs.values()), default=0)):
            names = {r: s[i].event["name"] for r, s in seqs.items()}
            if len(set(names.values())) > 1:
                what = ", ".join(f"rank {r} {n}" for r, n in sorted(names.items()))
                lines.append(f"collective #{i + 1} of group {group} (ranks {members}) "
                             f"differs between ranks: {what}")
                break
    return lines


def explain_hang(traces: list[dict[str, Any]], world_size: int | None = None) -> str | None:
    """The cause of a hang in these (partial) traces, or ``None`` if they show none.

    Args:
        traces: one per rank that wrote one, as ``CommRecorder.dump`` writes them.
        world_size: the job's ranks (those without a trace are named); ``None``: not known.

    Returns:
        Lines naming the ranks and the operations (op, group and its ranks, index)
        where they diverge; ``None`` when no rank waits for another.
    """
    tr = _Traces(traces)
    waits = {}
    for rank, ops in sorted(tr.last.items()):
        for op in ops:
            missing = tr.waits_for(op)
            if missing:
                waits[rank] = (op, missing)
                break
    lines = _differing(tr)
    if not waits and not lines:
        return None
    waited_for = {r for _, missing in waits.values() for r in missing}
    order = sorted(waits, key=lambda r: (r not in waited_for, r))
    for rank in order:
        op, missing = waits[rank]
        if op.event["op"] == "coll":
            counts = [f"rank {m} issued {tr.issued(op.event['group'], m)} there" for m in missing]
        else:
            counts = [f"rank {m} sent {tr.msgs.get((op.event['group'], m, rank, 'send'), 0)}"
                      for m in missing]
        lines.append(f"rank {rank} waits in {op.describe(tr.groups)} for ranks {missing} "
                     f"({', '.join(counts)})")
    silent = sorted(set(range(world_size or 0)) - set(tr.state))
    if silent:
        lines.append(f"(no trace from ranks {silent})")
    return "\n".join(lines)


def explain_hang_folder(folder: str | Path, world_size: int | None = None) -> str | None:
    """:func:`explain_hang` over the ``rank*.json`` traces in ``folder`` (any present)."""
    paths = sorted(Path(folder).glob("rank*.json"))
    traces = [json.loads(p.read_text()) for p in paths]
    return explain_hang(traces, world_size) if traces else None


def main(argv: list[str] | None = None) -> int:
    """``python -m mimotron.commcheck.diverge FOLDER``: explain a hang from its traces."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mimotron.commcheck.diverge FOLDER (a hung run's rank*.json)")
        return 2
    text = explain_hang_folder(args[0])
    print(text or "no rank waits for another in these traces")
    return 1 if text else 0


if __name__ == "__main__":
    raise SystemExit(main())
