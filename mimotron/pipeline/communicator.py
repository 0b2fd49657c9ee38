"""Moving encoder outputs to the language module and their gradients back.

``MultiModulePipelineCommunicator`` works over the module DAG (every encoder feeds the
language model). For each edge ``src -> dst`` it picks one of two transports:

* **colocated, same DP slices** — the tensor is handed over in-process; autograd carries
  the gradient back, nothing is sent;
* **point-to-point** (non-colocated) — each ``(src replica, dst replica)`` pair whose
  sample ranges intersect exchanges exactly the rows of that intersection: DP fan-in
  (src DP > dst DP) concatenates contiguous slices, fan-out splits them, and the same
  rule covers both. Sends are batched ``isend``/``irecv``; no world barrier.

Encoder outputs hold one row per *present* sample (a text-only sample has none), so
the rows a pair exchanges are the present samples in the intersection. Both ends know
those counts from the ``has_<modality>`` masks of their own slice (the intersection lies
inside both slices), so no shape message is needed and every rank stays in lock-step
even when a pair exchanges zero rows (then nothing is posted on either side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimotron.parallel.layout import Layout, ModulePlacement


@dataclass(frozen=True)
class Edge:
    """One module boundary and what this rank does on it."""

    src: str
    dst: str
    modality: str
    num_tokens: int  # embeddings per present sample
    hidden_size: int  # of the destination (projector output)
    colocated: bool


def slice_range(mbs: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """Sample range [start, end) of a DP replica inside a micro-batch."""
    per = mbs // dp_size
    return dp_rank * per, (dp_rank + 1) * per


class MultiModulePipelineCommunicator:
    """Forward/backward transport of activations between modules for one rank.

    Args:
        layout: the placement of every module.
        rank: this global rank.
        micro_batch_size: the global micro-batch size (samples through the pipeline at once).
        edges: the module boundaries (from ``build_edges``).
        dtype: dtype of the activations crossing (the compute dtype).
        device: where received tensors are allocated.
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, edges: list[Edge],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.rank = rank
        self.mbs = micro_batch_size
        self.edges = edges
        self.dtype = dtype
        self.device = device
        for e in edges:
            src, dst = layout.modules[e.src], layout.modules[e.dst]
            if e.colocated and src.parallel.data != dst.parallel.data:
                raise ValueError(
                    f"modules.{e.src}.parallel.data={src.parallel.data} differs from "
                    f"modules.{e.dst}.parallel.data={dst.parallel.data} on shared ranks: the "
                    "colocated bridge between different DP degrees is not implemented yet; "
                    "use equal data degrees or non-colocated blocks"
                )
            for m in (src, dst):
                if m.parallel.tensor > 1 or m.parallel.pipeline > 1:
                    raise ValueError(
                        f"modules.{m.name}.parallel: tensor={m.parallel.tensor}, pipeline="
                        f"{m.parallel.pipeline}: tensor and pipeline parallelism are not "
                        "implemented yet in this version; use 1"
                    )

    # ---- pairing ----------------------------------------------------------------------
    def _pairs(self, e: Edge) -> list[tuple[int, int, int, int]]:
        """(src_rank, dst_rank, start, end) for each replica pair sharing samples."""
        src, dst = self.layout.modules[e.src], self.layout.modules[e.dst]
        out = []
        for i in range(src.parallel.data):
            a0, a1 = slice_range(self.mbs, src.parallel.data, i)
            for j in range(dst.parallel.data):
                b0, b1 = slice_range(self.mbs, dst.parallel.data, j)
                lo, hi = max(a0, b0), min(a1, b1)
                if lo < hi:
                    out.append((_leader(src, i, last=True), _leader(dst, j, last=False), lo, hi))
        return out

    @staticmethod
    def _count(mask: torch.Tensor, my_start: int, lo: int, hi: int) -> int:
        """Present samples in global micro-batch range [lo, hi), from a slice's mask."""
        return int(mask[lo - my_start:hi - my_start].sum())

    # ---- forward ------------------------------------------------------------------------
    def forward(self, e: Edge, output: torch.Tensor | None, src_mask: torch.Tensor | None,
                dst_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Carry ``output`` (on src ranks) to the dst ranks; returns the dst's input.

        Args:
            e: the edge.
            output: the src module's output for this rank's slice (src ranks), else None.
            src_mask: ``has_<modality>`` of this rank's src slice (src ranks), else None.
            dst_mask: ``has_<modality>`` of this rank's dst slice (dst ranks), else None.

        Returns:
            On dst ranks the rows of the dst slice (a leaf that requires grad when sent
            point-to-point; the same tensor when colocated); None elsewhere.
        """
        if e.colocated:
            return output
        ops, recvs = [], []
        src, dst = self.layout.modules[e.src], self.layout.modules[e.dst]
        src_start = self._my_start(src)
        dst_start = self._my_start(dst)
        send_offset = 0
        for s_rank, d_rank, lo, hi in self._pairs(e):
            if s_rank == self.rank:
                n = self._count(src_mask, src_start, lo, hi)
                if n:
                    chunk = output[send_offset:send_offset + n].detach().to(self.dtype).contiguous()
                    ops.append(dist.P2POp(dist.isend, chunk, d_rank))
                send_offset += n
            if d_rank == self.rank:
                n = self._count(dst_mask, dst_start, lo, hi)
                buf = torch.empty(n, e.num_tokens, e.hidden_size, dtype=self.dtype,
                                  device=self.device)
                recvs.append(buf)
                if n:
                    ops.append(dist.P2POp(dist.irecv, buf, s_rank))
        _run(ops)
        if dst_mask is None:
            return None
        received = torch.cat(recvs) if recvs else torch.empty(
            0, e.num_tokens, e.hidden_size, dtype=self.dtype, device=self.device)
        return received.requires_grad_(True)

    # ---- backward -----------------------------------------------------------------------
    def backward(self, e: Edge, output: torch.Tensor | None, received: torch.Tensor | None,
                 src_mask: torch.Tensor | None, dst_mask: torch.Tensor | None) -> None:
        """Send ``received.grad`` back (dst ranks) and backprop it into ``output`` (src)."""
        if e.colocated:
            return
        ops, grads = [], []
        src, dst = self.layout.modules[e.src], self.layout.modules[e.dst]
        src_start, dst_start = self._my_start(src), self._my_start(dst)
        recv_offset = 0
        for s_rank, d_rank, lo, hi in self._pairs(e):
            if d_rank == self.rank:
                n = self._count(dst_mask, dst_start, lo, hi)
                if n:
                    g = received.grad
                    g = torch.zeros_like(received) if g is None else g
                    ops.append(dist.P2POp(dist.isend, g[recv_offset:recv_offset + n].contiguous(),
                                          s_rank))
                recv_offset += n
            if s_rank == self.rank:
                n = self._count(src_mask, src_start, lo, hi)
                buf = torch.empty(n, e.num_tokens, e.hidden_size, dtype=self.dtype,
                                  device=self.device)
                grads.append(buf)
                if n:
                    ops.append(dist.P2POp(dist.irecv, buf, d_rank))
        _run(ops)
        if output is not None and output.requires_grad and output.numel():
            output.backward(torch.cat(grads).to(output.dtype))

    def _my_start(self, mod: ModulePlacement) -> int:
        c = mod.coordinate(self.rank)
        return 0 if c is None else slice_range(self.mbs, mod.parallel.data, c["dp"])[0]


def _leader(mod: ModulePlacement, dp_rank: int, last: bool) -> int:
    """The rank that talks across a boundary for one DP replica (tp 0, edge stage)."""
    return mod.rank_at(dp=dp_rank, pp=mod.parallel.pipeline - 1 if last else 0)


def _run(ops: list[dist.P2POp]) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def build_edges(cfg, layout: Layout) -> list[Edge]:  # noqa: ANN001 - MimoConfig, import cycle
    """The module boundaries of the DAG, in config order."""
    lm_hidden = cfg.modules["language"].hidden_size
    edges = []
    for src, dsts in layout.topology.items():
        for dst in dsts:
            a, b = layout.modules[src], layout.modules[dst]
            colocated = a.rank_offset == b.rank_offset and a.size == b.size
            mod = cfg.modules[src]
            edges.append(Edge(src, dst, mod.modality, mod.num_output_tokens, lm_hidden, colocated))
    return edges
