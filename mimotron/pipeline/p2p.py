"""Point-to-point transfers, with or without a shape header, and broadcast in a TP group.

A tensor whose shape the receiver cannot know in advance (the number of present samples
of an encoder slice, a context-parallel bridge's routed rows) travels as a small header
(dtype code, ndim, shape) followed by the payload; an empty tensor sends only the
header. A tensor whose shape and dtype both sides derive from the config (a language
model stage link: ``[micro-batch rows, seq_length / cp, hidden]``, see
:mod:`mimotron.pipeline.shapes`) travels as the payload alone: one message instead of
two, and the receiver's buffer can be posted before the sender is ready.

Every transfer is NCCL-safe by construction: each send goes on the process group of
its directed link and each receive on its sender's (:mod:`mimotron.pipeline.links`), so
on every group one rank only sends and the other only receives, in the same order.
Under NCCL a group's point-to-point operations between two ranks run in issue order on
one stream and a send completes only with its receive; with one group per direction no
send of a rank ever stands before one of its receives, and sends can be posted at once
as on gloo. Send handles are kept in a ``PendingSends`` list and waited for at the end
of the step. The suite replays every multi-rank test's communication under NCCL's
rules (:mod:`mimotron.commcheck`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

HEADER_LEN = 8
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8]

# A transfer's shape and dtype when both sides know them in advance; None: a header travels.
Known = tuple[tuple[int, ...], torch.dtype] | None


def _header(t: torch.Tensor) -> torch.Tensor:
    assert t.dim() <= HEADER_LEN - 2, f"tensor of {t.dim()} dims cannot be sent"
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0] = _DTYPES.index(t.dtype)
    h[1] = t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _parse(h: torch.Tensor) -> tuple[torch.dtype, list[int]]:
    vals = h.tolist()
    return _DTYPES[vals[0]], vals[2:2 + vals[1]]


@dataclass
class TransferCounts:
    """Messages of one communicator, by kind (cumulative; tests and benchmarks read them)."""

    headers_sent: int = 0
    """Shape headers sent (one per tensor whose shape the receiver cannot know)."""
    header_free_sends: int = 0
    """Tensors sent without a header (shape known to both sides from the config)."""
    headers_received: int = 0


class PendingSends:
    """Outstanding send handles (and the tensors they read), waited at step end."""

    def __init__(self) -> None:
        self._works: list[tuple[dist.Work, torch.Tensor]] = []

    def add(self, work: dist.Work | None, tensor: torch.Tensor) -> None:
        if work is not None:
            self._works.append((work, tensor))

    def prune(self) -> None:
        """Let go of sends that completed, so their tensors are freed before the step's end
        (never ``wait()`` here: a send waits for its peer's receive, and pipeline plans
        rely on sends not blocking)."""
        self._works = [(w, t) for w, t in self._works if not w.is_completed()]

    def wait(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


@dataclass(frozen=True)
class Recv:
    """One receive of an exchange: from ``peer``; ``known`` shape and dtype, or a header."""

    peer: int
    known: Known = None


class LinkGroups:
    """The process group of each directed link of this rank (:mod:`mimotron.pipeline.
    links`): sends to ``peer`` go on ``(rank, peer)``'s group, receives from ``peer`` on
    ``(peer, rank)``'s. Without groups (``None``) everything goes on the default group.
    """

    def __init__(self, rank: int, groups: dict[tuple[int, int], dist.ProcessGroup] | None
                 ) -> None:
        self.rank, self.groups = rank, groups

    def send(self, t: torch.Tensor, peer: int) -> dist.Work:
        group = None if self.groups is None else self.groups[(self.rank, peer)]
        return dist.isend(t, peer, group=group)

    def recv(self, t: torch.Tensor, peer: int) -> dist.Work:
        group = None if self.groups is None else self.groups[(peer, self.rank)]
        return dist.irecv(t, peer, group=group)


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[Recv],
             pending: PendingSends, counts: TransferCounts, device: torch.device,
             known: list[Known] | None = None, links: LinkGroups | None = None
             ) -> list[torch.Tensor]:
    """Post every send (header, then payload), then complete the receives.

    Each send and receive goes on its directed link's group (``links``), where this
    rank only sends or only receives: no send of ours can stand before a receive of
    ours on one NCCL stream, so posting sends first is safe on NCCL as on gloo.

    Args:
        sends: ``(peer rank, tensor)`` pairs; tensors must not be modified afterwards.
        recvs: what to receive, in the order to return it.
        pending: where the sends' handles are parked until the step's end.
        counts: message counters to update.
        device: where headers and received tensors are allocated.
        known: per send, its shape and dtype if the receiver knows them (no header
            then; the caller has checked the tensor against them), else ``None``.
        links: the directed links' groups (``None``: the default group).

    Returns:
        The received tensors, in ``recvs`` order.
    """
    links = links or LinkGroups(dist.get_rank(), None)
    pending.prune()
    for (peer, t), kn in zip(sends, known or [None] * len(sends), strict=True):
        t = t.detach().contiguous()
        if kn is None:
            h = _header(t).to(device)
            pending.add(links.send(h, peer), h)
            counts.headers_sent += 1
        else:
            assert tuple(t.shape) == tuple(kn[0]) and t.dtype == kn[1], "unchecked send"
            counts.header_free_sends += 1
        if t.numel():
            pending.add(links.send(t, peer), t)
    return _receive(recvs, counts, device, links)


def _receive(recvs: list[Recv], counts: TransferCounts, device: torch.device,
             links: LinkGroups) -> list[torch.Tensor]:
    """Post and complete ``recvs`` in each peer's sending order.

    A peer's messages match this rank's receives from it in posting order, and a
    payload whose shape travels in a header can be posted only once that header is
    read: so per peer, receives are posted in order up to the next header; then every
    outstanding header is read at once (one device-to-host copy: each read is a host
    sync on a GPU), their payloads posted, and the peers' queues go on.
    """
    queues: dict[int, list[int]] = {}
    for i, r in enumerate(recvs):
        queues.setdefault(r.peer, []).append(i)
    posted: dict[int, tuple[torch.Tensor, dist.Work | None]] = {}
    waiting: dict[int, tuple[torch.Tensor, dist.Work]] = {}  # recv index -> its header
    while True:
        for queue in queues.values():
            while queue and queue[0] not in waiting:
                r = recvs[queue[0]]
                if r.known is None and queue[0] not in posted:
                    h = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
                    waiting[queue[0]] = (h, links.recv(h, r.peer))
                    break
                if queue[0] not in posted:
                    posted[queue[0]] = _post(links, r.peer, r.known[1], r.known[0], device)
                queue.pop(0)
        if not waiting:
            break
        for _, work in waiting.values():  # a fan-in waits for its slowest peer once
            work.wait()
        counts.headers_received += len(waiting)
        parsed = [_parse(h) for h in torch.stack([h for h, _ in waiting.values()]).cpu()]
        for i, (dtype, shape) in zip(waiting, parsed, strict=True):
            posted[i] = _post(links, recvs[i].peer, dtype, shape, device)
        waiting.clear()
    out = []
    for i in range(len(recvs)):
        t, work = posted[i]
        if work is not None:
            work.wait()
        out.append(t)
    return out


def _post(links: LinkGroups, peer: int, dtype: torch.dtype, shape: tuple[int, ...] | list[int],
          device: torch.device) -> tuple[torch.Tensor, dist.Work | None]:
    """Allocate a receive buffer and post its receive (none for an empty tensor)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t, (links.recv(t, peer) if t.numel() else None)


def broadcast_tensor(t: torch.Tensor | None, src: int, group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """Broadcast a tensor of unknown shape from global rank ``src`` within ``group``.

    The source passes the tensor; the others pass ``None`` and get a copy.
    """
    if group is None or dist.get_world_size(group) == 1:
        assert t is not None
        return t
    is_src = dist.get_rank() == src
    h = _header(t).to(device) if is_src else torch.empty(HEADER_LEN, dtype=torch.int64,
                                                          device=device)
    dist.broadcast(h, src=src, group=group)
    dtype, shape = _parse(h.cpu())
    buf = t.detach().contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return buf
