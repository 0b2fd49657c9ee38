"""All-ranks checks of pipeline plans: data dependencies, pairing, completeness, deadlock.

A plan (:mod:`mimotron.pipeline.actions`, :mod:`mimotron.pipeline.interleaved_actions`) is
the list of actions one rank runs. Each check here takes every rank's plan at once
and raises :class:`ActionListError` (a ``ValueError``) naming the rank, the index of the
offending action in that rank's plan and the rule it breaks:

* **per rank** (:func:`check_rank`) — every (chunk, micro-batch) is computed forward
  (and, when training, backward) exactly once; a send of a tensor comes after the
  compute that produces it; a forward that is not the module's first virtual stage
  (or is, fed by other modules) comes after the receive of its input; a backward comes
  after its own forward and, unless its virtual stage computes the loss, after the
  receive of its output gradient; every output with a consumer is sent;
* **per channel** (:func:`check_pairing`) — between two neighbours the sender's
  messages and the receiver's receives name the same (direction, chunk, micro-batch)
  in the same order (point-to-point messages between two ranks match in posting order);
* **together** (:func:`check_progress`) — run with non-blocking sends and blocking
  receives (gloo's rules, :mod:`mimotron.pipeline.p2p`), no rank waits forever.

The topology says who talks to whom: :func:`layout_topology` for a layout's module DAG,
:func:`ring_topology` for one module on its own. Messages are labelled with the
receiver's (chunk, micro-batch), so the checks hold for interleaved rings too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mimotron.parallel.layout import Layout, is_colocated_pipeline, language_pipeline
from mimotron.pipeline.actions import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    StageKey,
    unpaired,
)

Label = tuple[str, int, int]  # (FORWARD | BACKWARD, chunk at the receiver, micro-batch)
Plans = Mapping[StageKey, Sequence[Action]]
# Direction of the tensor each transfer moves.
_DIRECTION = {SEND_FORWARD: FORWARD, RECV_FORWARD: FORWARD,
              SEND_BACKWARD: BACKWARD, RECV_BACKWARD: BACKWARD}


class ActionListError(ValueError):
    """A plan breaks a rule: ``node``'s action number ``index`` (``len(plan)``: its end)."""

    def __init__(self, node: StageKey, index: int, action: Action | None, rule: str) -> None:
        self.node, self.index, self.action = node, index, action
        where = f"action #{index} {action!r}" if action is not None else f"end (#{index})"
        super().__init__(f"rank {node} {where}: {rule}")


@dataclass(frozen=True)
class Placement:
    """Where one rank sits: its module's ring of stage ranks and the modules around it.

    Attributes:
        ring: the module's stage ranks in pipeline order (this one included).
        stage: this rank's index in ``ring``.
        virtual: model chunks per rank (1 without interleaving).
        upstream: last stage ranks of the modules feeding the first virtual stage.
        downstream: first stage ranks of the modules the last virtual stage feeds.
        ahead: a module that runs ahead (``Layout.ahead``): forwards only, no gradient
            sent to it.
    """

    ring: tuple[StageKey, ...]
    stage: int
    virtual: int = 1
    upstream: tuple[StageKey, ...] = ()
    downstream: tuple[StageKey, ...] = ()
    ahead: bool = False

    def is_first(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the module's first virtual stage."""
        return self.stage == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the module's last virtual stage."""
        return self.stage == len(self.ring) - 1 and chunk == self.virtual - 1


Topology = Mapping[StageKey, Placement]


def ring_topology(module: str, pipeline: int, virtual: int = 1) -> dict[StageKey, Placement]:
    """One module alone: nodes ``(module, stage)`` for ``stage < pipeline``."""
    ring = tuple((module, s) for s in range(pipeline))
    return {node: Placement(ring, s, virtual) for s, node in enumerate(ring)}


def layout_topology(layout: Layout) -> dict[StageKey, Placement]:
    """Every ``(module, stage)`` of a layout, wired by its module DAG.

    A colocated layout runs the whole model in one position on every rank (activations
    cross modules in-process): each node stands alone; with a pipelined language model,
    its stages are wired as the language model alone (the encoders stand alone).
    """
    if layout.colocated:
        alone = {(m, 0): Placement(((m, 0),), 0) for m in layout.modules}
        if not is_colocated_pipeline(layout):
            return alone
        return {**alone, **layout_topology(language_pipeline(layout))}
    out: dict[StageKey, Placement] = {}
    for m, mod in layout.modules.items():
        par = mod.parallel
        ring = tuple((m, s) for s in range(par.pipeline))
        ups = tuple((src, layout.modules[src].parallel.pipeline - 1)
                    for src, dsts in layout.topology.items() if m in dsts)
        downs = tuple((dst, 0) for dst in layout.topology.get(m, []))
        for s, node in enumerate(ring):
            out[node] = Placement(ring, s, par.virtual_pipeline, ups, downs, m in layout.ahead)
    return out


def routes(topology: Topology, node: StageKey, action: Action) -> list[tuple[StageKey, Label]]:
    """``(peer, label)`` of every message a send or receive moves (``[]``: no peer).

    The label names the tensor as the receiver knows it (its chunk), so both ends of a
    channel label a message alike.
    """
    where = topology[node]
    direction, c, k = _DIRECTION[action.kind], action.chunk, action.microbatch
    ring, s = where.ring, where.stage
    sending = action.kind in (SEND_FORWARD, SEND_BACKWARD)
    if (direction == FORWARD) == sending:  # send_forward / recv_backward: next stage
        if s < len(ring) - 1:
            return [(ring[s + 1], (direction, c, k))]
        if c < where.virtual - 1:  # round the ring into the first rank's next chunk
            return [(ring[0], (direction, c + 1 if sending else c, k))]
        return [(peer, (direction, 0 if sending else c, k)) for peer in where.downstream]
    if s > 0:  # send_backward / recv_forward: previous stage
        return [(ring[s - 1], (direction, c, k))]
    if c > 0:
        return [(ring[-1], (direction, c - 1 if sending else c, k))]
    return [(peer, (direction, topology[peer].virtual - 1 if sending else c, k))
            for peer in where.upstream if direction == FORWARD or not topology[peer].ahead]


def expand(plan: Sequence[Action]) -> list[tuple[int, Action]]:
    """``(index in plan, action)`` with 1F1B's paired transfers as a send then a receive
    (:func:`~mimotron.pipeline.actions.unpaired`)."""
    return [(i, b) for i, a in enumerate(plan) for b in unpaired(a)]


def _compute_rule(where: Placement, a: Action, done: set[Label], received: set[Label],
                  forward_only: bool) -> str | None:
    """The dependency a compute breaks, or ``None``."""
    key = (a.kind, a.chunk, a.microbatch)
    if key in done:
        return "computed twice"
    if a.kind == FORWARD:
        fed = not where.is_first(a.chunk) or bool(where.upstream)
        if fed and key not in received:
            return "forward before the receive of its input"
        return None
    if forward_only:
        return "backward in a forward-only plan"
    if (FORWARD, a.chunk, a.microbatch) not in done:
        return "backward before its own forward"
    loss = where.is_last(a.chunk) and not where.downstream  # computes its own gradient
    if not loss and key not in received:
        return "backward before the receive of its output gradient"
    return None


def _transfer_rule(topology: Topology, node: StageKey, a: Action, done: set[Label],
                   moved: set[tuple[str, int, int]]) -> str | None:
    """The dependency a send or receive breaks, or ``None``."""
    label = (_DIRECTION[a.kind], a.chunk, a.microbatch)
    if not routes(topology, node, a):
        return "no neighbour on that side"
    if (a.kind, a.chunk, a.microbatch) in moved:
        return "transfers the same tensor twice"
    if a.kind in (SEND_FORWARD, SEND_BACKWARD) and label not in done:
        return f"sends {label} before computing it"
    return None


def check_rank(topology: Topology, node: StageKey, plan: Sequence[Action],
               num_microbatches: int, forward_only: bool = False) -> None:
    """Check one rank's plan on its own: data dependencies and a complete compute order.

    Args:
        topology: every rank's placement (the neighbours of ``node``).
        node: the rank whose plan this is.
        plan: its actions in execution order.
        num_microbatches: micro-batches in the step.
        forward_only: evaluation (no backward may appear).

    Raises:
        ActionListError: naming the rank, the action index and the broken rule.
    """
    where = topology[node]
    forward_only = forward_only or where.ahead
    done: set[Label] = set()
    received: set[Label] = set()
    moved: set[tuple[str, int, int]] = set()
    for i, a in expand(plan):
        if a.kind in (FORWARD, BACKWARD):
            if not (0 <= a.chunk < where.virtual and 0 <= a.microbatch < num_microbatches):
                raise ActionListError(node, i, a, "no such (chunk, micro-batch)")
            rule = _compute_rule(where, a, done, received, forward_only)
            done.add((a.kind, a.chunk, a.microbatch))
        elif a.kind in _DIRECTION:
            rule = _transfer_rule(topology, node, a, done, moved)
            moved.add((a.kind, a.chunk, a.microbatch))
            if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                received.add((_DIRECTION[a.kind], a.chunk, a.microbatch))
        else:
            rule = f"unknown action kind {a.kind!r}"
        if rule is not None:
            raise ActionListError(node, i, a, rule)
    _check_complete(topology, node, plan, done, moved, num_microbatches, forward_only)


def _check_complete(topology: Topology, node: StageKey, plan: Sequence[Action],
                    done: set[Label], moved: set[tuple[str, int, int]],
                    num_microbatches: int, forward_only: bool) -> None:
    """Every (chunk, micro-batch) computed, and every output with a consumer sent."""
    kinds = (FORWARD,) if forward_only else (FORWARD, BACKWARD)
    expected = {(kind, c, k) for kind in kinds for c in range(topology[node].virtual)
                for k in range(num_microbatches)}
    if missing := sorted(expected - done):
        raise ActionListError(node, len(plan), None, f"never computes {missing[:4]}")
    for kind, c, k in sorted(done):
        send = Action(SEND_FORWARD if kind == FORWARD else SEND_BACKWARD, k, chunk=c)
        if routes(topology, node, send) and (send.kind, c, k) not in moved:
            raise ActionListError(node, len(plan), None, f"never sends {(kind, c, k)}")


def _channels(topology: Topology, plans: Plans, sending: bool
              ) -> dict[tuple[StageKey, StageKey], list[tuple[Label, int, Action]]]:
    """Per channel ``(sender, receiver)``: ``(label, index, action)`` in one end's order."""
    kinds = (SEND_FORWARD, SEND_BACKWARD) if sending else (RECV_FORWARD, RECV_BACKWARD)
    out: dict[tuple[StageKey, StageKey], list[tuple[Label, int, Action]]] = {}
    for node, plan in plans.items():
        for i, a in expand(plan):
            if a.kind in kinds:
                for peer, label in routes(topology, node, a):
                    key = (node, peer) if sending else (peer, node)
                    out.setdefault(key, []).append((label, i, a))
    return out


def check_pairing(topology: Topology, plans: Plans) -> None:
    """Sends and receives pair up between neighbours: same labels, same order.

    Raises:
        ActionListError: at the first receive that does not match its channel's next message
            (or a message never received, named at its send).
    """
    sent, got = _channels(topology, plans, True), _channels(topology, plans, False)
    for src, dst in sorted(sent.keys() | got.keys(), key=repr):
        outbox, inbox = sent.get((src, dst), []), got.get((src, dst), [])
        for n, (label, i, a) in enumerate(inbox):
            if n >= len(outbox):
                raise ActionListError(dst, i, a,
                                      f"receives {label} from {src}, which never sends it")
            if outbox[n][0] != label:
                raise ActionListError(dst, i, a, f"receives {label} from {src}, whose message "
                                           f"#{n} is {outbox[n][0]} (action #{outbox[n][1]})")
        if len(outbox) > len(inbox):
            label, i, a = outbox[len(inbox)]
            raise ActionListError(src, i, a, f"sends {label} to {dst}, which never receives it")


def check_progress(topology: Topology, plans: Plans) -> None:
    """Run every plan together (sends never block, receives wait): no deadlock.

    Assumes :func:`check_pairing` passed, so a receive only waits for its message count.

    Raises:
        ActionListError: at the receive of the first rank still waiting when none can move.
    """
    steps = {node: expand(plan) for node, plan in plans.items()}
    at = dict.fromkeys(steps, 0)
    posted: dict[tuple[StageKey, StageKey], int] = {}
    taken: dict[tuple[StageKey, StageKey], int] = {}
    while any(at[n] < len(s) for n, s in steps.items()):
        moved = False
        for node, todo in steps.items():
            while at[node] < len(todo):
                a = todo[at[node]][1]
                if a.kind in (RECV_FORWARD, RECV_BACKWARD):
                    keys = [(peer, node) for peer, _ in routes(topology, node, a)]
                    if any(taken.get(k, 0) >= posted.get(k, 0) for k in keys):
                        break
                    for k in keys:
                        taken[k] = taken.get(k, 0) + 1
                elif a.kind in (SEND_FORWARD, SEND_BACKWARD):
                    for peer, _ in routes(topology, node, a):
                        posted[(node, peer)] = posted.get((node, peer), 0) + 1
                at[node] += 1
                moved = True
        if not moved:
            waiting = {n: s[at[n]][1] for n, s in steps.items() if at[n] < len(s)}
            node = next(iter(waiting))
            i = steps[node][at[node]][0]
            raise ActionListError(node, i, plans[node][i],
                            f"deadlock: every rank waits, next actions {waiting}")


def check_action_lists(topology: Topology, plans: Plans, num_microbatches: int,
                forward_only: bool = False) -> None:
    """Every check on every rank's plan: per rank, per channel, then all together.

    Args:
        topology: the placement of every rank (:func:`layout_topology`,
            :func:`ring_topology`); ``plans`` must cover exactly its ranks.
        plans: each rank's actions in execution order.
        num_microbatches: micro-batches in the step.
        forward_only: evaluation plans (forwards only).

    Raises:
        ActionListError: naming the rank, the action index and the broken rule.
    """
    if set(plans) != set(topology):
        raise ValueError(f"plans for {sorted(plans, key=repr)}, ranks "
                         f"{sorted(topology, key=repr)}")
    for node, plan in plans.items():
        check_rank(topology, node, plan, num_microbatches, forward_only)
    check_pairing(topology, plans)
    check_progress(topology, plans)
