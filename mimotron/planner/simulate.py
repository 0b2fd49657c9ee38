"""Run the ranks' own action lists on a clock: the pipeline's makespan, not a formula.

The step-time model (:mod:`mimotron.planner.cost`) does not estimate the pipeline
bubble with ``(p - 1) / m``: it replays the plans the executor runs
(:func:`~mimotron.pipeline.interleaved_plan.build_rank_plan`, 1F1B or interleaved, over
the module DAG: encoders feed the language model's first stage) with a duration per
compute and per transfer, and reads off when each rank finishes.

Each *lane* is one (module, pipeline stage): every rank of it runs the same list at the
same time. A lane walks its actions in order:

* a compute (``F`` / ``B``) takes its ``work`` seconds at full speed, then its
  ``fixed`` seconds (collectives inside the compute, which use no cores); with
  ``host_cores > 0`` the work of lanes computing at once shares the host's cores:
  each progresses at ``min(1, host_cores / busy ranks)``;
* a send never blocks (as :mod:`mimotron.pipeline.p2p`): its message arrives after its
  transfer time;
* a receive waits for its message (the language model's first stage: for every
  encoder's).

The simulation is event driven (the next event is the earliest compute end or message
arrival), so its cost grows with the number of actions, not with the step's length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mimotron.names import LANGUAGE
from mimotron.pipeline.plan import (
    BACKWARD,
    FORWARD,
    RECV_BACKWARD,
    RECV_FORWARD,
    SEND_BACKWARD,
    SEND_FORWARD,
    Action,
    unpaired,
)

LaneKey = tuple[str, int]
"""(module, pipeline stage)."""
MessageKey = tuple[str, str, int, int, int]
"""(direction ``F`` / ``B``, receiving module, its stage, its chunk, micro-batch)."""


@dataclass(frozen=True)
class Lane:
    """One (module, stage)'s plan and what its computes cost.

    Attributes:
        plan: the actions in execution order (paired transfers are split here).
        num_ranks: ranks running the lane (they share the host's cores).
        pipeline: stages of the module; ``virtual``: its model chunks per rank.
        compute: ``(kind, chunk) -> (work_s, fixed_s)`` of one micro-batch.
    """

    plan: list[Action]
    num_ranks: int
    pipeline: int
    virtual: int
    compute: dict[tuple[str, int], tuple[float, float]]


@dataclass
class SimResult:
    """What the replay found.

    Attributes:
        makespan: when the last lane finished its last action (seconds).
        finish: lane -> when it finished.
        busy: lane -> seconds it spent in computes (stretched by shared cores).
    """

    makespan: float
    finish: dict[LaneKey, float] = field(default_factory=dict)
    busy: dict[LaneKey, float] = field(default_factory=dict)


def destinations(lanes: dict[LaneKey, Lane], key: LaneKey, action: Action
                 ) -> list[MessageKey]:
    """Where a send's message goes: the next (virtual) stage or across modules."""
    module, stage = key
    lane, chunk, mb = lanes[key], action.chunk, action.microbatch
    if action.kind == SEND_FORWARD:
        if stage < lane.pipeline - 1:
            return [("F", module, stage + 1, chunk, mb)]
        if chunk < lane.virtual - 1:
            return [("F", module, 0, chunk + 1, mb)]
        return [("F", LANGUAGE, 0, 0, mb)] if module != LANGUAGE else []
    if stage > 0:
        return [("B", module, stage - 1, chunk, mb)]
    if chunk > 0:
        return [("B", module, lane.pipeline - 1, chunk - 1, mb)]
    if module != LANGUAGE:
        return []
    return [("B", m, lanes[(m, 0)].pipeline - 1, lanes[(m, 0)].virtual - 1, mb)
            for m, s in lanes if m != LANGUAGE and s == 0]


def _senders(lanes: dict[LaneKey, Lane], message: MessageKey) -> int:
    """Messages a receive waits for: every encoder's at the language model's input."""
    direction, module, stage, chunk, _ = message
    if direction == "F" and module == LANGUAGE and stage == 0 and chunk == 0:
        return sum(1 for m, s in lanes if m != LANGUAGE and s == 0)
    return 1


@dataclass
class _State:
    pos: int = 0
    work: float = 0.0  # cores-bound seconds left of the running compute
    fixed: float = 0.0  # fixed seconds left after it
    computing: bool = False
    started: float = 0.0


def simulate(lanes: dict[LaneKey, Lane], transfer: Callable[[LaneKey, MessageKey], float],
             host_cores: int = 0) -> SimResult:
    """Replay every lane's plan; see the module docstring.

    Args:
        lanes: the lanes of the layout.
        transfer: seconds a message takes from a sending lane to its receiver.
        host_cores: cores the ranks share (0 = every rank has its own device).

    Returns:
        The makespan and each lane's finish and busy time.

    Raises:
        AssertionError: the plans deadlock (an internal invariant: the plan builders'
            lists never do).
    """
    plans = {k: [u for a in lane.plan for u in unpaired(a)] for k, lane in lanes.items()}
    states = {k: _State() for k in lanes}
    arrived: dict[MessageKey, list[float]] = {}
    result = SimResult(0.0, {}, dict.fromkeys(lanes, 0.0))
    now = 0.0
    while True:
        moved = True
        while moved:  # a send at `now` may free a receive of a lane already visited
            moved = False
            for key, st in states.items():
                before = st.pos, st.computing
                if not st.computing:
                    _advance(lanes, key, plans[key], st, arrived, transfer, now)
                moved |= (st.pos, st.computing) != before
                if st.pos == len(plans[key]) and key not in result.finish:
                    result.finish[key] = now
        running = [k for k, st in states.items() if st.computing]
        waits = [t for k, st in states.items() if not st.computing and st.pos < len(plans[k])
                 for t in _pending_arrival(lanes, plans[k][st.pos], k, arrived) if t > now]
        if not running and not waits:
            break
        busy = sum(lanes[k].num_ranks for k in running if states[k].work > 0)
        rate = min(1.0, host_cores / busy) if host_cores > 0 and busy else 1.0
        ends = [now + (st.work / rate if st.work > 0 else st.fixed)
                for st in (states[k] for k in running)]
        following = min(ends + waits)
        step = following - now
        for k in running:
            st = states[k]
            _progress(st, step, rate)
            if st.work == 0.0 and st.fixed <= 1e-12:  # float residue
                st.computing, st.pos = False, st.pos + 1
                result.busy[k] += now + step - st.started
        now = following  # not now + step: a float sum may stop short of an arrival
    for key, st in states.items():
        assert st.pos == len(plans[key]), f"plans deadlock at {key}: {plans[key][st.pos]}"
    result.makespan = now
    return result


def _progress(st: _State, step: float, rate: float) -> None:
    """Advance a running compute by ``step`` seconds (work first, then fixed)."""
    if st.work > 0:
        used = min(st.work, step * rate)
        st.work -= used
        step -= used / rate
        if st.work <= 1e-12:  # float residue: a step past `now` may not move the clock
            st.work = 0.0
    st.fixed = max(0.0, st.fixed - step)


def _pending_arrival(lanes: dict[LaneKey, Lane], action: Action, key: LaneKey,
                     arrived: dict[MessageKey, list[float]]) -> list[float]:
    """The arrival time a blocked receive waits for, once every sender has sent."""
    message = _received(key, action)
    if message is None or len(arrived.get(message, [])) < _senders(lanes, message):
        return []
    return [max(arrived[message])]


def _received(key: LaneKey, action: Action) -> MessageKey | None:
    if action.kind == RECV_FORWARD:
        return ("F", key[0], key[1], action.chunk, action.microbatch)
    if action.kind == RECV_BACKWARD:
        return ("B", key[0], key[1], action.chunk, action.microbatch)
    return None


def _advance(lanes: dict[LaneKey, Lane], key: LaneKey, plan: list[Action], st: _State,
             arrived: dict[MessageKey, list[float]],
             transfer: Callable[[LaneKey, MessageKey], float], now: float) -> None:
    """Run a lane's sends and ready receives until it starts a compute or blocks."""
    while st.pos < len(plan):
        action = plan[st.pos]
        if action.kind in (FORWARD, BACKWARD):
            work, fixed = lanes[key].compute[(action.kind, action.chunk)]
            st.work, st.fixed, st.computing, st.started = work, fixed, True, now
            if work <= 0 and fixed <= 0:  # nothing to do: complete at once
                st.computing, st.pos = False, st.pos + 1
                continue
            return
        if action.kind in (SEND_FORWARD, SEND_BACKWARD):
            for message in destinations(lanes, key, action):
                arrived.setdefault(message, []).append(now + transfer(key, message))
        else:
            message = _received(key, action)
            assert message is not None, action
            times = arrived.get(message, [])
            if len(times) < _senders(lanes, message) or max(times) > now:
                return
        st.pos += 1
