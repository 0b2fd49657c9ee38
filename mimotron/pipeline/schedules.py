"""Schedules: run a step's micro-batches through every module stage on this rank.

The *plan* (what to do, in which order) comes from the pure functions in
:mod:`mimotron.pipeline.actions`; this module *executes* it. ``StageRunner`` knows how to
run one forward or backward of whatever this rank holds:

* a colocated rank holds every module: encoders, the colocated bridge, the language
  model and its loss run in-process, and one ``loss.backward()`` reaches the encoders
  (with a pipelined language model the rank holds one language stage: the encoders and
  bridges run before its plan and their backward after,
  :mod:`mimotron.pipeline.colocated_pipeline`);
* a non-colocated rank holds one pipeline stage of one module: it gets its input from
  the data (first encoder stage) or from the communicator (later stages, and the
  language model's first stage, which receives every encoder's embeddings), and hands
  its output to the communicator or, on the language model's last stage, to the loss.

A run's ``StepContext`` carries two objects besides the data: the *transport*, chosen
once at setup from the layout (``ColocatedTransport``,
``MultiModulePipelineCommunicator`` or ``ColocatedPipelineTransport``), and the
``LanguageStep``, which owns everything on
the language side (input merging, the forward step function, the loss).

With ``encoder_batching`` (colocated only) the encoders run the step's micro-batches in
one forward and one backward (:mod:`mimotron.pipeline.encoder_batching`); the language
side consumes their rows micro-batch by micro-batch.

:func:`rank_actions` gives a rank's 1F1B plan, or the plan with no warm-up (each
micro-batch's backward completes before the next forward); a run builds its plan once at
set-up and :func:`run_schedule` executes it each step. ``forward_only=True`` evaluates. A
module with ``virtual_pipeline > 1`` gets the interleaved plan
(:mod:`mimotron.pipeline.interleaved_actions`) from the same entry point and the same
executor: every action names its model chunk, the runner runs that chunk's layers, and
the transport picks the ring neighbour of that chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mimotron.host_sync import host_copy
from mimotron.models.attention import document_args
from mimotron.models.moe import set_aux_loss_weights
from mimotron.models.native_vision import tokens_key
from mimotron.names import LANGUAGE
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.layout import Layout, is_colocated_pipeline, language_pipeline
from mimotron.parallel.virtual_pipeline import (
    chunk_holder,
    is_first_virtual_stage,
    is_last_virtual_stage,
)
from mimotron.pipeline.actions import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    TRANSFER_KINDS,
    Action,
    unpaired,
)
from mimotron.pipeline.colocated import ColocatedTransport, first_stage_group
from mimotron.pipeline.colocated_pipeline import (
    ColocatedPipelineTransport,
    EncoderPhase,
    pipeline_context,
)
from mimotron.pipeline.communicator import MultiModulePipelineCommunicator, Transfer
from mimotron.pipeline.deepstack_link import deepstack_link
from mimotron.pipeline.edges import Edge
from mimotron.pipeline.encoder_batching import BatchedEncoders
from mimotron.pipeline.interleaved_actions import build_rank_actions
from mimotron.pipeline.links import build_link_groups, transport_links

if TYPE_CHECKING:  # the language step is handed in; the schedule only calls it
    from mimotron.training.language_step import LanguageStep, LossOutput

# How activations move: in-process (colocated) or between ranks (split layouts).
Transport = ColocatedTransport | MultiModulePipelineCommunicator | ColocatedPipelineTransport


def build_transport(layout: Layout, rank: int, micro_batch_size: int, edges: list[Edge],
                    tp_groups: dict[str, dist.ProcessGroup | None], device: torch.device,
                    seq_length: int | None = None, hidden_size: int | None = None,
                    bridge_rows: dict[str, tuple[int, int]] | None = None,
                    link_timeout: timedelta | None = None,
                    stage_dtype: torch.dtype = torch.float32,
                    deepstack: dict[tuple[int, bool], int] | None = None) -> Transport:
    """The run's transport, chosen once from the layout.

    Args:
        layout: the placement of every module.
        rank: this global rank.
        micro_batch_size: the global micro-batch size.
        edges: the module boundaries (``build_edges``).
        tp_groups: this rank's TP group per module it holds (split layouts only).
        device: where received tensors are allocated (split layouts only).
        seq_length: the padded sequence length; with ``hidden_size`` (the language
            model's), language stage links send no shape header (split layouts only).
        hidden_size: see ``seq_length``.
        bridge_rows: the bridges whose row count is fixed (split layouts only; see
            :func:`~mimotron.pipeline.shapes.bridge_row_shapes`): no header either.
        link_timeout: the timeout of the groups created here, collectively: the
            point-to-point link groups (:mod:`mimotron.pipeline.links`) and the
            first-stage placement's bridge group.
        stage_dtype: the language model's residual dtype, which its stage links carry
            (:func:`~mimotron.pipeline.shapes.residual_dtype`).
        deepstack: the DeepStack feature sets each language stage link of this rank
            carries (:func:`~mimotron.pipeline.deepstack_link.model_link_extras`).
    """
    hybrid = is_colocated_pipeline(layout)
    if layout.colocated and not hybrid:
        return ColocatedTransport(layout, rank, micro_batch_size, edges)
    stage_layout = language_pipeline(layout) if hybrid else layout
    links = (build_link_groups(transport_links(layout, micro_batch_size, edges), rank,
                               link_timeout) if dist.is_initialized() else None)
    comm = MultiModulePipelineCommunicator(
        stage_layout, rank, micro_batch_size, [] if hybrid else edges, tp_groups, device,
        seq_length, hidden_size, None if hybrid else bridge_rows, links,
        stage_dtype=stage_dtype, deepstack=deepstack)
    if hybrid:  # the bridges on the encoders' ranks, then the language stage links
        group = first_stage_group(layout, link_timeout) if dist.is_initialized() else None
        return ColocatedPipelineTransport(
            ColocatedTransport(layout, rank, micro_batch_size, edges, group), comm)
    return comm


@dataclass
class MicrobatchOutput:
    """What the language model's last stage produced for one micro-batch."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepContext:
    """Everything one schedule run needs besides the plan."""

    model: torch.nn.Module
    layout: Layout
    rank: int
    microbatches: list[dict[str, dict[str, torch.Tensor]]]
    language: LanguageStep
    transport: Transport
    loss_divisor: float = 1.0
    token_count: Callable[[], float] | None = None
    """If set, the divisor is still being reduced: :meth:`divisor` reads it on first use."""
    loss_scale: float = 1.0
    forward_only: bool = False
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    grad_sync: GradSync | None = None
    """The step's gradient finalisation, armed before the last micro-batch's backward
    (its hooks launch buckets under ``train.overlap_grad_reduce``)."""
    encoder_batching: bool = False
    """Colocated only: each encoder runs the step in one forward and one backward
    (``train.encoder_batching``; :mod:`mimotron.pipeline.encoder_batching`)."""
    first_stage_rows: list[dict[str, torch.Tensor]] | None = None
    """A colocated layout's pipelined language model: each micro-batch's encoder rows,
    which its first stage merges (:mod:`mimotron.pipeline.colocated_pipeline`)."""

    def divisor(self) -> float:
        """``loss_divisor``, or ``max(token_count(), 1)`` (waited for once) if pending."""
        if self.token_count is not None:
            self.loss_divisor, self.token_count = max(self.token_count(), 1.0), None
        return self.loss_divisor


class StageRunner:
    """Forward and backward of one (model chunk, micro-batch) on this rank (module docs).

    Without interleaving the chunk is always 0 and the rank's whole stage runs.
    """

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.outputs: list[MicrobatchOutput] = []
        self._saved: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.roles = {r.module: r for r in ctx.layout.roles(ctx.rank)}
        self.colocated = ctx.layout.colocated
        self.module = None if self.colocated else next(iter(self.roles))
        self.num_chunks = (1 if self.module is None
                           else ctx.layout.modules[self.module].parallel.virtual_pipeline)
        assert self.colocated == isinstance(ctx.transport, ColocatedTransport), \
            "the transport does not match the layout (choose it with build_transport)"
        if ctx.encoder_batching and not self.colocated:
            raise ValueError("encoder_batching=True needs a colocated layout (a split layout "
                             "runs each encoder stage on its own ranks); set it to False")
        self.batched = (BatchedEncoders(ctx.model, ctx.transport.edges, ctx.microbatches)
                        if ctx.encoder_batching else None)
        self.deepstack = (deepstack_link(ctx.model) if self.module == LANGUAGE else None)

    def _is_first(self, chunk: int) -> bool:
        return is_first_virtual_stage(self.roles[self.module], chunk)

    def _is_last(self, chunk: int) -> bool:
        return is_last_virtual_stage(self.roles[self.module], chunk, self.num_chunks)

    def _chunk_arg(self, chunk: int) -> dict[str, int]:
        """The model's ``chunk`` keyword under interleaving; nothing otherwise."""
        return {"chunk": chunk} if self.num_chunks > 1 else {}

    def modality_mask(self, k: int) -> torch.Tensor | None:
        """This rank's presence mask of its encoder module for micro-batch ``k``.

        The batch's host copy where it keeps one: the communicator counts each peer's
        rows from it, with no device sync. An encoder whose items are dealt by cost
        (:mod:`mimotron.data.balance`) gives how many of its items each sample of the
        micro-batch holds instead.
        """
        model, m = self.ctx.model, self.module
        if m is None or m == LANGUAGE:
            return None
        batch, modality = self.ctx.microbatches[k][m], model.modality_of[m]
        if f"{modality}_sample" in batch:  # balanced items: this replica's per sample
            return torch.bincount(host_copy(batch, f"{modality}_sample"))
        return host_copy(batch, f"has_{modality}")

    def placeholder_tokens(self, k: int
                           ) -> tuple[torch.Tensor, int, torch.Tensor | None] | None:
        """``(tokens of this encoder rank's slice, placeholder id, item token counts)`` for
        micro-batch ``k``.

        The bridge into a context-parallel language model routes each encoder row to the
        CP rank holding its placeholder (:func:`~mimotron.parallel.context_parallel.
        placeholder_selection`); a native-resolution encoder's rows are its items' real
        slots, whose counts (the batch's ``<modality>_tokens``, on the host) come third
        (``None`` for every other encoder). ``None`` off encoder ranks.
        """
        model, m = self.ctx.model, self.module
        if m is None or m == LANGUAGE:
            return None
        batch, key = self.ctx.microbatches[k][m], tokens_key(model.modality_of[m])
        if "tokens" not in batch:  # an item batch (data.balance_encoders): no CP routing
            return None
        counts = host_copy(batch, key) if key in batch else None
        return batch["tokens"], model.placeholder_ids[m], counts

    # ---- forward -------------------------------------------------------------------------
    def forward(self, k: int, received: Any, chunk: int = 0) -> Any:
        if self.colocated or self.module == LANGUAGE:
            self._set_moe_weights(k)
        with self.ctx.autocast():
            if self.colocated:
                return self._forward_colocated(k)
            if self.module == LANGUAGE:
                return self._forward_language(k, received, chunk)
            return self._forward_encoder(k, received, chunk)

    def _set_moe_weights(self, k: int) -> None:
        """Per-sample aux-loss weights of micro-batch ``k`` for this stage's MoE layers.

        ``d objective / d aux_b = n_b · loss_scale / global_loss_tokens`` (see
        :mod:`mimotron.models.moe`); every language stage knows its samples' loss masks,
        so a stage before the loss injects its own aux gradient.
        """
        lm = self.ctx.model.language_model
        if getattr(lm, "moe", None) is None:
            return
        weights = None
        if not self.ctx.forward_only:
            mask = self.ctx.microbatches[k][LANGUAGE]["loss_mask"]
            weights = mask.flatten(1).float().sum(1) * (self.ctx.loss_scale
                                                          / self.ctx.divisor())
        set_aux_loss_weights(lm, weights)

    def _forward_colocated(self, k: int) -> None:
        mb, model = self.ctx.microbatches[k], self.ctx.model
        transport = self.ctx.transport
        batched = self.batched
        embeds = {e.src: transport.bridge(
            e, batched.rows(e.src, k) if batched else model.encode(e.src, mb[e.src]),
            mb[e.src], mb[LANGUAGE], model.placeholder_ids[e.src]) for e in transport.edges}
        loss = self.ctx.language.forward_step(model, mb[LANGUAGE], embeds)
        self._record_loss(k, loss)

    def _forward_encoder(self, k: int, received: torch.Tensor | None, chunk: int
                         ) -> torch.Tensor:
        model, m = self.ctx.model, self.module
        ahead = m in self.ctx.layout.ahead and not self.ctx.forward_only
        # Running ahead (a frozen encoder): no autograd state, nothing kept for backward.
        with torch.no_grad() if ahead else contextlib.nullcontext():
            if self._is_first(chunk):
                out = model.encode(m, self.ctx.microbatches[k][m], **self._chunk_arg(chunk))
            else:
                out = model.modality_submodules[m](received, **self._chunk_arg(chunk))
        if not ahead:
            self._saved[(chunk, k)] = (received, out)
        return out

    def _forward_language(self, k: int, received: Any, chunk: int) -> torch.Tensor | None:
        role, model = self.roles[LANGUAGE], self.ctx.model
        batch = self.ctx.microbatches[k][LANGUAGE]
        if role.is_first_stage and role.is_last_stage:
            self._saved[(chunk, k)] = (received, None)
            self._record_loss(k, self.ctx.language.forward_step(model, batch, received or {}))
            return None
        lm, link = model.language_model, self.deepstack
        carried: list[torch.Tensor | None] = []  # DeepStack sets passed on as received
        if self._is_first(chunk):
            rows = self.ctx.first_stage_rows
            embeds = received if rows is None else rows[k]
            hidden, visual = self.ctx.language.first_stage_input(model, batch, embeds or {})
        elif link is not None:
            hidden, visual, carried = link.stage_input(lm, batch, received, chunk)
        else:
            hidden, visual = received, {}
        out = lm(hidden, **document_args(batch), **visual, **self._chunk_arg(chunk))
        if self._is_last(chunk):
            self._saved[(chunk, k)] = (received, None)
            self._record_loss(k, self.ctx.language.loss(model, batch, out), chunk)
            return None
        if link is not None:
            out = link.stage_output(lm, out, visual, carried, chunk)
        self._saved[(chunk, k)] = (received, out)
        return out

    def _record_loss(self, k: int, loss: LossOutput, chunk: int = 0) -> None:
        loss_sum, num_tokens, metrics = loss
        self.outputs.append(MicrobatchOutput(loss_sum.detach().float(), num_tokens.detach(),
                                             {n: v.detach() for n, v in metrics.items()}))
        if not self.ctx.forward_only:
            received = self._saved.get((chunk, k), (None, None))[0]
            self._saved[(chunk, k)] = (received, loss_sum)

    # ---- backward ------------------------------------------------------------------------
    def _chunk_params(self, chunk: int) -> list[torch.nn.Parameter] | None:
        """The parameters final after ``chunk``'s last backward (``None``: every one).

        Under interleaving, chunk ``j``'s layers; chunk 0's last backward is the rank's
        last one, so it also arms what lies outside the layers (embeddings, norms, head,
        projector): gradients that landed before that are flushed at the end, in order.
        """
        if self.num_chunks == 1 and self.ctx.first_stage_rows is None:
            return None
        model = self.ctx.model
        part = (model.language_model if self.module == LANGUAGE
                else model.modality_submodules[self.module])
        if self.num_chunks == 1:  # the rank's encoders (colocated pipeline) come later
            return list(part.parameters())
        holder = chunk_holder(part)
        params = [p for i in holder.layer_chunks[chunk]
                  for p in holder.layers[str(i)].parameters()]
        if chunk == 0:
            in_layers = {id(p) for p in holder.layers.parameters()}
            params += [p for p in part.parameters() if id(p) not in in_layers]
        return params

    def _sharded_by_fsdp(self) -> bool:
        """Whether this rank's (split-layout) module runs FSDP2 over data parallelism."""
        par = self.ctx.layout.modules[self.module].parallel
        return par.fsdp and par.data > 1

    def backward(self, k: int, grad: torch.Tensor | None, chunk: int = 0) -> Any:
        received, out = self._saved.pop((chunk, k))
        if self.ctx.grad_sync is not None and k == len(self.ctx.microbatches) - 1:
            # Each chunk's backwards run in micro-batch order: this one's gradients of
            # the chunk's parameters are final.
            self.ctx.grad_sync.arm(self._chunk_params(chunk))
        last_lm = self.colocated or (self.module == LANGUAGE and self._is_last(chunk))
        if last_lm:
            (out.float() * (self.ctx.loss_scale / self.ctx.divisor())).backward()
            if self.batched is not None and k == len(self.ctx.microbatches) - 1:
                self.batched.backward()  # after the grad sync was armed above
        elif out.requires_grad and out.numel():
            out.backward(grad.to(out.dtype))
        elif out.requires_grad and self._sharded_by_fsdp():
            # No rows of this modality here, yet FSDP2 gathers and reduce-scatters each
            # unit in its backward on every DP rank: a rank skipping it would leave its
            # peers waiting. The empty backward reduces zero gradients.
            out.backward(torch.zeros_like(out))
        if received is None:
            return None
        if isinstance(received, dict):  # not for encoders that run ahead (no grad)
            return {n: _grad_or_zeros(t) for n, t in received.items() if t.requires_grad}
        return _grad_or_zeros(received)


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def _execute(plan: list[Action], runner: StageRunner, comm: Transport) -> None:
    """Run a plan: compute actions on the runner, transfers on the transport.

    A colocated plan holds compute actions only (one position), so only split layouts'
    communicators transfer. Every run of transfers between two computes goes to the
    communicator as one exchange (sends, then receives, as batched groups), so
    neighbours that each send and then receive mirror each other under NCCL's rules.
    Tensors wait keyed by (chunk, micro-batch).
    """
    inputs: dict[tuple[int, int], Any] = {}
    outputs: dict[tuple[int, int], Any] = {}
    out_grads: dict[tuple[int, int], Any] = {}
    in_grads: dict[tuple[int, int], Any] = {}
    batch: list[Transfer] = []

    def flush() -> None:
        if batch:
            for t, got in zip(batch, comm.transfer(batch), strict=True):
                if t.kind == RECV_FORWARD:
                    inputs[(t.chunk, t.microbatch)] = got
                elif t.kind == RECV_BACKWARD:
                    out_grads[(t.chunk, t.microbatch)] = got
            batch.clear()

    def add(kind: str, c: int, k: int) -> None:
        payload = None
        if kind == SEND_FORWARD:
            payload = (k, outputs.pop((c, k)), runner.modality_mask(k),
                       runner.placeholder_tokens(k))
        elif kind == SEND_BACKWARD:
            payload = in_grads.pop((c, k))
        batch.append(Transfer(kind, c, k, payload))

    for a in plan:
        c, k = a.chunk, a.microbatch
        if a.kind == FORWARD:
            flush()
            outputs[(c, k)] = runner.forward(k, inputs.pop((c, k), None), c)
        elif a.kind == BACKWARD:
            flush()
            in_grads[(c, k)] = runner.backward(k, out_grads.pop((c, k), None), c)
        elif a.kind in TRANSFER_KINDS:  # a paired 1F1B transfer runs as one exchange
            for b in unpaired(a):
                add(b.kind, b.chunk, b.microbatch)
        else:
            raise AssertionError(f"unknown action {a}")
    flush()
    comm.finish(forward_only=runner.ctx.forward_only)


def rank_actions(layout: Layout, rank: int, num_microbatches: int, pipelined: bool,
              forward_only: bool = False) -> list[Action]:
    """This rank's plan of one schedule run (pure; a run's is built once at set-up).

    Args:
        layout: the placement of every module.
        rank: this global rank.
        num_microbatches: micro-batches per step.
        pipelined: 1F1B (warm-up / steady / cool-down per rank) if true, else micro-batch
            after micro-batch (each backward finishes before the next forward).
        forward_only: evaluation's forward-only plan.

    Returns:
        The actions of the (module, pipeline stage) this rank runs (colocated: the first
        module's single position; with a pipelined language model: its language stage's).
    """
    if is_colocated_pipeline(layout):  # the language model's stage plan
        module, stage = LANGUAGE, layout.modules[LANGUAGE].coordinate(rank)["pp"]
    elif layout.colocated:
        module, stage = next(iter(layout.modules)), 0
    else:
        (role,) = layout.roles(rank)
        module, stage = role.module, role.pp
    return build_rank_actions(layout, module, stage, num_microbatches, pipelined,
                           forward_only=forward_only)


def run_schedule(ctx: StepContext, plan: list[Action]) -> list[MicrobatchOutput]:
    """Run ``plan`` (:func:`rank_actions`) over the step's micro-batches on this rank.

    Returns:
        What the language model's last stage produced, one entry per micro-batch (none
        on other ranks).
    """
    with torch.no_grad() if ctx.forward_only else contextlib.nullcontext():
        if not isinstance(ctx.transport, ColocatedPipelineTransport):
            runner = StageRunner(ctx)
            _execute(plan, runner, ctx.transport)
            return runner.outputs
        phase = EncoderPhase(ctx)  # encoders and bridges, collectively, before the stages
        phase.forward()
        runner = StageRunner(pipeline_context(ctx, phase))
        _execute(plan, runner, ctx.transport.stages)
        if not ctx.forward_only:
            phase.backward()
    return runner.outputs
