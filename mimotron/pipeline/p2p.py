"""Point-to-point transfers with shape exchange, and broadcast within a TP group.

Every tensor travels as a small header (dtype code, ndim, shape) followed by the payload,
so receivers need no prior knowledge of shapes: sequence lengths and the number of
present samples may change from micro-batch to micro-batch. Empty tensors send only the
header.

Sends never block the caller: their work handles are kept in a ``PendingSends`` list
and waited for at the end of the step, so two neighbours that send to each other in
the same call (the paired 1F1B communications) cannot wait on each other. Receives wait
for the header, allocate, then wait for the payload. Per pair of ranks, messages are
matched in posting order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

HEADER_LEN = 8
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8]


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


def exchange(sends: list[tuple[int, torch.Tensor]], recv_from: list[int],
             pending: PendingSends, device: torch.device) -> list[torch.Tensor]:
    """Post every send, then receive one tensor from each peer in ``recv_from``.

    Args:
        sends: ``(peer rank, tensor)`` pairs; tensors must not be modified afterwards.
        recv_from: peers to receive from, in order.
        pending: where send handles are parked.
        device: where received tensors are allocated.

    Returns:
        The received tensors, in ``recv_from`` order.
    """
    for peer, t in sends:
        t = t.detach().contiguous()
        h = _header(t).to(device)
        pending.add(dist.isend(h, peer), h)
        if t.numel():
            pending.add(dist.isend(t, peer), t)
    headers = []
    for peer in recv_from:
        h = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        headers.append((peer, h, dist.irecv(h, peer)))
    out, works = [], []
    for peer, h, work in headers:
        work.wait()
        dtype, shape = _parse(h.cpu())
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.numel():
            works.append(dist.irecv(t, peer))
        out.append(t)
    for work in works:
        work.wait()
    return out


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
