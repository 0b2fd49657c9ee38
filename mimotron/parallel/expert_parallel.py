"""Expert parallelism: experts sharded over the expert view's ``ep`` axis, tokens exchanged.

A module with ``parallel.expert = P`` holds, on the rank at ``ep`` coordinate ``r``, the
global experts ``[r * E / P, (r + 1) * E / P)``: every ``GroupedExperts``' stacked
``w1/w2/w3`` (expert index = dim 0) become DTensors ``Shard(0)`` over a 1-D mesh of the
EP group (:func:`shard_experts`), still named and shaped ``[E, ...]`` globally, so
checkpoints reshard across EP degrees and every parameter starts from the one-process
initialisation (drawn on the full shape first).

:class:`ExpertParallelDispatcher` computes an MoE layer's routed output dropless:

1. every (token, choice) copy is permuted by global expert id (hence by destination
   rank, then local expert), per-expert counts are exchanged first (one int64
   ``all_to_all_single``) and read with this rank's in one host sync
   (:data:`~mimotron.host_sync.EXPERT_COUNTS`), then the rows (``all_to_all_single``
   with variable splits);
2. the received rows are regrouped by local expert, one ``experts(x, counts)`` call;
3. the reverse permutation and exchange bring every row back to its token's slot, and
   the outputs are combined with the routing weights (the ``LocalDispatcher`` sum).

Gradients flow back through the same exchanges in reverse (:class:`_AllToAll`).
With ``expert_tensor > 1`` the experts are also split along their width over ``expt_tp``
and the received rows are gathered / partial outputs reduce-scattered within it between
steps 1 and 3 (:mod:`mimotron.parallel.expert_tensor`).

**Ranks with identical tokens.** Dense tensor-parallel peers hold the same tokens (the
EP group may even consist of them: ``tensor = 2, expert = 2``). Each TP peer therefore
routes a disjoint contiguous slice of the tokens (``torch.chunk`` ranges over the TP
group) and the outputs are all-gathered within TP, so every token copy is computed
once. The replicated inputs (hidden states, routing weights) enter through
:class:`_SliceOfReplicated`, whose backward all-reduces the zero-padded slice gradients
over TP: each peer gets the full, identical input gradient, as TP's replicated
activations require. The gather's backward takes the peer's own rows of the (identical)
output gradient. Expert gradients are thus complete once summed over ``expt_dp``: the
ranks holding one expert shard together saw every token routed to it exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mimotron.host_sync import EXPERT_COUNTS, to_host
from mimotron.models.moe import expert_counts
from mimotron.parallel.expert_tensor import gather_counts, gather_rows, reduce_scatter_rows

EP_AXIS = "ep"
ETP_AXIS = "expt_tp"
EXPERT_PARAMS = ("w1", "w2", "w3")


@dataclass
class ExchangeBytes:
    """Bytes the token exchange moves, accumulated over calls (a benchmark instrument).

    Attributes:
        dispatch: bytes of token rows sent towards the experts (forward).
        combine: bytes of expert outputs sent back (forward).
        backward: bytes of gradient rows exchanged in backward (both directions).
        remote: the part of all the above that leaves this rank.
        counts: bytes of the per-expert count exchanges.
        rows: token copies dispatched (``tokens x k`` summed over calls).
    """

    dispatch: int = 0
    combine: int = 0
    backward: int = 0
    remote: int = 0
    counts: int = 0
    rows: int = 0


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
                counter: ExchangeBytes | None, kind: str) -> torch.Tensor:
    """``all_to_all_single`` of rows with variable splits; records bytes in ``counter``."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    if counter is not None:
        row = math.prod(x.shape[1:]) * x.element_size()
        me = dist.get_rank(group)
        total = sum(send) * row
        setattr(counter, kind, getattr(counter, kind) + total)
        counter.remote += total - send[me] * row
    return out


class _AllToAll(torch.autograd.Function):
    """Rows exchanged with variable splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int],  # noqa: ANN001
                group: dist.ProcessGroup, counter: ExchangeBytes | None,
                kind: str) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.counter = send, recv, group, counter
        return _all_to_all(x, send, recv, group, counter, kind)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        out = _all_to_all(grad, ctx.recv, ctx.send, ctx.group, ctx.counter, "backward")
        return out, None, None, None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
             counter: ExchangeBytes | None = None, kind: str = "dispatch") -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of the rows of ``x``.

    Args:
        x: ``[sum(send), ...]`` rows grouped by destination rank (rank order in ``group``).
        send: rows for each rank of ``group``.
        recv: rows from each rank (what they send to this one).
        group: the exchange group.
        counter: optional byte counter.
        kind: which ``counter`` field the forward bytes go to (``dispatch``/``combine``).

    Returns:
        ``[sum(recv), ...]`` rows grouped by source rank.
    """
    return _AllToAll.apply(x, list(send), list(recv), group, counter, kind)


def _chunk(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, end)`` of part ``index`` with ``torch.chunk`` semantics."""
    size = -(-rows // parts) if rows else 0
    start = min(index * size, rows)
    return start, min(start + size, rows)


class _SliceOfReplicated(torch.autograd.Function):
    """This TP peer's rows of a tensor replicated over TP; backward all-reduces over TP.

    Each peer's slice gradient lands in its own rows of a zero tensor and the SUM over
    the group gives every peer the full gradient of the replicated input.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, end: int,  # noqa: ANN001
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.shape, ctx.start, ctx.end, ctx.group = x.shape, start, end, group
        return x[start:end]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        full = grad.new_zeros(ctx.shape)
        full[ctx.start : ctx.end] = grad
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather the TP peers' row slices; backward keeps this peer's rows.

    The gathered result feeds computation replicated over TP, so every peer receives the
    same full gradient: its own rows of it are its slice's gradient (no reduction).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        chunk = -(-rows // size) if rows else 0
        ctx.start, ctx.end = _chunk(rows, size, me)
        padded = x.new_zeros((chunk, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((chunk * size, *x.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        pieces = []
        for r in range(size):
            start, end = _chunk(rows, size, r)
            pieces.append(out[r * chunk : r * chunk + end - start])
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad[ctx.start : ctx.end].contiguous(), None, None


def _runs(counts: list[int], width: int) -> list[int]:
    """Sums of consecutive ``width`` entries (per rank from per global expert)."""
    return [sum(counts[i : i + width]) for i in range(0, len(counts), width)]


def _usable(group: Any) -> bool:
    return isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) > 1


class ExpertParallelDispatcher:
    """The ``Dispatcher`` of an expert-parallel MoE layer (see the module docstring).

    Args:
        ep_group: the expert-parallel group (this rank holds the experts of its index).
        num_experts: global number of experts ``E`` (divisible by the group size).
        tp_group: the dense TP group whose peers hold identical tokens; ``None``/one rank
            when tokens differ on every rank of ``ep_group``.
        counter: optional byte counter for benchmarks.
        expt_tp_group: the expert tensor-parallel group when experts are split along
            ``F`` (:mod:`mimotron.parallel.expert_tensor`); ``None`` = whole experts.

    Raises:
        ValueError: ``num_experts`` not divisible by the EP size.
    """

    def __init__(self, ep_group: dist.ProcessGroup, num_experts: int,
                 tp_group: dist.ProcessGroup | None = None,
                 counter: ExchangeBytes | None = None,
                 expt_tp_group: dist.ProcessGroup | None = None) -> None:
        size = dist.get_world_size(ep_group)
        if num_experts % size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the expert-"
                             f"parallel degree {size}")
        self.group = ep_group
        self.num_experts = num_experts
        self.ep_size = size
        self.num_local = num_experts // size
        self.tp_group = tp_group if _usable(tp_group) else None
        self.etp_group = expt_tp_group if _usable(expt_tp_group) else None
        self.counter = counter

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 experts: nn.Module) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])`` for every token ``t``."""
        rows = x.shape[0]
        if self.tp_group is not None:
            start, end = _chunk(rows, dist.get_world_size(self.tp_group),
                                dist.get_rank(self.tp_group))
            x = _SliceOfReplicated.apply(x, start, end, self.tp_group)
            weights = _SliceOfReplicated.apply(weights, start, end, self.tp_group)
            expert_ids = expert_ids[start:end]
        out = self._routed(x, expert_ids, weights, experts)
        if self.tp_group is not None:
            out = _GatherReplicated.apply(out, rows, self.tp_group)
        return out

    def _counts(self, flat: torch.Tensor) -> tuple[torch.Tensor, list[int], list[list[int]]]:
        """Count choices per expert, exchange the counts, read them all in one host sync.

        Args:
            flat: ``[T·k]`` global expert ids of this rank's choices.

        Returns:
            ``(table, sent, received)``: the device table of received counts
            ``[(peer,) source rank, local expert]`` as ``[blocks, num_local]``; on the
            host, this rank's count per global expert, and per expert TP peer (one
            without expert TP) its received counts laid out ``[source, local expert]``.
        """
        per_expert = expert_counts(flat, self.num_experts)
        table = _all_to_all(per_expert.view(self.ep_size, self.num_local).clone(),
                            [1] * self.ep_size, [1] * self.ep_size, self.group, None,
                            "counts")  # [source rank, local expert]
        if self.counter is not None:
            self.counter.counts += 2 * per_expert.numel() * per_expert.element_size()
            self.counter.rows += flat.numel()
        if self.etp_group is not None:
            # [peer, source, expert]: the rows every expert TP peer will compute for.
            table = gather_counts(table, self.etp_group).reshape(-1, self.num_local)
        both = torch.cat([per_expert.view(1, -1), table.reshape(-1, self.num_experts)])
        rows = to_host(both, EXPERT_COUNTS, total=flat.numel())
        return table, rows[0], rows[1:]

    def _routed(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:
        """Dispatch, compute and combine this rank's tokens (``[T, H]``)."""
        tokens, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        # Stable sort by global expert id = by destination rank, then by local expert.
        order = torch.argsort(flat, stable=True)
        table, sent, received = self._counts(flat)
        send = _runs(sent, self.num_local)  # rows to each rank
        me = dist.get_rank(self.etp_group) if self.etp_group is not None else 0
        recv = _runs(received[me], self.num_local)  # rows from each rank
        dispatched = exchange(x[order // k], send, recv, self.group, self.counter, "dispatch")
        peer_rows = [sum(block) for block in received]
        if self.etp_group is not None:
            # Expert TP peers compute partial outputs for each other's rows as well.
            dispatched = gather_rows(dispatched, peer_rows, self.etp_group)
        # Rows are grouped by (peer,) source rank, then local expert: regroup by expert.
        # The row count is known on the host: no sync to size the result.
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=x.device).repeat(table.shape[0]),
            table.reshape(-1).to(x.device), output_size=sum(peer_rows))
        perm = torch.argsort(local_ids, stable=True)
        grouped = experts(dispatched[perm], [sum(sum(block[e :: self.num_local])
                                                 for block in received)
                                             for e in range(self.num_local)])
        out = grouped[torch.argsort(perm)]
        if self.etp_group is not None:
            out = reduce_scatter_rows(out, peer_rows, self.etp_group)
        back = exchange(out, recv, send, self.group, self.counter, "combine")
        per_copy = back[torch.argsort(order)].view(tokens, k, -1)
        return (per_copy * weights.unsqueeze(-1).to(per_copy.dtype)).sum(dim=1)


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether a parameter is an expert shard (a DTensor over an ``ep`` mesh axis)."""
    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return EP_AXIS in names


def expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, MoE block)`` of every module with ``experts`` and a ``dispatcher``."""
    return [(n, m) for n, m in module.named_modules()
            if hasattr(m, "dispatcher") and isinstance(getattr(m, "experts", None), nn.Module)]


def shard_experts(module: nn.Module, mesh: DeviceMesh, tp_group: dist.ProcessGroup | None,
                  counter: ExchangeBytes | None = None) -> int:
    """Shard every MoE block's experts over the ``ep`` (and ``expt_tp``) axes; set dispatchers.

    Parameters were initialised on the full shape (layout independent); each rank keeps
    its ``Shard(0)`` rows (its experts), and with an ``expt_tp`` axis its ``F`` columns
    (``w1``/``w3`` dim 1, ``w2`` dim 2), without any collective.

    Args:
        module: a module part (encoder or language stage) after initialisation.
        mesh: mesh over the EP group (axis ``ep``), or 2-D ``("ep", "expt_tp")``.
        tp_group: the module's dense TP group (peers with identical tokens).
        counter: optional byte counter shared by every layer's dispatcher.

    Returns:
        The number of MoE blocks sharded.
    """
    names = tuple(mesh.mesh_dim_names or (EP_AXIS,))
    etp = ETP_AXIS in names
    blocks = expert_modules(module)
    for _, block in blocks:
        experts = block.experts
        for pname in EXPERT_PARAMS:
            p = getattr(experts, pname)
            f_dim = 2 if pname == "w2" else 1
            local = p.detach().chunk(mesh.size(names.index(EP_AXIS)), dim=0)[
                mesh.get_local_rank(EP_AXIS)]
            placements = [Shard(0)]
            if etp:
                local = local.chunk(mesh.size(names.index(ETP_AXIS)), dim=f_dim)[
                    mesh.get_local_rank(ETP_AXIS)]
                placements.append(Shard(f_dim))
            shard = DTensor.from_local(local.contiguous().clone(), mesh, placements,
                                       run_check=False, shape=p.shape, stride=p.stride())
            setattr(experts, pname, nn.Parameter(shard, requires_grad=p.requires_grad))
        num_experts = getattr(experts, "num_experts", experts.w1.shape[0])
        block.dispatcher = ExpertParallelDispatcher(
            mesh.get_group(EP_AXIS), num_experts, tp_group, counter,
            mesh.get_group(ETP_AXIS) if etp else None)
    return len(blocks)

