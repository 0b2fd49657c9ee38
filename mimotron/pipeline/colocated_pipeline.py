"""Colocated layouts with a pipelined language model: encoders on every rank, then 1F1B.

Every module spans the same ranks, the encoders with pipeline 1 and the language model
with ``pipeline > 1``: each rank holds every encoder (its TP shard and DP slice) and one
language stage. A step has three phases, every rank running each one:

1. **encoders and bridge** (collective) — each encoder runs the step's micro-batches
   (one forward per micro-batch, or one for the whole step with
   ``train.encoder_batching``), and the colocated bridge
   (:class:`~mimotron.pipeline.colocated.ColocatedBridge`) re-slices every micro-batch's
   rows onto the language model's *first-stage* ranks: a world all-gather, of which a
   first-stage rank keeps its language slice and every other rank keeps nothing. Each
   kept tensor is detached into a leaf that requires grad;
2. **the language pipeline** — the language model's own 1F1B plan, exactly as a split
   layout holding only the language model runs it: stage links are
   the split layout's point-to-point links (:class:`~mimotron.pipeline.communicator.
   MultiModulePipelineCommunicator` over :func:`language_pipeline`), and the first stage
   merges micro-batch ``k``'s leaves where a split layout merges the rows it received.
   Its backwards leave the rows' gradients on the leaves;
3. **bridge and encoder backward** (collective) — micro-batch by micro-batch, edge by
   edge, each bridge output takes its leaf's gradient (zeros where the leaf got none:
   on stages past the first, rows of none), the bridge's world all-reduce hands every
   encoder slice its rows' gradients, and the encoders' backward follows (one per
   encoder after the last micro-batch under encoder batching). Under
   ``train.overlap_grad_reduce`` the language stage's buckets launch from its own last
   backward; the encoders' wait for the end of the step (:meth:`EncoderPhase.backward`).

The bridge's collectives need every rank at the same point, which a pipeline's stages
never are in the middle of a step; so they run before and after it. The cost is memory:
every micro-batch's encoder activations are alive through the pipeline (as under
encoder batching; ``mimotron plan`` counts them). A frozen encoder keeps none: its
forward has no autograd state, so it simply runs ahead of the whole pipeline.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from mimotron.names import LANGUAGE
from mimotron.parallel.layout import language_pipeline
from mimotron.pipeline.colocated import ColocatedTransport
from mimotron.pipeline.communicator import MultiModulePipelineCommunicator, Transfer
from mimotron.pipeline.edges import Edge
from mimotron.pipeline.encoder_batching import BatchedEncoders

if TYPE_CHECKING:
    from mimotron.pipeline.schedules import StepContext

Rows = dict[str, torch.Tensor]


class ColocatedPipelineTransport:
    """The transport of a colocated layout with a pipelined language model.

    Args:
        bridges: the colocated bridges (every encoder into the first language stage).
        stages: the language stage links (a communicator over :func:`language_pipeline`).
    """

    def __init__(self, bridges: ColocatedTransport, stages: MultiModulePipelineCommunicator
                 ) -> None:
        self.bridges = bridges
        self.stages = stages

    @property
    def edges(self) -> list[Edge]:
        """The module boundaries (every one colocated)."""
        return self.bridges.edges

    def transfer(self, batch: list[Transfer]) -> list[torch.Tensor | None]:
        """A run of language stage transfers (see the communicator)."""
        return self.stages.transfer(batch)

    def finish(self, forward_only: bool = False) -> None:
        """Wait for the stage links' sends in flight."""
        self.stages.finish(forward_only=forward_only)

    def set_timing(self, enabled: bool) -> None:
        """Time the stage links (the bridges count as compute, as in every colocated run)."""
        self.stages.set_timing(enabled)

    def pop_transfer_seconds(self) -> float:
        """Seconds spent in stage transfers since the last call."""
        return self.stages.pop_transfer_seconds()


class EncoderPhase:
    """Phases 1 and 3 (module docs): the step's encoder rows on the first language stage.

    Args:
        ctx: the step's context (its transport a :class:`ColocatedPipelineTransport`).
    """

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.edges = ctx.transport.edges
        self.batched = (BatchedEncoders(ctx.model, self.edges, ctx.microbatches)
                        if ctx.encoder_batching else None)
        self._bridged: list[Rows] = []
        self.leaves: list[Rows] = []

    def forward(self) -> None:
        """Every micro-batch's encoder rows through the bridge, in (micro-batch, edge)
        order on every rank; ``leaves[k]`` holds what the first stage merges."""
        ctx, model = self.ctx, self.ctx.model
        with ctx.autocast():
            for k, mb in enumerate(ctx.microbatches):
                bridged, leaves = {}, {}
                for e in self.edges:
                    rows = (self.batched.rows(e.src, k) if self.batched is not None
                            else model.encode(e.src, mb[e.src]))
                    out = ctx.transport.bridges.bridge(e, rows, mb[e.src], mb[LANGUAGE],
                                                       model.placeholder_ids[e.src])
                    leaves[e.src] = out.detach().requires_grad_(out.requires_grad)
                    if out.requires_grad:
                        bridged[e.src] = out
                self._bridged.append(bridged)
                self.leaves.append(leaves)

    def backward(self) -> None:
        """The bridges' and encoders' backward, in (micro-batch, edge) order.

        The encoders' parameters are not armed for ``train.overlap_grad_reduce``: their
        buckets wait for the flush at the end of the step. Armed, a rank would launch them
        here between the bridges' world all-reduces, but a rank of a stage holding a late
        language bucket (an expert one, a sequence-parallel norm's) only at the flush:
        ranks would then issue two collectives they share in different orders, which
        NCCL does not allow.
        """
        for k, bridged in enumerate(self._bridged):
            for name, out in bridged.items():
                leaf = self.leaves[k][name]
                out.backward(leaf.grad if leaf.grad is not None else torch.zeros_like(out))
        if self.batched is not None:
            self.batched.backward()
        self._bridged.clear()
        self.leaves.clear()


def pipeline_context(ctx: StepContext, phase: EncoderPhase) -> StepContext:
    """The language pipeline's context: the language-only layout, its stage links,
    and the first stage's rows from ``phase``."""
    return dataclasses.replace(ctx, layout=language_pipeline(ctx.layout),
                               transport=ctx.transport.stages, encoder_batching=False,
                               first_stage_rows=phase.leaves)

