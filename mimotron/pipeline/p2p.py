"""Point-to-point transfers, with or without a shape header, and broadcast in a TP group.

A tensor whose shape the receiver cannot know in advance (the number of present samples
of an encoder slice, a context-parallel bridge's routed rows) travels as a small header
(dtype code, ndim, shape) followed by the payload; an empty tensor sends only the
header. A tensor whose shape and dtype both sides derive from the config (a language
model stage link: ``[micro-batch rows, seq_length / cp, hidden]``, see
:mod:`mimotron.pipeline.shapes`) travels as the payload alone: one message instead of
two, and the receiver's buffer can be posted before the sender is ready.

Every transfer is NCCL-safe by construction (:func:`exchange`): its sends and receives go
out as ``batch_isend_irecv`` groups — the shape headers as a group of their own, then
the payloads — and both ends of a transfer issue their groups in the same order, as
Megatron's ``p2p_communication`` does. Under NCCL a pair's point-to-point operations
run in issue order on one stream and a send completes only with its receive, so a
receive posted ahead of a send to the same peer (gloo buffers sends; NCCL does not) can
hang both ranks; no receive is posted before its transfer. Send handles are kept in a
``PendingSends`` list and waited for at the end of the step. The suite replays every
multi-rank test's communication under NCCL's rules (:mod:`mimotron.commcheck`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

HEADER_LEN = 8
# The real functions: ``P2POp`` accepts only these (a recorder may wrap ``dist.isend``).
_ISEND, _IRECV = c10d.isend, c10d.irecv
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
    batches: int = 0
    """``batch_isend_irecv`` groups started (headers and payloads of a transfer apart)."""


class PendingSends:
    """Outstanding send handles (and the tensors they read), waited at step end."""

    def __init__(self) -> None:
        self._works: list[tuple[dist.Work, torch.Tensor]] = []

    def add(self, work: dist.Work | None, tensor: torch.Tensor) -> None:
        if work is not None:
            self._works.append((work, tensor))

    def wait(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works.clear()


@dataclass(frozen=True)
class Recv:
    """One receive of an exchange: from ``peer``; ``known`` shape and dtype, or a header."""

    peer: int
    known: Known = None


def _launch(ops: list[dist.P2POp], counts: TransferCounts) -> list[dist.Work]:
    """Start ``ops`` as one ``batch_isend_irecv`` group (none: nothing to start)."""
    if not ops:
        return []
    counts.batches += 1
    return dist.batch_isend_irecv(ops)


def _wait_receives(works: list[dist.Work], ops: list[dist.P2POp], pending: PendingSends
                   ) -> None:
    """Wait for a group's receives; its sends are parked until the step's end.

    Without coalescing (gloo) torch returns one work per op; with it (NCCL) one work for
    the whole group, which ends as a unit anyway.
    """
    if len(works) != len(ops):
        for w in works:
            w.wait()
        return
    for w, op in zip(works, ops, strict=True):
        if op.op is _IRECV:
            w.wait()
        else:
            pending.add(w, op.tensor)


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[Recv],
             pending: PendingSends, counts: TransferCounts, device: torch.device,
             known: list[Known] | None = None) -> list[torch.Tensor]:
    """Send and receive one transfer's tensors as NCCL-safe batched groups.

    At most two ``batch_isend_irecv`` groups, issued by both ends in the same order:
    first every shape header of the transfer (sent and received), then every payload.
    The caller's peers run the mirror of this call (a send here is a receive there, in
    the same transfer), so each group's partners are all in flight together and no
    point-to-point op waits on one queued behind it (see ``mimotron.commcheck``).

    Args:
        sends: ``(peer rank, tensor)`` pairs; tensors must not be modified afterwards.
        recvs: what to receive, in the order to return it.
        pending: where the sends' handles are parked until the step's end.
        counts: message counters to update.
        device: where headers and received tensors are allocated.
        known: per send, its shape and dtype if the receiver knows them (no header
            then; the caller has checked the tensor against them), else ``None``.

    Returns:
        The received tensors, in ``recvs`` order.
    """
    payloads = [(peer, t.detach().contiguous()) for peer, t in sends]
    kinds = known or [None] * len(sends)
    shapes = _exchange_headers(payloads, kinds, recvs, pending, counts, device)
    ops = [dist.P2POp(_ISEND, t, peer) for peer, t in payloads if t.numel()]
    got = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in shapes]
    ops += [dist.P2POp(_IRECV, t, r.peer) for r, t in zip(recvs, got, strict=True)
            if t.numel()]
    _wait_receives(_launch(ops, counts), ops, pending)
    return got


def _exchange_headers(payloads: list[tuple[int, torch.Tensor]], kinds: list[Known],
                      recvs: list[Recv], pending: PendingSends, counts: TransferCounts,
                      device: torch.device) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """The headers' group: send ours, receive theirs; ``(dtype, shape)`` per receive."""
    ops = []
    for (peer, t), kn in zip(payloads, kinds, strict=True):
        if kn is None:
            ops.append(dist.P2POp(_ISEND, _header(t).to(device), peer))
            counts.headers_sent += 1
        else:
            assert tuple(t.shape) == tuple(kn[0]) and t.dtype == kn[1], "unchecked send"
            counts.header_free_sends += 1
    headers = [torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
               for r in recvs if r.known is None]
    ops += [dist.P2POp(_IRECV, h, r.peer)
            for h, r in zip(headers, [r for r in recvs if r.known is None], strict=True)]
    _wait_receives(_launch(ops, counts), ops, pending)
    counts.headers_received += len(headers)
    # One device-to-host copy for all of them: each read is a host sync on a GPU.
    parsed = iter([_parse(h) for h in torch.stack(headers).cpu()] if headers else [])
    return [(r.known[1], tuple(r.known[0])) if r.known is not None else next(parsed)
            for r in recvs]


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
