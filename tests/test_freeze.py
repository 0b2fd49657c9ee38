"""Freezing a module: no gradients, no sync, no optimizer state; unfreezing on resume.

``modules.<m>.freeze = true`` sets ``requires_grad=False`` on the module (in model
setup, ``build_rank_model``), so autograd neither computes nor keeps anything for it (its
encoder output carries no graph), the DP sync skips it and no optimizer state exists.
A module that was frozen when a state dict was written and trains after the resume
starts from fresh optimizer state and a fresh schedule; every other module resumes
exactly.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from mimotron.config import MimoConfig, ModuleConfig, load_config
from mimotron.forked_ranks import run_ranks
from mimotron.optim import (
    get_mimo_optimizer,
    load_schedulers_state_dict,
    schedulers_state_dict,
)
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.model_setup import freeze_modules
from mimotron.training.step import default_forward_step
from tests.common import BASE as COMMON_BASE
from tests.common import MODULES, ONE_RANK

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
BASE = COMMON_BASE
LAYOUTS = {
    "colocated-dp2": (2, [f"modules.{m}.parallel.{k}={v}" for m in MODULES
                          for k, v in (("data", 2), ("rank_offset", 0))]),
    "noncolocated": (3, [f"modules.{m}.parallel.{k}={v}" for i, m in enumerate(MODULES)
                         for k, v in (("data", 1), ("rank_offset", i))]),
}
FROZEN = ["modules.vision.freeze=true"]
# A frozen module runs its forward without autograd, which may pick other CPU kernels
# (another summation order) than the same module training: the same math, equal to fp32
# rounding, bit-identical only on some processors. Measured: 2e-8 apart on one processor,
# while moving the frozen module's weights by a thirtieth of one Adam step (NUDGE) moves
# the loss by 1e-5; this tolerance sits between the two.
LOSS_RTOL = 1e-6
NUDGE = 1e-4  # optimizer.lr=3e-3: about a thirtieth of one Adam step per weight.


def _same_loss(x: float, y: float) -> bool:
    """Equal to fp32 rounding (runs that freeze different modules take other kernels)."""
    return math.isclose(x, y, rel_tol=LOSS_RTOL, abs_tol=0.0)


def _step(run) -> float:  # noqa: ANN001 - MimoRun
    loss, skipped, _, _ = train_step_mimo(
        default_forward_step, run.train_data_iterator, run.model, run.optimizer,
        run.schedulers, run.global_state, run.communicator, infra=run.infra)
    assert not skipped
    return loss["loss"]


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _frozen_run(rank: int, world: int, overrides: list[str]) -> dict:
    cfg = load_config(DIGITS, BASE + overrides + FROZEN)
    run = setup_mimo(cfg, init_runtime())
    subs = run.model.modality_submodules
    before = {n: _weights(m) for n, m in subs.items()}
    losses = [_step(run) for _ in range(10)]
    out: dict = {"losses": losses, "held": sorted(subs)}
    for name, module in subs.items():
        after = _weights(module)
        out[f"{name}_identical"] = all(torch.equal(before[name][k], after[k]) for k in after)
        out[f"{name}_grads"] = [p.grad is not None for p in module.parameters()]
        # The encoder output of a frozen module carries no graph (nothing upstream trains).
        batch = next(run.train_data_iterator)[0][name]
        out[f"{name}_output_requires_grad"] = run.model.encode(name, batch).requires_grad
    vision = run.optimizer.module_infos["vision"]
    out["vision_info"] = (vision.is_active, vision.frozen, vision.optimizer is None)
    out["schedulers"] = sorted(run.schedulers)
    out["lr_modules"] = sorted({g["module"] for g in run.optimizer.param_groups})
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_frozen_vision_is_bit_identical_and_holds_no_state(layout: str) -> None:
    world, par = LAYOUTS[layout]
    results = run_ranks(world, _frozen_run, par, timeout_s=240)
    assert any("vision" in r["held"] for r in results)
    for r in results:
        assert r["losses"][-1] < r["losses"][0]  # the other modules still learn
        assert r["vision_info"] == (False, True, True)  # no optimizer, no state
        assert "vision" not in r["schedulers"] and "vision" not in r["lr_modules"]
        if "vision" in r["held"]:
            assert r["vision_identical"]
            assert not any(r["vision_grads"])  # no gradient computed, nothing to sync
            assert r["vision_output_requires_grad"] is False
        if "audio" in r["held"]:
            assert not r["audio_identical"] and all(r["audio_grads"])
            assert r["audio_output_requires_grad"] is True


def _adam_steps(run, module: str) -> set[float]:  # noqa: ANN001 - MimoRun
    opt = run.optimizer.module_infos[module].optimizer
    return {float(st["step"]) for st in opt.state.values()}


def _resume(rank: int, world: int, ckpt: str) -> dict:
    # A: vision frozen; 3 steps; save (in memory and with DCP); one more step.
    a = setup_mimo(load_config(DIGITS, BASE + ONE_RANK + FROZEN), init_runtime())
    for _ in range(3):
        _step(a)
    saved = copy.deepcopy({"model": a.model.state_dict(), "optimizer": a.optimizer.state_dict(),
                           "schedulers": schedulers_state_dict(a.schedulers)})
    dcp.save(a.optimizer.sharded_state_dict(), checkpoint_id=ckpt)
    out: dict = {"a_next": _step(a), "saved_language_steps": _adam_steps(a, "language")}

    def resumed(overrides: list[str]):  # noqa: ANN202
        run = setup_mimo(load_config(DIGITS, BASE + ONE_RANK + overrides), init_runtime())
        run.model.load_state_dict(saved["model"])
        for _ in range(3):  # the data position of the checkpoint
            next(run.train_data_iterator)
        return run

    # B: vision unfrozen: fresh optimizer state and schedule for vision only.
    b = resumed([])
    b.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    out["fresh_schedules"] = load_schedulers_state_dict(b.schedulers, saved["schedulers"])
    out["b_vision_state_after_load"] = len(b.optimizer.module_infos["vision"].optimizer.state)
    vision_before = _weights(b.model.modality_submodules["vision"])
    out["b_next"] = _step(b)
    _step(b)
    out["b_steps"] = {m: _adam_steps(b, m) for m in MODULES}
    out["b_sched"] = {m: s.num_steps for m, s in b.schedulers.items()}
    out["b_vision_moved"] = any(not torch.equal(vision_before[k], v) for k, v in
                                _weights(b.model.modality_submodules["vision"]).items())
    # C: the same through DCP; the checkpoint has no vision optimizer state (partial load).
    c = resumed([])
    loading = c.optimizer.sharded_state_dict(is_loading=True)
    dcp.load(loading, checkpoint_id=ckpt, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    c.optimizer.load_state_dict(loading)
    out["c_vision_state"] = len(c.optimizer.module_infos["vision"].optimizer.state)
    out["c_language_steps"] = _adam_steps(c, "language")
    load_schedulers_state_dict(c.schedulers, saved["schedulers"])
    out["c_next"] = _step(c)
    # D: audio frozen now (it trained when saved): its saved state is ignored.
    d = resumed(FROZEN + ["modules.audio.freeze=true"])
    d.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    load_schedulers_state_dict(d.schedulers, saved["schedulers"])
    out["d_next"] = _step(d)
    # E: as D, with frozen audio's weights moved a little: the tolerance must see that.
    e = resumed(FROZEN + ["modules.audio.freeze=true"])
    e.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
    load_schedulers_state_dict(e.schedulers, saved["schedulers"])
    with torch.no_grad():
        for param in e.model.modality_submodules["audio"].parameters():
            param.add_(NUDGE)
    out["e_next"] = _step(e)
    return out


def test_unfreezing_on_resume_starts_that_module_fresh(tmp_path: Path) -> None:
    r = run_ranks(1, _resume, str(tmp_path / "ckpt"), timeout_s=240)[0]
    assert r["saved_language_steps"] == {4.0}
    # The first resumed step sees the same weights and data: the same loss. B and C run
    # the same modules the same way: exactly; A froze vision: to fp32 rounding.
    assert r["b_next"] == r["c_next"]
    assert _same_loss(r["b_next"], r["a_next"]), (r["b_next"], r["a_next"])
    assert r["b_vision_state_after_load"] == 0 and r["c_vision_state"] == 0
    assert r["fresh_schedules"] == ["vision"]
    assert r["b_steps"] == {"vision": {2.0}, "audio": {5.0}, "language": {5.0}}
    assert r["b_sched"] == {"audio": 5, "language": 5, "vision": 2}
    assert r["b_vision_moved"]
    assert r["c_language_steps"] == {3.0}
    # Frozen audio changes nothing in the forward pass of the first resumed step...
    assert _same_loss(r["d_next"], r["a_next"]), (r["d_next"], r["a_next"])
    # ...while frozen weights that moved would: the tolerance is tight enough to see it.
    assert not _same_loss(r["e_next"], r["a_next"]), (r["e_next"], r["a_next"])


def test_freeze_sets_requires_grad_and_rejects_freezing_everything() -> None:
    model = nn.Module()
    model.modality_submodules = nn.ModuleDict({"vision": nn.Linear(2, 2)})
    model.language_model = nn.Linear(2, 2)
    cfg = MimoConfig(modules={"vision": ModuleConfig(kind="vit", freeze=True),
                              "language": ModuleConfig(kind="language")})
    assert freeze_modules(model, cfg) == ["vision"]
    assert not any(p.requires_grad for p in model.modality_submodules.parameters())
    assert all(p.requires_grad for p in model.language_model.parameters())
    cfg.modules["language"].freeze = True
    with pytest.raises(ValueError, match="every module"):
        get_mimo_optimizer(model, cfg)
