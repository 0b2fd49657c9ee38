"""Schedule plans: the ordered actions each rank performs in one step (pure functions).

The module DAG (every encoder feeds the language model) is flattened into one pipeline
of *positions*: the language model's stages come after the longest encoder chain, and a
shorter encoder chain is aligned to end just before the language model, so every chain
that feeds it finishes its forward at the same position. Then the classic
one-forward-one-backward (1F1B) plan applies per rank:

* **warm-up** — ``total - position - 1`` forwards (fewer if there are fewer
  micro-batches), so downstream stages fill up;
* **steady state** — alternate one forward and one backward; the send of a forward's
  output is paired with the receive of an earlier micro-batch's gradient (and vice
  versa) in one communication, so neighbours never wait on each other's sends;
* **cool-down** — the backwards left over from the warm-up.

A plan is a list of :class:`Action`. Communication actions name what is exchanged with
the previous stage(s) (``prev``: upstream stage or, for the language model's first
stage, every feeding encoder) and the next stage(s) (``next``). Ranks without a
neighbour on a side get no action for that side. The executor
(:mod:`mimotron.pipeline.schedules`) runs the list as written.
"""

from __future__ import annotations

from dataclasses import dataclass

from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, is_colocated_pipeline, language_pipeline

# Compute
FORWARD = "F"
BACKWARD = "B"
# Communication (with prev = upstream, next = downstream)
RECV_FORWARD = "recv_forward"  # activations from prev
SEND_FORWARD = "send_forward"  # activations to next
RECV_BACKWARD = "recv_backward"  # gradients from next
SEND_BACKWARD = "send_backward"  # gradients to prev
SEND_FORWARD_RECV_BACKWARD = "send_forward_recv_backward"
SEND_BACKWARD_RECV_FORWARD = "send_backward_recv_forward"
TRANSFER_KINDS = (RECV_FORWARD, SEND_FORWARD, RECV_BACKWARD, SEND_BACKWARD,
                  SEND_FORWARD_RECV_BACKWARD, SEND_BACKWARD_RECV_FORWARD)


@dataclass(frozen=True)
class Action:
    """One step of a plan: ``kind`` on micro-batch ``microbatch``.

    For the paired communications, ``microbatch`` is the one whose tensor is *sent*
    and ``other`` the one received. ``chunk`` is the model chunk (virtual stage) of an
    interleaved plan (:mod:`mimotron.pipeline.interleaved_actions`); 0 otherwise.
    """

    kind: str
    microbatch: int
    other: int | None = None
    chunk: int = 0

    def __repr__(self) -> str:
        tail = "" if self.other is None else f"/{self.other}"
        head = f"c{self.chunk}:" if self.chunk else ""
        return f"{self.kind}({head}{self.microbatch}{tail})"


def unpaired(a: Action) -> list[Action]:
    """A paired 1F1B transfer as its send, then its receive; any other action alone.

    The pair posts its send first (sends never block), so the split keeps its meaning;
    the executor and the plan checker read paired actions this one way.
    """
    if a.kind == SEND_FORWARD_RECV_BACKWARD:
        return [Action(SEND_FORWARD, a.microbatch, chunk=a.chunk),
                Action(RECV_BACKWARD, a.other, chunk=a.chunk)]
    if a.kind == SEND_BACKWARD_RECV_FORWARD:
        return [Action(SEND_BACKWARD, a.microbatch, chunk=a.chunk),
                Action(RECV_FORWARD, a.other, chunk=a.chunk)]
    return [a]


StageKey = tuple[str, int]
"""(module, pipeline stage): the one key of a stage's actions, its position, the
planner's lanes and the action-list checks."""


@dataclass(frozen=True)
class Position:
    """Where one module stage sits in the flattened pipeline."""

    module: str
    stage: int
    index: int  # position in the flattened pipeline
    total: int  # number of positions
    has_prev: bool
    has_next: bool
    grads_prev: bool | None = None
    """Whether gradients go back to the previous stage(s); ``None``: ``has_prev``. False
    where every feeding encoder runs ahead (``Layout.ahead``: it takes no gradient)."""

    @property
    def sends_grads(self) -> bool:
        """Whether this stage sends gradients upstream."""
        return self.has_prev if self.grads_prev is None else self.grads_prev


def pipeline_positions(layout: Layout) -> dict[StageKey, Position]:
    """Position of every (module, pipeline stage) of a layout's DAG.

    Colocated layouts run every module on every rank with one stage each: the whole
    model is a single position (total 1), activations cross modules in-process. A
    colocated layout with a pipelined language model has the positions of its language
    model alone (``language_pipeline``); its encoders run outside the pipeline.
    """
    if layout.colocated:
        alone = {(m, 0): Position(m, 0, 0, 1, False, False) for m in layout.modules}
        if not is_colocated_pipeline(layout):
            return alone
        return {**alone, **pipeline_positions(language_pipeline(layout))}
    encoders = [m for m in layout.modules if m != LANGUAGE]
    depth = max((layout.modules[m].parallel.pipeline for m in encoders), default=0)
    lm_depth = layout.modules[LANGUAGE].parallel.pipeline
    total = depth + lm_depth
    out = {}
    for m in encoders:
        p = layout.modules[m].parallel.pipeline
        for s in range(p):
            out[(m, s)] = Position(m, s, depth - p + s, total, s > 0, True)
    learners = [m for m in encoders if m not in layout.ahead]  # take gradients
    for s in range(lm_depth):
        out[(LANGUAGE, s)] = Position(LANGUAGE, s, depth + s, total, s > 0 or bool(encoders),
                                      s < lm_depth - 1, s > 0 or bool(learners))
    return out


def build_1f1b_actions(num_microbatches: int, position: Position, pipelined: bool = True,
                    min_warmup: int = 0) -> list[Action]:
    """The 1F1B plan of one rank.

    Args:
        num_microbatches: micro-batches in the step.
        position: the rank's place in the flattened pipeline.
        pipelined: ``False`` gives the no-pipelining order (no warm-up: every
            micro-batch's backward completes before the next forward starts).
        min_warmup: at least this many warm-up forwards (an encoder feeding an
            interleaved language model, which takes several inputs before its first
            gradient; :func:`~mimotron.pipeline.interleaved_actions.build_rank_actions`).

    Returns:
        The actions in execution order.
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} is invalid: expected >= 1")
    p = position
    warmup = min(max(p.total - p.index - 1, min_warmup), num_microbatches) if pipelined else 0
    remaining = num_microbatches - warmup
    # Warm-up: forwards only, filling the stages downstream (evaluation's plan).
    plan = build_forward_only_actions(warmup, p)
    # Steady state: one forward, one backward.
    if remaining and p.has_prev:
        plan.append(Action(RECV_FORWARD, warmup))
    for i in range(remaining):
        fwd, bwd = warmup + i, i
        plan.append(Action(FORWARD, fwd))
        if p.has_next:
            plan.append(Action(SEND_FORWARD_RECV_BACKWARD, fwd, bwd))
        plan.append(Action(BACKWARD, bwd))
        last = i == remaining - 1
        if p.sends_grads:
            plan.append(Action(SEND_BACKWARD, bwd) if last
                        else Action(SEND_BACKWARD_RECV_FORWARD, bwd, fwd + 1))
        elif p.has_prev and not last:  # inputs from encoders that run ahead only
            plan.append(Action(RECV_FORWARD, fwd + 1))
    # Cool-down: the backwards of the warm-up micro-batches.
    for k in range(remaining, num_microbatches):
        if p.has_next:
            plan.append(Action(RECV_BACKWARD, k))
        plan.append(Action(BACKWARD, k))
        if p.sends_grads:
            plan.append(Action(SEND_BACKWARD, k))
    return plan


def build_forward_only_actions(num_microbatches: int, position: Position) -> list[Action]:
    """Evaluation: receive, forward, send — micro-batch after micro-batch."""
    plan = []
    for k in range(num_microbatches):
        if position.has_prev:
            plan.append(Action(RECV_FORWARD, k))
        plan.append(Action(FORWARD, k))
        if position.has_next:
            plan.append(Action(SEND_FORWARD, k))
    return plan
