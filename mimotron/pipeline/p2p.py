"""Point-to-point transfers, with or without a shape header, and broadcast in a TP group.

A tensor whose shape the receiver cannot know in advance (the number of present samples
of an encoder slice, a context-parallel bridge's routed rows) travels as a small header
(dtype code, ndim, shape) followed by the payload; an empty tensor sends only the
header. A tensor whose shape and dtype both sides derive from the config (a language
model stage link: ``[micro-batch rows, seq_length / cp, hidden]``, see
:mod:`mimotron.pipeline.shapes`) travels as the payload alone: one message instead of
two, and the receiver's buffer can be posted before the sender is ready.

Sends never block the caller: their work handles are kept in a ``PendingSends`` list
and waited for at the end of the step, so two neighbours that send to each other in
the same call (the paired 1F1B communications) cannot wait on each other. A receive is
a :class:`PostedRecv`: posted (header or payload) as early as its caller likes, then
completed. Per pair of ranks, messages are matched in posting order, so receives from
one peer are posted in the order that peer sends.
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
    prefetched_receives: int = 0
    """Receives posted before the transfer that consumes them was reached."""


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


class PostedRecv:
    """One receive in flight from ``peer``: its header, or its payload if ``known``."""

    def __init__(self, peer: int, known: Known, device: torch.device) -> None:
        self.peer, self.device = peer, device
        self.header: torch.Tensor | None = None
        self.tensor: torch.Tensor | None = None
        self.work: dist.Work | None = None
        if known is None:
            self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
            self.work = dist.irecv(self.header, peer)
        else:
            self._post_payload(known[1], known[0])

    def _post_payload(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> None:
        self.tensor = torch.empty(shape, dtype=dtype, device=self.device)
        self.work = dist.irecv(self.tensor, self.peer) if self.tensor.numel() else None

    def read_header(self, counts: TransferCounts) -> None:
        """Wait for the header (if any), then post the payload's receive."""
        if self.header is None:
            return
        assert self.work is not None
        self.work.wait()
        counts.headers_received += 1
        dtype, shape = _parse(self.header.cpu())
        self.header = None
        self._post_payload(dtype, shape)

    def result(self) -> torch.Tensor:
        """Wait for the payload (call after :meth:`read_header`)."""
        assert self.header is None and self.tensor is not None, "header not read"
        if self.work is not None:
            self.work.wait()
        return self.tensor


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[PostedRecv],
             pending: PendingSends, counts: TransferCounts, device: torch.device,
             known: list[Known] | None = None) -> list[torch.Tensor]:
    """Post every send, then complete the (already posted) receives.

    Args:
        sends: ``(peer rank, tensor)`` pairs; tensors must not be modified afterwards.
        recvs: receives posted earlier (or just now), in the order to complete them.
        pending: where send handles are parked.
        counts: message counters to update.
        device: where headers are built.
        known: per send, its shape and dtype if the receiver knows them (no header
            then; the caller has checked the tensor against them), else ``None``.

    Returns:
        The received tensors, in ``recvs`` order.
    """
    for (peer, t), kn in zip(sends, known or [None] * len(sends), strict=True):
        t = t.detach().contiguous()
        if kn is None:
            h = _header(t).to(device)
            pending.add(dist.isend(h, peer), h)
            counts.headers_sent += 1
        else:
            assert tuple(t.shape) == tuple(kn[0]) and t.dtype == kn[1], "unchecked send"
            counts.header_free_sends += 1
        if t.numel():
            pending.add(dist.isend(t, peer), t)
    # Every header first, then every payload: a fan-in waits for its slowest peer once.
    for r in recvs:
        r.read_header(counts)
    return [r.result() for r in recvs]


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
