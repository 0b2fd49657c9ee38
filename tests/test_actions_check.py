"""The all-ranks plan checker catches planted bugs, naming the rank, action and rule.

Correct plans pass it in tests/test_actions.py and tests/test_interleaved_actions.py; here each
test breaks one rule of a correct plan and asserts the checker reports exactly that.
"""

from __future__ import annotations

import re

import pytest

from mimotron.pipeline.actions import (
    Action,
    Position,
    build_1f1b_actions,
    build_forward_only_actions,
)
from mimotron.pipeline.actions_check import (
    ActionListError,
    Topology,
    check_action_lists,
    check_pairing,
    check_progress,
    ring_topology,
)
from mimotron.pipeline.interleaved_actions import build_interleaved_actions

Plans = dict[tuple[str, int], list[Action]]


def _chain(stages: int, num_mb: int, forward_only: bool = False) -> tuple[Topology, Plans]:
    """A module of ``stages`` 1F1B stages alone, and every stage's plan."""
    build = build_forward_only_actions if forward_only else build_1f1b_actions
    plans = {("x", s): build(num_mb, Position("x", s, s, stages, s > 0, s < stages - 1))
             for s in range(stages)}
    return ring_topology("x", stages), plans


def _interleaved(p: int, v: int, n: int) -> tuple[Topology, Plans]:
    plans = {("m", s): build_interleaved_actions(n, p, v, s, has_prev=False, has_next=False)
             for s in range(p)}
    return ring_topology("m", p, v), plans


def _swap(plan: list[Action], a: Action, b: Action) -> list[Action]:
    i, j = plan.index(a), plan.index(b)
    out = list(plan)
    out[i], out[j] = out[j], out[i]
    return out


def _raises(topology: Topology, plans: Plans, num_mb: int, node: tuple[str, int],
            index: int, rule: str, forward_only: bool = False) -> ActionListError:
    with pytest.raises(ActionListError, match=re.escape(rule)) as info:
        check_action_lists(topology, plans, num_mb, forward_only)
    assert (info.value.node, info.value.index) == (node, index), str(info.value)
    assert str(info.value).startswith(f"rank {node} ")
    return info.value


@pytest.mark.parametrize("p,v,n", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_two_chunk0_forwards_moved_with_their_sends_left_in_place(p, v, n):
    topology, plans = _interleaved(p, v, n)
    first, second = Action("F", 0, chunk=0), Action("F", 1, chunk=0)
    plans[("m", 0)] = bugged = _swap(plans[("m", 0)], first, second)
    # Channels alone (the old simulator's view) cannot see it: every message still
    # pairs up and nothing deadlocks.
    check_pairing(topology, plans)
    check_progress(topology, plans)
    send = bugged.index(Action("send_forward", 0, chunk=0))
    err = _raises(topology, plans, n, ("m", 0), send, "sends ('F', 0, 0) before computing it")
    assert err.action == Action("send_forward", 0, chunk=0)


def test_a_send_before_its_forward():
    topology, plans = _chain(3, 4)
    plans[("x", 0)] = bugged = _swap(plans[("x", 0)], Action("F", 0), Action("send_forward", 0))
    assert bugged[0] == Action("send_forward", 0)
    _raises(topology, plans, 4, ("x", 0), 0, "sends ('F', 0, 0) before computing it")


def test_a_paired_send_before_its_forward():
    topology, plans = _chain(2, 3)
    pair = Action("send_forward_recv_backward", 1, 0)
    plans[("x", 0)] = bugged = _swap(plans[("x", 0)], Action("F", 1), pair)
    _raises(topology, plans, 3, ("x", 0), bugged.index(pair),
            "sends ('F', 0, 1) before computing it")


def test_a_backward_before_its_gradient_receive():
    topology, plans = _chain(3, 4)
    plans[("x", 1)] = bugged = _swap(plans[("x", 1)], Action("recv_backward", 3),
                                     Action("B", 3))
    _raises(topology, plans, 4, ("x", 1), bugged.index(Action("B", 3)),
            "backward before the receive of its output gradient")


def test_a_steady_state_backward_before_its_paired_gradient_receive():
    topology, plans = _chain(2, 3)
    pair = Action("send_forward_recv_backward", 1, 0)
    plans[("x", 0)] = bugged = _swap(plans[("x", 0)], pair, Action("B", 0))
    _raises(topology, plans, 3, ("x", 0), bugged.index(Action("B", 0)),
            "backward before the receive of its output gradient")


def test_a_forward_before_its_input_and_a_backward_before_its_forward():
    topology, plans = _chain(3, 2)
    good = plans[("x", 2)]
    plans[("x", 2)] = _swap(good, Action("recv_forward", 0), Action("F", 0))
    _raises(topology, plans, 2, ("x", 2), 0, "forward before the receive of its input")
    plans[("x", 2)] = _swap(good, Action("F", 0), Action("B", 0))  # the loss stage
    _raises(topology, plans, 2, ("x", 2), 1, "backward before its own forward")


def test_incomplete_or_repeated_computes():
    topology, plans = _chain(2, 3)
    good = plans[("x", 1)]
    plans[("x", 1)] = good[:-2]  # without its last backward and that backward's send
    assert good[-2:] == [Action("B", 2), Action("send_backward", 2)]
    _raises(topology, plans, 3, ("x", 1), len(good) - 2, "never computes [('B', 0, 2)]")
    plans[("x", 1)] = [*good, Action("F", 2)]
    _raises(topology, plans, 3, ("x", 1), len(good), "computed twice")
    plans[("x", 1)] = good
    plans[("x", 0)] = [a for a in plans[("x", 0)] if a != Action("send_forward", 0)]
    _raises(topology, plans, 3, ("x", 0), len(plans[("x", 0)]), "never sends ('F', 0, 0)")


def test_a_transfer_without_a_neighbour_or_in_forward_only():
    topology, plans = _chain(2, 2)
    plans[("x", 1)] = [*plans[("x", 1)], Action("send_forward", 1)]
    _raises(topology, plans, 2, ("x", 1), len(plans[("x", 1)]) - 1, "no neighbour")
    topology, plans = _chain(2, 2, forward_only=True)
    plans[("x", 1)] = [*plans[("x", 1)], Action("B", 0)]
    _raises(topology, plans, 2, ("x", 1), len(plans[("x", 1)]) - 1,
            "backward in a forward-only plan", forward_only=True)


def test_receives_out_of_the_senders_order():
    topology, plans = _chain(2, 2, forward_only=True)
    # Locally sound (each forward after its receive), but the channel delivers 0 first.
    plans[("x", 1)] = [Action("recv_forward", 1), Action("F", 1),
                       Action("recv_forward", 0), Action("F", 0)]
    _raises(topology, plans, 2, ("x", 1), 0, "receives ('F', 0, 1) from ('x', 0), whose "
            "message #0 is ('F', 0, 0)", forward_only=True)


def test_a_deadlock():
    topology, plans = _chain(2, 1)
    # Stage 0 waits for the gradient before sending the activation it depends on.
    plans[("x", 0)] = [Action("F", 0), Action("recv_backward", 0), Action("send_forward", 0),
                       Action("B", 0)]
    _raises(topology, plans, 1, ("x", 0), 1, "deadlock: every rank waits")
