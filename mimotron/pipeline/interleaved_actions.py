"""Interleaved 1F1B plans (virtual pipeline stages), as pure functions.

A module with ``pipeline = p`` and ``virtual_pipeline = v > 1`` is cut into ``p * v``
contiguous layer chunks (*virtual stages*); pipeline rank ``r`` holds chunks
``r, r + p, r + 2p, ...``: its model chunk ``j`` is virtual stage ``j * p + r``.
Activations travel round the ring of stage ranks: ``r -> r + 1`` and, from the last
rank, ``p - 1 -> 0`` into the next chunk; gradients go the other way.

The compute order is Megatron's ``forward_backward_pipelining_with_interleaving``:
the step's ``N * v`` forwards are numbered in groups of ``p`` micro-batches per chunk
(forward ``i`` runs chunk ``(i mod pv) div p`` on micro-batch ``(i div pv) p + i mod p``;
backwards walk the chunks from last to first), the warm-up on rank ``r`` is
``(p - r - 1) * 2 + (v - 1) * p`` forwards (capped at ``N * v``), then one forward
and one backward alternate, then the cool-down backwards. ``N`` must be a multiple of
``p`` (the layout validator says so).

Communication is derived from the compute orders of all stage ranks: every compute is
followed by its send (sends never block, :mod:`mimotron.pipeline.p2p`), and before a
compute the rank receives, *in the sender's order*, every message of that channel up to
the one it needs. With ``p = 2`` the two ring directions share one pair of ranks, so a
channel carries activations and gradients interleaved; receiving in the sender's order
keeps the per-pair FIFO matching of point-to-point messages right, and it never waits
longer than the needed message would. Across modules (encoders -> the language model's
first virtual stage) messages flow in micro-batch order on both sides.

Encoders that feed an interleaved language model keep 1F1B but warm up long enough for
the language model's first rank, which takes several inputs before it returns the first
gradient (:func:`inputs_before_gradients`); an interleaved encoder likewise warms
up until it has sent what the language model's first stage needs.
"""

from __future__ import annotations

from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, is_colocated_pipeline, language_pipeline
from mimotron.pipeline.actions import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    build_1f1b_actions,
    build_forward_only_actions,
    pipeline_positions,
)

# One compute of a rank: (FORWARD | BACKWARD, chunk, micro-batch).
Compute = tuple[str, int, int]


def check_interleaving(num_microbatches: int, pipeline: int, virtual: int) -> None:
    """Raise ``ValueError`` unless an interleaved schedule can run these counts."""
    if pipeline < 2 or virtual < 2:
        raise ValueError(f"interleaving needs pipeline >= 2 and virtual_pipeline >= 2, "
                         f"got pipeline={pipeline}, virtual_pipeline={virtual}")
    if num_microbatches < 1 or num_microbatches % pipeline:
        raise ValueError(f"num_microbatches={num_microbatches} is invalid for interleaving: "
                         f"it must be a positive multiple of pipeline={pipeline}")


def chunk_of(i: int, pipeline: int, virtual: int, forward: bool) -> int:
    """Model chunk of a rank's ``i``-th forward (or backward) in Megatron's order."""
    chunk = (i % (pipeline * virtual)) // pipeline
    return chunk if forward else virtual - 1 - chunk


def microbatch_of(i: int, pipeline: int, virtual: int) -> int:
    """Micro-batch of a rank's ``i``-th forward (or backward)."""
    return (i // (pipeline * virtual)) * pipeline + i % pipeline


def forward_index(chunk: int, microbatch: int, pipeline: int, virtual: int) -> int:
    """Inverse of (:func:`chunk_of`, :func:`microbatch_of`) for forwards."""
    group, within = divmod(microbatch, pipeline)
    return group * pipeline * virtual + chunk * pipeline + within


def num_warmup(num_microbatches: int, pipeline: int, virtual: int, stage: int,
               extra: int = 0) -> int:
    """Megatron's warm-up forwards of pipeline rank ``stage`` (plus ``extra``), capped."""
    total = num_microbatches * virtual
    return min((pipeline - stage - 1) * 2 + (virtual - 1) * pipeline + extra, total)


def interleaved_compute_order(num_microbatches: int, pipeline: int, virtual: int,
                              stage: int, extra_warmup: int = 0) -> list[Compute]:
    """The forwards and backwards of one rank, in execution order.

    Args:
        num_microbatches: micro-batches in the step (a multiple of ``pipeline``).
        pipeline: stage ranks ``p`` of the module.
        virtual: model chunks per rank ``v``.
        stage: this rank's pipeline stage ``r``.
        extra_warmup: forwards added to the warm-up (an encoder feeding a deeper
            pipeline, see :func:`build_rank_actions`).
    """
    check_interleaving(num_microbatches, pipeline, virtual)
    total = num_microbatches * virtual
    warmup = num_warmup(num_microbatches, pipeline, virtual, stage, extra_warmup)

    def fwd(i: int) -> Compute:
        return FORWARD, chunk_of(i, pipeline, virtual, True), microbatch_of(i, pipeline, virtual)

    def bwd(i: int) -> Compute:
        return BACKWARD, chunk_of(i, pipeline, virtual, False), microbatch_of(i, pipeline,
                                                                              virtual)

    order = [fwd(i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(i) for i in range(total - warmup, total)]
    return order


def inputs_before_gradients(order: list[Compute], num_microbatches: int) -> list[int]:
    """For each micro-batch ``j``: chunk-0 forwards run before the backward of (0, ``j``).

    That many inputs must reach the first virtual stage before micro-batch ``j``'s
    gradient leaves it: what an upstream module must send before it waits for it.
    """
    needs, count = [0] * num_microbatches, 0
    for kind, chunk, mb in order:
        if kind == BACKWARD and chunk == 0:
            needs[mb] = count
        count += kind == FORWARD and chunk == 0
    return needs


def _destination(op: Compute, stage: int, pipeline: int, virtual: int
                 ) -> tuple[int, str, int, int] | None:
    """``(rank stage, RECV kind, chunk there, micro-batch)`` of a compute's message.

    ``None`` when it leaves the module (or is the loss): those go across modules.
    """
    kind, chunk, mb = op
    if kind == FORWARD:
        if stage < pipeline - 1:
            return stage + 1, RECV_FORWARD, chunk, mb
        return (0, RECV_FORWARD, chunk + 1, mb) if chunk < virtual - 1 else None
    if stage > 0:
        return stage - 1, RECV_BACKWARD, chunk, mb
    return (pipeline - 1, RECV_BACKWARD, chunk - 1, mb) if chunk > 0 else None


def _source(op: Compute, stage: int, pipeline: int, virtual: int) -> int | None:
    """Stage rank whose message a compute needs, or ``None`` (data, loss, other module)."""
    kind, chunk, _ = op
    if kind == FORWARD:
        if stage > 0:
            return stage - 1
        return pipeline - 1 if chunk > 0 else None
    if stage < pipeline - 1:
        return stage + 1
    return 0 if chunk < virtual - 1 else None


def build_interleaved_actions(num_microbatches: int, pipeline: int, virtual: int, stage: int,
                           *, has_prev: bool, has_next: bool, extra_warmup: int = 0
                           ) -> list[Action]:
    """The interleaved 1F1B plan of one stage rank (computes and transfers).

    Args:
        num_microbatches: micro-batches in the step (a multiple of ``pipeline``).
        pipeline: stage ranks ``p``.
        virtual: model chunks per rank ``v`` (``>= 2``).
        stage: this rank's pipeline stage.
        has_prev: the module's first virtual stage receives from another module
            (the language model fed by encoders).
        has_next: the module's last virtual stage sends to another module (an encoder).
        extra_warmup: forwards added to every rank's warm-up.

    Returns:
        The actions in execution order; ``Action.chunk`` names the model chunk.
    """
    orders = [interleaved_compute_order(num_microbatches, pipeline, virtual, s, extra_warmup)
              for s in range(pipeline)]
    # Per sending stage: the messages it sends to this rank, in its order.
    inbox = {s: [d[1:] for op in orders[s]
                 if (d := _destination(op, s, pipeline, virtual)) and d[0] == stage]
             for s in range(pipeline)}
    taken = dict.fromkeys(inbox, 0)
    plan: list[Action] = []
    for op in orders[stage]:
        kind, chunk, mb = op
        src = _source(op, stage, pipeline, virtual)
        want = (RECV_FORWARD if kind == FORWARD else RECV_BACKWARD, chunk, mb)
        if src is not None:
            while True:  # Everything the sender sent before, in its order.
                got = inbox[src][taken[src]]
                taken[src] += 1
                plan.append(Action(got[0], got[2], chunk=got[1]))
                if got == want:
                    break
        elif kind == FORWARD and stage == 0 and has_prev:
            plan.append(Action(RECV_FORWARD, mb, chunk=0))
        elif kind == BACKWARD and stage == pipeline - 1 and has_next:
            plan.append(Action(RECV_BACKWARD, mb, chunk=virtual - 1))
        plan.append(Action(kind, mb, chunk=chunk))
        dest = _destination(op, stage, pipeline, virtual)
        if dest is not None or (kind == FORWARD and has_next) or (kind == BACKWARD
                                                                    and has_prev):
            plan.append(Action(SEND_FORWARD if kind == FORWARD else SEND_BACKWARD, mb,
                               chunk=chunk))
    return plan


def _lm_input_needs(layout: Layout, num_microbatches: int) -> list[int]:
    """Inputs the language model's first stage takes before micro-batch ``j``'s gradient."""
    par = layout.modules[LANGUAGE].parallel
    if par.virtual_pipeline > 1:
        order = interleaved_compute_order(num_microbatches, par.pipeline,
                                          par.virtual_pipeline, 0)
        return inputs_before_gradients(order, num_microbatches)
    # 1F1B: (p - 1) warm-up forwards, then one forward per backward.
    return [min(j + par.pipeline, num_microbatches) for j in range(num_microbatches)]


def _encoder_extra_warmup(needs: list[int], pipeline: int, virtual: int) -> int:
    """Warm-up an interleaved encoder adds so its last chunk stays ahead of ``needs``.

    Before the backward of (last chunk, ``j``) the last rank must have run the forward
    of (last chunk, ``needs[j] - 1``); in the steady state forward ``W + i`` precedes
    backward ``i``, so the warm-up ``W`` must cover the largest index gap.
    """
    n = len(needs)
    gap = max(forward_index(virtual - 1, needs[j] - 1, pipeline, virtual)
              - forward_index(0, j, pipeline, virtual)  # backward index of (last chunk, j)
              for j in range(n))
    return max(0, gap - num_warmup(n, pipeline, virtual, pipeline - 1))


def build_rank_actions(layout: Layout, module: str, stage: int, num_microbatches: int,
                    pipelined: bool = True, forward_only: bool = False) -> list[Action]:
    """The plan of one (module, pipeline stage) of a layout: 1F1B or interleaved.

    Args:
        layout: the placement (its modules' ``virtual_pipeline`` choose the schedule).
        module: the module this rank holds (colocated layouts: any; the language model
            of a colocated pipelined one: its stage's plan).
        stage: the rank's pipeline stage of ``module``.
        num_microbatches: micro-batches in the step.
        pipelined: ``False``: no warm-up (1F1B plans only; interleaving is pipelined).
        forward_only: evaluation (forwards only, every chunk in turn).
    """
    if module == LANGUAGE and is_colocated_pipeline(layout):  # its own stages' plans
        layout = language_pipeline(layout)
    pos = pipeline_positions(layout)[(module, stage)]
    par = layout.modules[module].parallel
    v = par.virtual_pipeline if not layout.colocated else 1
    if forward_only or module in layout.ahead:  # evaluation, or a frozen encoder ahead
        if v == 1:
            return build_forward_only_actions(num_microbatches, pos)
        return build_interleaved_forward_only_actions(
            num_microbatches, par.pipeline, v, stage,
            has_prev=pos.has_prev and module == LANGUAGE, has_next=module != LANGUAGE)
    encoder = module != LANGUAGE and not layout.colocated
    needs = _lm_input_needs(layout, num_microbatches) if encoder else []
    if v > 1:
        extra = _encoder_extra_warmup(needs, par.pipeline, v) if encoder else 0
        return build_interleaved_actions(num_microbatches, par.pipeline, v, stage,
                                      has_prev=pos.has_prev and not encoder,
                                      has_next=encoder, extra_warmup=extra)
    min_warmup = 0
    if encoder and layout.modules[LANGUAGE].parallel.virtual_pipeline > 1:
        # Forwards sent before waiting for gradient j: warm-up + 1 + j (+1 per stage
        # further upstream).
        lead = max(need - j - 1 for j, need in enumerate(needs))
        min_warmup = lead + (par.pipeline - 1 - stage)
    return build_1f1b_actions(num_microbatches, pos, pipelined, min_warmup=min_warmup)


def build_interleaved_forward_only_actions(num_microbatches: int, pipeline: int, virtual: int,
                                       stage: int, *, has_prev: bool, has_next: bool
                                       ) -> list[Action]:
    """Evaluation: chunk after chunk, each over every micro-batch.

    Every rank finishes chunk ``j`` on all micro-batches before chunk ``j + 1``, so each
    ring channel carries its messages in one order on both ends (and without backwards
    no warm-up is needed).
    """
    plan = []
    for chunk in range(virtual):
        for k in range(num_microbatches):
            if stage > 0 or chunk > 0 or has_prev:
                plan.append(Action(RECV_FORWARD, k, chunk=chunk))
            plan.append(Action(FORWARD, k, chunk=chunk))
            if stage < pipeline - 1 or chunk < virtual - 1 or has_next:
                plan.append(Action(SEND_FORWARD, k, chunk=chunk))
    return plan
