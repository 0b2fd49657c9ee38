"""Run the ranks' own action lists on a clock: the pipeline's makespan, not a formula.

The step-time model (:mod:`mimotron.planner.cost`) does not estimate the pipeline
bubble with ``(p - 1) / m``: it replays the plans the executor runs
(:func:`~mimotron.pipeline.interleaved_actions.build_rank_actions`, 1F1B or interleaved, over
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
Every event ends a compute's phase (its work or its fixed part) or reaches a message's
arrival: the phase that defines the next event ends there whatever float rounding left
of it (at a clock of 1e5 s a residue of 1e-11 s no longer moves the clock), so a replay
always terminates; :data:`EVENTS_PER_ACTION` bounds it, as a guard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mimotron.names import LANGUAGE
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

EVENTS_PER_ACTION = 4
"""Events a replay may take per action of its plans (a compute takes 2, a receive 1)."""

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


class SimulationError(ValueError):
    """A replay that cannot give a step time: a duration that is not a finite number of
    seconds >= 0 (a device table or calibration pricing something at ``inf``), or more
    events than :data:`EVENTS_PER_ACTION` allows (an internal fault)."""


@dataclass
class SimResult:
    """What the replay found.

    Attributes:
        makespan: when the last lane finished its last action (seconds).
        finish: lane -> when it finished.
        busy: lane -> seconds it spent in computes (stretched by shared cores).
    """

    makespan: float
    finish: dict[StageKey, float] = field(default_factory=dict)
    busy: dict[StageKey, float] = field(default_factory=dict)


def destinations(lanes: dict[StageKey, Lane], key: StageKey, action: Action
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


def _senders(lanes: dict[StageKey, Lane], message: MessageKey) -> int:
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


def simulate(lanes: dict[StageKey, Lane], transfer: Callable[[StageKey, MessageKey], float],
             host_cores: int = 0, max_events: int | None = None) -> SimResult:
    """Replay every lane's plan; see the module docstring.

    Args:
        lanes: the lanes of the layout.
        transfer: seconds a message takes from a sending lane to its receiver.
        host_cores: cores the ranks share (0 = every rank has its own device).
        max_events: events at most (default: :data:`EVENTS_PER_ACTION` per action).

    Returns:
        The makespan and each lane's finish and busy time.

    Raises:
        SimulationError: a compute or transfer time is not finite and >= 0, or the
            replay took more than ``max_events`` events.
        AssertionError: the plans deadlock (an internal invariant: the plan builders'
            lists never do).
    """
    _check_durations(lanes)
    plans = {k: [u for a in lane.plan for u in unpaired(a)] for k, lane in lanes.items()}
    if max_events is None:
        max_events = EVENTS_PER_ACTION * sum(len(p) for p in plans.values()) + 1
    states = {k: _State() for k in lanes}
    arrived: dict[MessageKey, list[float]] = {}
    result = SimResult(0.0, {}, dict.fromkeys(lanes, 0.0))
    now, events = 0.0, 0
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
        events += 1
        if events > max_events:
            raise SimulationError(
                f"the step-time simulation did not finish in {max_events} events (clock at "
                f"{now:.6g} s; lanes still running: {running or 'none'})")
        busy = sum(lanes[k].num_ranks for k in running if states[k].work > 0)
        rate = min(1.0, host_cores / busy) if host_cores > 0 and busy else 1.0
        ends = {k: now + (st.work / rate if st.work > 0 else st.fixed)
                for k, st in ((k, states[k]) for k in running)}
        following = min([*ends.values(), *waits])
        step = following - now
        for k in running:
            st = states[k]
            if ends[k] <= following:
                _end_phase(st)  # this event is its phase's end: exactly, whatever is left
            else:
                _progress(st, step, rate)
            if st.work == 0.0 and st.fixed == 0.0:
                st.computing, st.pos = False, st.pos + 1
                result.busy[k] += following - st.started
        now = following  # not now + step: a float sum may stop short of an arrival
    for key, st in states.items():
        assert st.pos == len(plans[key]), f"plans deadlock at {key}: {plans[key][st.pos]}"
    result.makespan = now
    return result


def _valid_seconds(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def _check_durations(lanes: dict[StageKey, Lane]) -> None:
    """Raise :class:`SimulationError` naming the first compute not finite and >= 0."""
    for (module, stage), lane in lanes.items():
        for (kind, chunk), (work, fixed) in lane.compute.items():
            if not (_valid_seconds(work) and _valid_seconds(fixed)):
                raise SimulationError(
                    f"{module} stage {stage}: {kind} of chunk {chunk} is priced at "
                    f"{work!r} + {fixed!r} s; expected finite seconds >= 0 (check the "
                    "device's constants or the calibration)")


def _end_phase(st: _State) -> None:
    """End the running compute's current phase: its work, else its fixed part."""
    if st.work > 0:
        st.work = 0.0
    else:
        st.fixed = 0.0


def _progress(st: _State, step: float, rate: float) -> None:
    """Advance a running compute by ``step`` seconds (work first, then fixed)."""
    if st.work > 0:
        used = min(st.work, step * rate)
        st.work -= used
        step -= used / rate
        if st.work <= 1e-12:  # float residue: the fixed part follows at once
            st.work = 0.0
    st.fixed = max(0.0, st.fixed - step)


def _pending_arrival(lanes: dict[StageKey, Lane], action: Action, key: StageKey,
                     arrived: dict[MessageKey, list[float]]) -> list[float]:
    """The arrival time a blocked receive waits for, once every sender has sent."""
    message = _received(key, action)
    if message is None or len(arrived.get(message, [])) < _senders(lanes, message):
        return []
    return [max(arrived[message])]


def _received(key: StageKey, action: Action) -> MessageKey | None:
    if action.kind == RECV_FORWARD:
        return ("F", key[0], key[1], action.chunk, action.microbatch)
    if action.kind == RECV_BACKWARD:
        return ("B", key[0], key[1], action.chunk, action.microbatch)
    return None


def _advance(lanes: dict[StageKey, Lane], key: StageKey, plan: list[Action], st: _State,
             arrived: dict[MessageKey, list[float]],
             transfer: Callable[[StageKey, MessageKey], float], now: float) -> None:
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
                seconds = transfer(key, message)
                if not _valid_seconds(seconds):
                    raise SimulationError(
                        f"{key[0]} stage {key[1]}: a message to {message[1]} stage "
                        f"{message[2]} is priced at {seconds!r} s; expected finite "
                        "seconds >= 0 (check the device's constants or the calibration)")
                arrived.setdefault(message, []).append(now + seconds)
        else:
            message = _received(key, action)
            assert message is not None, action
            times = arrived.get(message, [])
            if len(times) < _senders(lanes, message) or max(times) > now:
                return
        st.pos += 1
