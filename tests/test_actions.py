"""Schedule plans for three DAG shapes, checked action by action (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from mimotron.pipeline.actions import (
    Action,
    Position,
    build_1f1b_actions,
    build_forward_only_actions,
    pipeline_positions,
)
from mimotron.pipeline.actions_check import check_action_lists, layout_topology, ring_topology

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"


def _layout(overrides: list[str]):
    return check_layout(load_config(DIGITS, ["train.micro_batch_size=8", *overrides]))


def _fmt(plan: list[Action]) -> str:
    return " ".join(repr(a) for a in plan)


def _block(module: str, offset: int, **kw: int) -> list[str]:
    return [f"modules.{module}.parallel.{k}={v}" for k, v in {"data": 1, **kw,
                                                               "rank_offset": offset}.items()]


def test_two_encoders_one_stage_each_feeding_language():
    layout = _layout(_block("vision", 0) + _block("audio", 1) + _block("language", 2))
    pos = pipeline_positions(layout)
    assert [(k, p.index, p.total, p.has_prev, p.has_next) for k, p in pos.items()] == [
        (("vision", 0), 0, 2, False, True), (("audio", 0), 0, 2, False, True),
        (("language", 0), 1, 2, True, False)]
    enc = build_1f1b_actions(3, pos[("vision", 0)])
    assert _fmt(enc) == ("F(0) send_forward(0) "  # warm-up: 1 forward
                         "F(1) send_forward_recv_backward(1/0) B(0) "
                         "F(2) send_forward_recv_backward(2/1) B(1) "
                         "recv_backward(2) B(2)")  # cool-down
    lm = build_1f1b_actions(3, pos[("language", 0)])
    assert _fmt(lm) == ("recv_forward(0) F(0) B(0) send_backward_recv_forward(0/1) "
                        "F(1) B(1) send_backward_recv_forward(1/2) F(2) B(2) send_backward(2)")


def test_pipelined_encoder_and_language_with_shorter_chain_aligned():
    layout = _layout(_block("vision", 0, pipeline=2) + _block("audio", 2)
                     + _block("language", 3, pipeline=2) + ["modules.vision.num_layers=2"])
    pos = pipeline_positions(layout)
    index = {k: (p.index, p.total) for k, p in pos.items()}
    assert index == {("vision", 0): (0, 4), ("vision", 1): (1, 4), ("audio", 0): (1, 4),
                     ("language", 0): (2, 4), ("language", 1): (3, 4)}
    # Forwards before the first backward = warm-up (total - index - 1) + the first steady one.
    forwards_first = {k: sum(1 for a in build_1f1b_actions(8, p) if a.kind == "F"
                             and _before_first_backward(build_1f1b_actions(8, p), a))
                      for k, p in pos.items()}
    assert forwards_first == {("vision", 0): 4, ("vision", 1): 3, ("audio", 0): 3,
                       ("language", 0): 2, ("language", 1): 1}
    v0 = build_1f1b_actions(8, pos[("vision", 0)])
    assert _fmt(v0[:7]) == "F(0) send_forward(0) F(1) send_forward(1) F(2) send_forward(2) F(3)"
    assert _fmt(v0[7:9]) == "send_forward_recv_backward(3/0) B(0)"
    lm1 = build_1f1b_actions(8, pos[("language", 1)])
    assert _fmt(lm1[:5]) == "recv_forward(0) F(0) B(0) send_backward_recv_forward(0/1) F(1)"
    assert lm1[-1] == Action("send_backward", 7)


def _before_first_backward(plan: list[Action], action: Action) -> bool:
    first_b = next(i for i, a in enumerate(plan) if a.kind == "B")
    return plan.index(action) < first_b + 1


def test_colocated_is_one_position_without_transfers():
    layout = _layout(_block("vision", 0) + _block("audio", 0) + _block("language", 0))
    pos = pipeline_positions(layout)
    assert {p.total for p in pos.values()} == {1}
    plan = build_1f1b_actions(3, pos[("language", 0)])
    assert _fmt(plan) == "F(0) B(0) F(1) B(1) F(2) B(2)"


def test_every_microbatch_forward_and_backward_once_and_in_order():
    for index in range(4):
        for m in (1, 2, 3, 8):
            p = Position("x", 0, index, 4, index > 0, index < 3)
            plan = build_1f1b_actions(m, p)
            fwd = [a.microbatch for a in plan if a.kind == "F"]
            bwd = [a.microbatch for a in plan if a.kind == "B"]
            assert fwd == list(range(m)) and bwd == list(range(m))
            # A backward never precedes its forward.
            for k in range(m):
                assert plan.index(Action("F", k)) < plan.index(Action("B", k))


def test_no_pipelining_and_forward_only():
    p = Position("vision", 0, 0, 2, False, True)
    assert _fmt(build_1f1b_actions(2, p, pipelined=False)) == (
        "F(0) send_forward_recv_backward(0/0) B(0) F(1) send_forward_recv_backward(1/1) B(1)")
    q = Position("language", 0, 1, 2, True, False)
    assert _fmt(build_forward_only_actions(2, q)) == "recv_forward(0) F(0) recv_forward(1) F(1)"
    with pytest.raises(ValueError, match="num_microbatches=0"):
        build_1f1b_actions(0, p)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("num_mb", [1, 2, 3, 8])
def test_chain_plans_pass_the_all_ranks_checks(stages, num_mb):
    topology = ring_topology("x", stages)
    pos = {("x", s): Position("x", s, s, stages, s > 0, s < stages - 1) for s in range(stages)}
    for pipelined in (True, False):
        plans = {n: build_1f1b_actions(num_mb, p, pipelined) for n, p in pos.items()}
        check_action_lists(topology, plans, num_mb)
    check_action_lists(topology, {n: build_forward_only_actions(num_mb, p) for n, p in pos.items()},
                num_mb, forward_only=True)


@pytest.mark.parametrize("overrides", [
    _block("vision", 0) + _block("audio", 1) + _block("language", 2),
    _block("vision", 0, pipeline=2) + _block("audio", 2) + _block("language", 3, pipeline=2)
    + ["modules.vision.num_layers=2"],
    _block("vision", 0) + _block("audio", 1) + _block("language", 2, pipeline=3)
    + ["modules.language.num_layers=3"],
    _block("vision", 0) + _block("audio", 0) + _block("language", 0),  # colocated
])
def test_encoder_language_plans_pass_the_all_ranks_checks(overrides):
    layout = _layout(overrides)
    topology, pos = layout_topology(layout), pipeline_positions(layout)
    for num_mb in (1, 3, 8):
        for pipelined in (True, False):
            check_action_lists(topology, {n: build_1f1b_actions(num_mb, p, pipelined)
                                          for n, p in pos.items()}, num_mb)
        plans = {n: build_forward_only_actions(num_mb, p) for n, p in pos.items()}
        check_action_lists(topology, plans, num_mb, forward_only=True)
