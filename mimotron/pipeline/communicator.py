"""Moving activations forward and gradients backward, within and across modules.

``MultiModulePipelineCommunicator`` serves one rank of a non-colocated layout (where a
rank holds one stage of one module). Its neighbours:

* inside a module, the previous/next pipeline stage with the same TP and DP coordinates
  (every TP rank sends its own copy of the replicated hidden states);
* across a module boundary (an encoder's last stage -> the language model's first stage),
  one *leader* per DP replica (TP rank 0) on each side. Each ``(source replica,
  destination replica)`` pair whose sample ranges intersect exchanges exactly the rows of
  that intersection: DP fan-in (source DP > destination DP) concatenates contiguous
  slices, fan-out splits them, and one rule covers both. The receiving leader broadcasts
  to its TP group; gradients go back the same way.

Into a context-parallel language model (``context = c > 1``) each pair becomes ``c``
routes (:func:`~mimotron.pipeline.edges.bridge_routes`), one per CP coordinate of the
destination replica: the encoder leader sends CP rank ``r`` only the ``[n_r, H]`` rows
of the placeholders among its positions
(:func:`~mimotron.parallel.context_parallel.placeholder_selection`, the row contract; it
needs the tokens of the encoder's slice, which the schedule passes), and in backward
scatters the returned pieces, which are disjoint, into a zero ``[N * T, H]`` gradient.
With ``c = 1`` the routes are the pairs and the same tensors travel as before.

Encoder outputs hold one row per sample that carries the modality, so a pair may
exchange zero rows (a text-only slice): then only a header travels and every rank stays
in lock-step. Shapes travel with each tensor (:mod:`mimotron.pipeline.p2p`), except on
the language model's stage links, whose shape both stages derive from the config
(:mod:`mimotron.pipeline.shapes`; checked on the sender). Each transfer's sends and
receives go out together as batched groups (:func:`~mimotron.pipeline.p2p.exchange`),
and its peers run the mirror transfer, so the order holds under NCCL. Colocated
layouts need none of this: their transport is
:class:`~mimotron.pipeline.colocated.ColocatedTransport`, chosen instead of this class
once at setup; both share the layout helpers of :mod:`mimotron.pipeline.edges`.

Under interleaving (``virtual_pipeline = v > 1``) every transfer names the model chunk
it serves: stage links then go round the ring of stage ranks (``pp + 1`` modulo the
pipeline size carries chunk ``j`` of the last rank into chunk ``j + 1`` of the first),
and only the first and last *virtual* stages talk across modules.

While timing is on (:meth:`set_timing`, switched on by the training loop for training
steps only), the wall time of every transfer, synchronised with the device, accumulates
in ``transfer_s``; the loop reads it with :meth:`pop_transfer_seconds` for the
per-module ``communication`` metric. Off (the default: evaluation, a library user's own
loop) no transfer waits for the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mimotron.models.native_vision import real_rows
from mimotron.names import LANGUAGE
from mimotron.parallel.context_parallel import placeholder_selection
from mimotron.parallel.layout import Layout
from mimotron.parallel.virtual_pipeline import is_first_virtual_stage, is_last_virtual_stage
from mimotron.pipeline.actions import (
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
)
from mimotron.pipeline.edges import Edge, bridge_routes, slice_range
from mimotron.pipeline.links import Link, build_link_groups, p2p_links
from mimotron.pipeline.p2p import (
    Known,
    LinkGroups,
    PendingSends,
    Recv,
    TransferCounts,
    broadcast_tensor,
    exchange,
)
from mimotron.pipeline.shapes import LinkShape, bridge_link, stage_link_shape
from mimotron.runtime import synchronize


@dataclass(frozen=True)
class Transfer:
    """One transfer of a rank's plan: its kind (``SEND_FORWARD``, ``SEND_BACKWARD``,
    ``RECV_FORWARD``, ``RECV_BACKWARD``), model chunk and micro-batch, and for a send
    what goes out (:meth:`MultiModulePipelineCommunicator.communicate`'s
    ``send_forward`` tuple, or the input gradient(s))."""

    kind: str
    chunk: int
    microbatch: int
    payload: Any = None


class MultiModulePipelineCommunicator:
    """The neighbours of one rank and the transfers to and from them.

    Args:
        layout: the placement of every module.
        rank: this global rank.
        micro_batch_size: the global micro-batch size.
        edges: the module boundaries (``build_edges``).
        tp_groups: this rank's TP group per module it holds (``None`` = TP 1).
        device: where received tensors are allocated.
        seq_length: every micro-batch's padded sequence length (``data.seq_length``).
            With ``hidden_size``, the language model's stage links send no shape
            header (:mod:`mimotron.pipeline.shapes`); ``None``: every transfer has one.
        hidden_size: the language model's hidden size (see ``seq_length``).
        bridge_rows: ``encoder -> (tokens, hidden)`` of its bridge rows where every
            sample carries its modality (:func:`~mimotron.pipeline.shapes.
            bridge_row_shapes`): those bridges send no header either. Ignored into a
            context-parallel language model.
        link_groups: the process group of each directed link of this rank
            (:func:`~mimotron.pipeline.links.build_link_groups`). ``None``: created here
            when a process group is initialised (collective over the world: every rank
            constructs its communicator at the same point), else none.
        link_timeout: the timeout of the link groups created here.
        stage_dtype: the dtype of the language model's stage links (its residual stream).
        deepstack: ``(chunk, downstream) -> DeepStack feature sets`` each of this
            rank's stage links carries besides the hidden states
            (:func:`~mimotron.pipeline.deepstack_link.model_link_extras`; ``None``: none).

    Raises:
        ValueError: ``layout`` is colocated (use ``ColocatedTransport``).
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, edges: list[Edge],
                 tp_groups: dict[str, dist.ProcessGroup | None], device: torch.device,
                 seq_length: int | None = None, hidden_size: int | None = None,
                 bridge_rows: dict[str, tuple[int, int]] | None = None,
                 link_groups: dict[Link, dist.ProcessGroup] | None = None,
                 link_timeout: timedelta | None = None,
                 stage_dtype: torch.dtype = torch.float32,
                 deepstack: dict[tuple[int, bool], int] | None = None) -> None:
        if layout.colocated:
            raise ValueError("a colocated layout has no pipeline transfers: use "
                             "mimotron.pipeline.colocated.ColocatedTransport")
        self.layout, self.rank, self.mbs, self.edges = layout, rank, micro_batch_size, edges
        self.device = device
        self.pending = PendingSends()
        if link_groups is None and dist.is_initialized():
            link_groups = build_link_groups(p2p_links(layout, micro_batch_size, edges), rank,
                                            link_timeout)
        self.links = LinkGroups(rank, link_groups)
        roles = layout.roles(rank)
        assert len(roles) == 1, f"rank {rank} holds {len(roles)} modules in a split layout"
        self.module, self.role = roles[0].module, roles[0]
        self.num_chunks = layout.modules[self.module].parallel.virtual_pipeline
        self.tp_group = tp_groups.get(self.module) if self.module else None
        # Rows exchanged per bridge pair, remembered from forward for the gradients.
        self._rows: dict[tuple[int, str], list[int]] = {}
        self._pairs = {e.src: bridge_routes(layout, e, micro_batch_size)
                       for e in edges if not e.colocated}
        # This encoder's items are dealt by cost (data.balance_encoders): every language
        # replica is a destination, and the mask counts its items per sample.
        self.balanced = any(e.balanced for e in edges if e.src == self.module)
        # The language model's CP degree; > 1: encoder leaders route rows per CP rank and
        # remember, per micro-batch, (output shape, [(offset, n, selection)]) for backward.
        self.cp = layout.modules[LANGUAGE].parallel.context if LANGUAGE in layout.modules else 1
        self._routed: dict[int, tuple[torch.Size, list[tuple[int, int, torch.Tensor]]]] = {}
        self.transfer_s = 0.0
        self._timing = False
        self.counts = TransferCounts()
        # (chunk, micro-batch, peer) -> (shape, dtype) of each output sent, for its gradient.
        self._sent: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        # The same for each input received, checked against the gradient sent back.
        self._received: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        # Known to both ends of a language stage link from the config: no header.
        # (chunk, downstream) -> that link's tensor (wider where DeepStack crosses it).
        self._stage: dict[tuple[int, bool], LinkShape | None] = {
            (j, down): stage_link_shape(layout, micro_batch_size, seq_length, hidden_size,
                                        stage_dtype, (deepstack or {}).get((j, down), 0))
            for j in range(self.num_chunks) for down in (False, True)
        } if self.module == LANGUAGE else {}
        # (src leader, dst leader) -> the bridge tensor of that pair, where it is fixed.
        self._bridge: dict[tuple[int, int], LinkShape] = {
            (s, d): bridge_link(src, hi - lo, bridge_rows[src],
                                "every sample carries its modality by data.p_image/p_audio/"
                                "p_both/p_text, train.precision=fp32")
            for src, routes in self._pairs.items() if src in (bridge_rows or {}) and self.cp == 1
            for s, d, lo, hi, _ in routes}

    # ---- neighbours ----------------------------------------------------------------------
    def _stage_peer(self, delta: int) -> int:
        """Stage rank ``delta`` away; modulo the pipeline size: the interleaving ring."""
        r, mod = self.role, self.layout.modules[self.module]
        return mod.rank_at(tp=r.tp, cp=r.cp, dp=r.dp, pp=(r.pp + delta) % mod.parallel.pipeline)

    def _first(self, chunk: int) -> bool:
        return is_first_virtual_stage(self.role, chunk)

    def _last(self, chunk: int) -> bool:
        return is_last_virtual_stage(self.role, chunk, self.num_chunks)

    @property
    def _tp_leader(self) -> int:
        r, mod = self.role, self.layout.modules[self.module]
        return mod.rank_at(tp=0, cp=r.cp, dp=r.dp, pp=r.pp)

    def _my_start(self) -> int:
        if self.balanced:  # the mask counts this replica's items of every sample
            return 0
        dp = self.layout.modules[self.module].parallel.data
        return slice_range(self.mbs, dp, self.role.dp)[0]

    # ---- forward direction -------------------------------------------------------------
    def _forward_sends(self, k: int, output: torch.Tensor, mask: torch.Tensor | None,
                       placeholders: tuple[torch.Tensor, int, torch.Tensor | None] | None = None,
                       chunk: int = 0
                       ) -> list[tuple[int, torch.Tensor]]:
        if not self._last(chunk):
            return [(self._stage_peer(+1), output)]
        if self.role.tp != 0:
            return []
        start, offset, sends = self._my_start(), 0, []
        routed: list[tuple[int, int, torch.Tensor]] = []
        for s_rank, d_rank, lo, hi, cp in self._pairs[self.module]:
            if s_rank != self.rank:
                continue
            n = int(mask[lo - start:hi - start].sum())
            block = output[offset:offset + n]
            if self.cp == 1:
                sends.append((d_rank, block))
            else:
                assert placeholders is not None, "a CP bridge needs the slice's tokens"
                tokens, pid, counts = placeholders
                sel = placeholder_selection(tokens[lo - start:hi - start], pid, self.cp, cp)
                real = real_rows(block, mask[lo - start:hi - start],
                                 None if counts is None else counts[lo - start:hi - start])
                if sel.numel() != (n * block.shape[1] if real is None else real.numel()):
                    raise ValueError(
                        f"samples {lo}..{hi - 1} of the micro-batch hold {sel.numel()} "
                        f"placeholder tokens (id {pid}) for {n} encoder outputs of "
                        f"{block.shape[1]} rows each: every present sample needs exactly "
                        "its output's rows as placeholders")
                sel = sel if real is None else real[sel]
                sends.append((d_rank, block.reshape(-1, block.shape[-1])[sel]))
                routed.append((offset, n, sel))
            if cp == self.cp - 1:  # a pair's routes are consecutive: next pair's rows
                offset += n
        if self.cp > 1:
            self._routed[k] = (output.shape, routed)
        return sends

    def _forward_sources(self, chunk: int = 0) -> list[tuple[str | None, int]]:
        """``(edge src or None for a stage link, peer)`` this rank receives from."""
        if not self._first(chunk):
            return [(None, self._stage_peer(-1))]
        if self.module != LANGUAGE or self.role.tp != 0:
            return []
        return [(src, s_rank) for src, pairs in self._pairs.items()
                for s_rank, d_rank, *_ in pairs if d_rank == self.rank]

    def _assemble_forward(self, k: int, sources, tensors, chunk: int = 0
                          ) -> torch.Tensor | dict:
        if not self._first(chunk):
            return tensors[0].requires_grad_(True)
        out = {}
        for src in self._pairs:
            chunks = [t for (s, _), t in zip(sources, tensors, strict=True) if s == src]
            if self.role.tp == 0 and src not in self.layout.ahead:  # the leader sends
                self._rows[(k, src)] = [c.shape[0] for c in chunks]  # gradients back
            # One chunk (no fan-in) is used as received: no copy.
            t = (chunks[0] if len(chunks) == 1 else torch.cat(chunks)) if chunks else None
            # TP ranks of the destination all need the embeddings: leader broadcasts.
            t = broadcast_tensor(t, self._tp_leader, self.tp_group, self.device)
            # An encoder that runs ahead takes no gradient: none is computed for it.
            out[src] = t if src in self.layout.ahead else t.requires_grad_(True)
        return out

    # ---- backward direction ------------------------------------------------------------
    def _backward_sends(self, k: int, grads: torch.Tensor | dict, chunk: int = 0
                        ) -> list[tuple[int, torch.Tensor]]:
        if not self._first(chunk):
            return [(self._stage_peer(-1), grads)]
        if self.role.tp != 0:
            return []
        sends = []
        for src, pairs in self._pairs.items():
            if src in self.layout.ahead:  # it runs ahead: no gradient goes back
                continue
            rows, offset, i = self._rows.pop((k, src)), 0, 0
            for s_rank, d_rank, *_ in pairs:
                if d_rank == self.rank:
                    sends.append((s_rank, grads[src][offset:offset + rows[i]]))
                    offset += rows[i]
                    i += 1
        return sends

    def _backward_sources(self, chunk: int = 0) -> list[int]:
        if not self._last(chunk):
            return [self._stage_peer(+1)]
        if self.role.tp != 0:
            return []
        return [d for s, d, *_ in self._pairs[self.module] if s == self.rank]

    def _assemble_backward(self, k: int, tensors: list[torch.Tensor], chunk: int = 0
                           ) -> torch.Tensor:
        if not self._last(chunk):
            return tensors[0]
        if self.cp > 1 and self.role.tp == 0:
            t = self._scatter_pieces(k, tensors)
        else:
            t = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)) if tensors else None
        return broadcast_tensor(t, self._tp_leader, self.tp_group, self.device)

    def _scatter_pieces(self, k: int, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The encoder output's gradient from the CP ranks' row pieces (disjoint rows)."""
        shape, routed = self._routed.pop(k)
        grad = torch.zeros(shape, dtype=pieces[0].dtype if pieces else torch.float32,
                           device=self.device)
        for (offset, n, sel), piece in zip(routed, pieces, strict=True):
            grad[offset:offset + n].view(-1, shape[-1])[sel] = piece
        return grad

    # ---- the four transfers, alone or paired ------------------------------------------
    def communicate(self, *, send_forward: tuple | None = None,
                    send_backward: tuple[int, torch.Tensor | dict] | None = None,
                    recv_forward: int | None = None, recv_backward: int | None = None,
                    chunk: int = 0
                    ) -> tuple[torch.Tensor | dict | None, torch.Tensor | None]:
        """Post the sends, then do the receives, in one exchange.

        Args:
            send_forward: ``(microbatch, output, modality mask of this rank's slice)``,
                and on encoder ranks ``(tokens of the slice, placeholder id)`` as a fourth
                element (used when the language model is context parallel).
            send_backward: ``(microbatch, input gradient(s))``.
            recv_forward: micro-batch whose input to receive.
            recv_backward: micro-batch whose output gradient to receive.
            chunk: the model chunk every transfer of the call serves (interleaving;
                0 otherwise).

        Returns:
            ``(forward input, output gradient)``; ``None`` where not requested.
        """
        items = [Transfer(kind, chunk, k, payload) for kind, k, payload in (
            (SEND_FORWARD, send_forward and send_forward[0], send_forward),
            (SEND_BACKWARD, send_backward and send_backward[0], send_backward and
             send_backward[1]),
            (RECV_FORWARD, recv_forward, None), (RECV_BACKWARD, recv_backward, None))
            if k is not None]
        got = dict(zip([t.kind for t in items], self.transfer(items), strict=True))
        return got.get(RECV_FORWARD), got.get(RECV_BACKWARD)

    def transfer(self, items: list[Transfer]) -> list[Any]:
        """Run several transfers as one exchange: every send, then every receive.

        The executor hands over all transfers between two computes of its plan, so
        neighbours that each send and then receive (the paired 1F1B steady state, the
        interleaved ring) issue mirror-image groups (:func:`~mimotron.pipeline.p2p.
        exchange`).

        Returns:
            Per item, what it received (``None`` for a send), in ``items`` order.
        """
        t0 = time.perf_counter()
        sends: list[tuple[int, torch.Tensor]] = []
        known: list[Known] = []
        for it in items:
            if it.kind == SEND_FORWARD:
                out = self._forward_sends(*it.payload, chunk=it.chunk)
                known += [self._checked(p, True, t, f"micro-batch {it.microbatch}'s output "
                                        f"for rank {p}", it.chunk) for p, t in out]
                for p, t in out:  # its gradient comes back in this shape and dtype
                    if self.module not in self.layout.ahead:  # (none comes back to it)
                        self._sent[(it.chunk, it.microbatch, p)] = (tuple(t.shape), t.dtype)
            elif it.kind == SEND_BACKWARD:
                out = self._backward_sends(it.microbatch, it.payload, chunk=it.chunk)
                for p, t in out:
                    self._checked(p, False, t, f"micro-batch {it.microbatch}'s input "
                                  f"gradient for rank {p}", it.chunk)
                    # The peer expects the shape and dtype of the tensor it sent us.
                    got = self._received.pop((it.chunk, it.microbatch, p))
                    assert (tuple(t.shape), t.dtype) == got, \
                        f"gradient {tuple(t.shape)} {t.dtype} for rank {p}, which sent {got}"
                known += [(tuple(t.shape), t.dtype) for _, t in out]
            else:
                continue
            sends += out
        recvs = [self._recvs(it.kind, it.chunk, it.microbatch)
                 if it.kind in (RECV_FORWARD, RECV_BACKWARD) else [] for it in items]
        got = iter(exchange(sends, [r for rs in recvs for r in rs], self.pending,
                            self.counts, self.device, known, self.links))
        results = [self._assemble(it, rs, [next(got) for _ in rs])
                   if it.kind in (RECV_FORWARD, RECV_BACKWARD) else None
                   for it, rs in zip(items, recvs, strict=True)]
        self._add_time(t0)
        return results

    def _assemble(self, it: Transfer, recvs: list[Recv], tensors: list[torch.Tensor]) -> Any:
        if it.kind == RECV_FORWARD:
            sources = self._forward_sources(it.chunk)
            for (src, _), r, t in zip(sources, recvs, tensors, strict=True):
                if {src, self.module}.isdisjoint(self.layout.ahead):  # its gradient comes
                    # back alike (none inside or out of an encoder that runs ahead)
                    self._received[(it.chunk, it.microbatch, r.peer)] = (tuple(t.shape),
                                                                         t.dtype)
            return self._assemble_forward(it.microbatch, sources, tensors, it.chunk)
        return self._assemble_backward(it.microbatch, tensors, it.chunk)

    # ---- shapes known in advance --------------------------------------------------------
    def _link(self, peer: int, downstream: bool, chunk: int = 0) -> LinkShape | None:
        """The tensor the link with ``peer`` carries, if both ends know it (else None)."""
        if not (self._last(chunk) if downstream else self._first(chunk)):
            return self._stage.get((chunk, downstream))  # a stage link inside the module
        return self._bridge.get((self.rank, peer) if downstream else (peer, self.rank))

    def _checked(self, peer: int, downstream: bool, t: torch.Tensor, what: str,
                 chunk: int = 0) -> Known:
        """A send's known shape (``None``: it needs a header), checked against ``t``."""
        link = self._link(peer, downstream, chunk)
        if link is None:
            return None
        link.check(t, what)
        return link.shape, link.dtype

    def _recvs(self, kind: str, chunk: int, k: int) -> list[Recv]:
        """The receives of one transfer: from whom, and the shape where it is known.

        A gradient's shape is always known (that of micro-batch ``k``'s output this rank
        sent the peer), so only activations may need a header: the backward direction
        never waits for one, and a paired send-and-receive starts its payloads at once.
        """
        if kind == RECV_BACKWARD:
            return [Recv(p, self._sent.pop((chunk, k, p))) for p in self._backward_sources(chunk)]
        out = []
        for _, peer in self._forward_sources(chunk):
            link = self._link(peer, False, chunk)
            out.append(Recv(peer, None if link is None else (link.shape, link.dtype)))
        return out

    def finish(self, forward_only: bool = False) -> None:
        """Wait for every send of the step (call once at the end of a schedule)."""
        t0 = time.perf_counter()
        self.pending.wait()
        self._add_time(t0)
        if forward_only:
            self._rows.clear()  # No gradients go back in evaluation.
            self._routed.clear()
            self._sent.clear()
            self._received.clear()
        assert not self._rows, f"gradients never sent for {sorted(self._rows)}"
        assert not self._routed, f"gradients never received for {sorted(self._routed)}"
        assert not self._sent, f"gradients never received for {sorted(self._sent)}"
        assert not self._received, f"gradients never sent for {sorted(self._received)}"

    def set_timing(self, enabled: bool) -> None:
        """Time transfers (each then waits for the device) or not."""
        self._timing = enabled

    def _add_time(self, t0: float) -> None:
        if self._timing:
            synchronize(self.device)  # Device time, not launch time.
            self.transfer_s += time.perf_counter() - t0

    def pop_transfer_seconds(self) -> float:
        """Seconds spent in transfers since the last call; resets the count."""
        spent, self.transfer_s = self.transfer_s, 0.0
        return spent
