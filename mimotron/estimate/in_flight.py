"""Forwards in flight: what a rank's training plan holds for backward, compute by compute.

A forward's saved tensors live until its backward runs (the executor keeps each
``(chunk, micro-batch)`` in :class:`~mimotron.pipeline.schedules.StageRunner` until
then). Replaying a rank's plan (:func:`~mimotron.pipeline.interleaved_actions.
build_rank_actions`: 1F1B, interleaved 1F1B, or an encoder warmed up to feed an
interleaved language model) gives, after every compute, how many forwards of each model
chunk are held; the memory estimate (:mod:`mimotron.estimate.memory`) takes its peak
from here rather than from a closed form of the warm-up.
"""

from __future__ import annotations

from mimotron.config.schema import MimoConfig
from mimotron.estimate.widths import encoder_batching_factor
from mimotron.parallel.layout import Layout
from mimotron.pipeline.actions import BACKWARD, FORWARD, Action
from mimotron.pipeline.interleaved_actions import build_rank_actions


def held_forwards(plan: list[Action], num_chunks: int = 1) -> list[tuple[int, ...]]:
    """Forwards whose backward has not run yet, per model chunk, after each compute.

    Args:
        plan: one rank's actions in execution order.
        num_chunks: model chunks of the rank (``virtual_pipeline``; 1 without it).

    Returns:
        One tuple of ``num_chunks`` counts per forward or backward of ``plan``.
    """
    held = [0] * num_chunks
    out: list[tuple[int, ...]] = []
    for action in plan:
        if action.kind == FORWARD:
            held[action.chunk] += 1
        elif action.kind == BACKWARD:
            held[action.chunk] -= 1
            assert held[action.chunk] >= 0, f"backward before its forward: {action}"
        else:
            continue
        out.append(tuple(held))
    return out


def rank_held_forwards(layout: Layout, module: str, stage: int, num_microbatches: int,
                       pipelined: bool = True) -> list[tuple[int, ...]]:
    """:func:`held_forwards` of the training plan the executor runs for ``(module, stage)``.

    Args:
        layout: the placement (its ``virtual_pipeline`` degrees choose the schedules).
        module: the module of the rank (colocated layouts: any; one position, but a
            pipelined language model's stages).
        stage: the rank's pipeline stage of ``module``.
        num_microbatches: micro-batches in the step.
        pipelined: ``False`` for ``train.schedule = "no_pipelining"``.
    """
    plan = build_rank_actions(layout, module, stage, num_microbatches, pipelined)
    chunks = 1 if layout.colocated else layout.modules[module].parallel.virtual_pipeline
    return held_forwards(plan, chunks)


def held_forwards_peak(cfg: MimoConfig, layout: Layout, name: str, stage: int,
                       weights: list[float] | None = None) -> float:
    """The peak, over a stage's training plan, of its held forwards weighted per chunk.

    After every compute of the plan (:func:`rank_held_forwards`) the forwards whose
    backward has not run yet are counted per model chunk and weighted by ``weights``
    (one per chunk, e.g. each chunk's bytes; ``None``: 1 each, the count). An encoder
    under ``train.encoder_batching`` holds the whole step at once
    (:func:`mimotron.estimate.memory.encoder_batching_factor`).

    Args:
        cfg: the run config (``train.schedule``, the micro-batches of a step).
        layout: its layout.
        name: the module.
        stage: the pipeline stage.
        weights: one weight per model chunk of the rank.
    """
    batched = encoder_batching_factor(cfg, name, layout)
    if batched > 1:
        trace: list[tuple[int, ...]] = [(batched,)]
    else:
        trace = rank_held_forwards(layout, name, stage, cfg.num_microbatches,
                                   pipelined=cfg.train.schedule == "1f1b")
    w = weights if weights is not None else [1.0] * len(trace[0])
    assert len(w) == len(trace[0]), f"{len(w)} weights for {len(trace[0])} chunks"
    return max(sum(n * x for n, x in zip(held, w, strict=True)) for held in trace)
