"""Frozen encoders run ahead (``train.frozen_ahead``, split layouts).

A wholly frozen encoder takes no gradient: its plan is forward-only (every micro-batch's
forward in turn, each output sent when done), the language model sends it none, and its
forward keeps nothing for backward. Checked here: every rank's plan together (the
action-list checks), parity with the plain loop, the bytes the frozen module and a
frozen tower keep for backward, and that no gradient travels to a frozen encoder.
"""

from __future__ import annotations

import pytest

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.layout import check_layout
from mimotron.pipeline.actions import BACKWARD, RECV_BACKWARD, unpaired
from mimotron.pipeline.actions_check import check_action_lists, layout_topology
from mimotron.pipeline.interleaved_actions import build_rank_actions
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step
from tests.common import BASE, DIGITS, noncolocated
from tests.parity import SMALL_MB, run_against_plain_loop
from tests.saved_bytes import saved_bytes, saved_inside

FROZEN_BOTH = ["modules.vision.freeze=true", "modules.audio.freeze=true"]
VISION_2_LAYERS = ["modules.vision.num_layers=2"]


def _plans(overrides: list[str], num_microbatches: int = 4) -> tuple[object, dict]:
    layout = check_layout(load_config(DIGITS, BASE + overrides))
    topology = layout_topology(layout)
    plans = {node: build_rank_actions(layout, node[0], node[1], num_microbatches)
             for node in topology}
    return layout, plans


@pytest.mark.parametrize(("layout", "frozen"), [
    (noncolocated({}, {}, {"data": 2}), FROZEN_BOTH),
    (noncolocated({"pipeline": 2}, {}, {"pipeline": 2}), ["modules.vision.freeze=true"]),
    (noncolocated({"pipeline": 2}, {"data": 2}, {"tensor": 2}), FROZEN_BOTH),
], ids=["all-frozen", "vision-frozen-pp2-language-pp2", "all-frozen-vision-pp2"])
def test_frozen_encoders_plan_forwards_only_and_get_no_gradient(layout: list[str],
                                                                frozen: list[str]) -> None:
    ahead, plans = _plans(layout + frozen + VISION_2_LAYERS)
    check_action_lists(layout_topology(ahead), plans, 4)  # together: pairing, no deadlock
    for (module, _), plan in plans.items():
        kinds = {b.kind for a in plan for b in unpaired(a)}
        if module in ahead.ahead:
            assert BACKWARD not in kinds and RECV_BACKWARD not in kinds, (module, plan)
    assert ahead.ahead == {m.split(".")[1] for m in frozen}
    # With the option off, frozen encoders keep their 1F1B plans.
    off, off_plans = _plans(layout + frozen + VISION_2_LAYERS + ["train.frozen_ahead=false"])
    assert off.ahead == frozenset()
    assert any(BACKWARD in {a.kind for a in plan} for (m, _), plan in off_plans.items()
               if m == "vision")


def test_interleaving_keeps_the_frozen_encoders_in_1f1b() -> None:
    layout, _ = _plans(noncolocated({}, {}, {"pipeline": 2}) + FROZEN_BOTH + [
        "modules.language.parallel.virtual_pipeline=2", "modules.language.num_layers=4"])
    assert layout.ahead == frozenset()


PARITY = {
    "vision frozen PP 2 | audio | language PP 2": (
        noncolocated({"pipeline": 2}, {}, {"pipeline": 2}),
        ["modules.vision.freeze=true", *VISION_2_LAYERS, *SMALL_MB]),
    "vision frozen | audio frozen | language DP 2": (
        noncolocated({}, {}, {"data": 2}), [*FROZEN_BOTH, *SMALL_MB]),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_frozen_ahead_matches_plain_loop(name: str) -> None:
    layout, extra = PARITY[name]
    run_against_plain_loop(layout, extra)


def _kept(rank: int, world: int, overrides: list[str]) -> dict:
    """Bytes autograd saves on this rank over one training step, and on the vision rank
    those saved inside its tower."""
    del world
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())

    def step() -> None:
        train_step_mimo(default_forward_step, run.train_data_iterator, run.model,
                        run.optimizer, run.schedulers, run.global_state, run.communicator,
                        infra=run.infra)

    step()  # warm-up: optimizer state, first-call paths
    module = next(r.module for r in run.infra.layout.roles(rank))
    out = {"module": module, "kept": saved_bytes(step), "tower": None}
    if module == "vision":
        out["tower"] = saved_inside(run.model.modality_submodules["vision"].encoder, step)
    else:
        step()  # every rank runs the same steps
    return out


def test_a_frozen_encoder_keeps_nothing_for_backward() -> None:
    """On the frozen encoder's rank autograd saves no byte in a training step (a
    trainable encoder's rank saves its activations: the measure sees them)."""
    layout = noncolocated({}, {}, {})
    frozen = {r["module"]: r["kept"] for r in run_ranks(
        3, _kept, layout + ["modules.vision.freeze=true"], timeout_s=120)}
    trained = {r["module"]: r["kept"] for r in run_ranks(3, _kept, layout, timeout_s=120)}
    assert frozen["vision"] == 0
    assert trained["vision"] > 0 and frozen["audio"] > 0 and frozen["language"] > 0


def test_a_frozen_tower_keeps_nothing_its_projector_does() -> None:
    """``freeze = "encoder"``: nothing saved inside the tower (the trainable tower saves
    its activations: the measure sees them); the projector still saves its inputs."""
    layout = noncolocated({}, {}, {})
    tower = {r["module"]: r for r in run_ranks(
        3, _kept, layout + ["modules.vision.freeze='encoder'"], timeout_s=120)}
    whole = {r["module"]: r for r in run_ranks(3, _kept, layout, timeout_s=120)}
    assert tower["vision"]["tower"] == 0 < tower["vision"]["kept"]
    assert whole["vision"]["tower"] > 0
