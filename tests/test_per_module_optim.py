"""Per-module ``clip_grad`` and fp16 loss-scaler settings (``[modules.<m>.optimizer]``).

* Clipping: each module is scaled by ``min(1, clip_m / (global_norm + 1e-6))`` with the
  global norm over *all* modules; ``clip_m = 0`` leaves it alone. Checked against a
  plain-PyTorch hand computation.
* fp16: each module's scaler follows its own initial scale, window, hysteresis and
  floor from the world found-inf; backward uses the minimum scale and every module is
  unscaled by it (the grad norm matches unscaled gradients).
* Through the engine: the overrides reach the built optimizer, and a run whose vision
  module asks for a smaller initial scale backs off to exactly the run where every
  module uses that scale.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from mimotron.config import load_config
from mimotron.optim import DynamicLossScaler, MimoOptimizer, ModuleOptimizerInfo, OptimizerConfig
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, ONE_RANK, train_step

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
SIZES = {"a": (4, 3), "b": (6, 4), "c": (3, 5)}


def _modules() -> dict[str, nn.Linear]:
    torch.manual_seed(0)
    return {name: nn.Linear(i, o) for name, (i, o) in SIZES.items()}


def _grads(step: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7 + step)
    return {name: [torch.randn(o, i, generator=gen) * 3, torch.randn(o, generator=gen) * 3]
            for name, (i, o) in SIZES.items()}


def _set(mods: dict[str, nn.Linear], grads: dict[str, list[torch.Tensor]], scale: float) -> None:
    for name, m in mods.items():
        for p, g in zip(m.parameters(), grads[name], strict=True):
            p.grad = g.clone() * scale


def _mimo(mods: dict[str, nn.Linear], clips: dict[str, float | None],
          scalers: dict[str, DynamicLossScaler] | None = None) -> MimoOptimizer:
    infos = {}
    for name, m in mods.items():
        info = ModuleOptimizerInfo(optimizer=torch.optim.SGD(m.parameters(), lr=1.0),
                                   is_active=True, params=list(m.named_parameters()),
                                   clip_grad=clips[name])
        if scalers is not None:
            info.loss_scaler = scalers[name]
        infos[name] = info
    return MimoOptimizer(infos, OptimizerConfig(clip_grad=0.7))


def test_each_module_clips_with_its_own_threshold_against_the_global_norm() -> None:
    mods = _modules()
    ref = copy.deepcopy(mods)
    grads = _grads(0)
    _set(mods, grads, 1.0)
    # a: its own 0.5; b: 0 = unclipped; c: None = the global 0.7.
    opt = _mimo(mods, {"a": 0.5, "b": 0.0, "c": None})
    success, norm, _ = opt.step()
    want_norm = torch.sqrt(sum((g.double() ** 2).sum() for gs in grads.values() for g in gs))
    assert success and norm == pytest.approx(want_norm.item(), rel=1e-12)
    assert norm > 5  # every threshold bites (the test can fail)
    factors = {"a": 0.5 / (norm + 1e-6), "b": 1.0, "c": 0.7 / (norm + 1e-6)}
    for name, m in mods.items():
        for p, q, g in zip(m.parameters(), ref[name].parameters(), grads[name], strict=True):
            want = q.detach() - factors[name] * g  # SGD with lr 1 on the clipped grad
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7)
    # An explicit threshold overrides every module's own.
    _set(mods, grads, 1.0)
    opt.clip_grad_norm(clip_grad=0.0)
    assert all(torch.equal(p.grad, g) for n, m in mods.items()
               for p, g in zip(m.parameters(), grads[n], strict=True))


def _scales(opt: MimoOptimizer) -> dict[str, float]:
    return {n: float(i.loss_scaler.scale) for n, i in opt.module_infos.items()}


def test_fp16_scalers_follow_their_own_settings_from_the_world_flag() -> None:
    mods = _modules()
    scalers = {
        "a": DynamicLossScaler(1024.0, 1.0, growth_interval=2, hysteresis=1),
        "b": DynamicLossScaler(256.0, 128.0, growth_interval=1000, hysteresis=2),
        "c": DynamicLossScaler(4096.0, 1.0, growth_interval=1000, hysteresis=1),
    }
    opt = _mimo(mods, {"a": 0.0, "b": 0.0, "c": 0.0}, scalers)
    norms = []
    for step in range(2):  # clean steps, grads scaled by the common (minimum) scale
        assert float(opt.get_loss_scale()) == 256.0
        _set(mods, _grads(step), 256.0)
        success, norm, _ = opt.step()
        assert success
        norms.append(norm)
    want = [torch.sqrt(sum((g.double() ** 2).sum() for gs in _grads(s).values() for g in gs))
            for s in range(2)]
    assert norms == pytest.approx([w.item() for w in want], rel=1e-12)  # unscaled by 256
    assert _scales(opt) == {"a": 2048.0, "b": 256.0, "c": 4096.0}  # a grew after 2
    want_after_inf = [
        {"a": 1024.0, "b": 256.0, "c": 2048.0},  # b's hysteresis absorbs the first
        {"a": 512.0, "b": 128.0, "c": 1024.0},
        {"a": 256.0, "b": 128.0, "c": 512.0},  # b at its floor min_loss_scale=128
    ]
    for want_scales in want_after_inf:
        _set(mods, _grads(5), float(opt.get_loss_scale()))
        mods["c"].bias.grad[0] = float("inf")  # an overflow in one module skips all
        assert opt.step() == (False, None, None)
        assert _scales(opt) == want_scales
    assert float(opt.get_loss_scale()) == 128.0
    _set(mods, _grads(0), 128.0)
    success, norm, _ = opt.step()
    assert success and norm == pytest.approx(want[0].item(), rel=1e-12)


def test_frozen_modules_do_not_lower_the_loss_scale() -> None:
    infos = {"a": ModuleOptimizerInfo(loss_scaler=DynamicLossScaler(8.0, 1.0, 10, 1),
                                      frozen=True),
             "b": ModuleOptimizerInfo(loss_scaler=DynamicLossScaler(64.0, 1.0, 10, 1))}
    assert float(MimoOptimizer(infos, OptimizerConfig()).get_loss_scale()) == 64.0


def _engine_steps(overrides: list[str], iters: int = 2) -> tuple[list[tuple], dict]:
    cfg = load_config(DIGITS, BASE + ONE_RANK + overrides)
    run = setup_mimo(cfg, init_runtime())
    steps = []
    for _ in range(iters):
        loss, skipped, norm, _ = train_step(run)
        steps.append((loss["loss"], skipped, norm, float(run.optimizer.get_loss_scale())))
    infos = run.optimizer.module_infos
    return steps, {n: (i.clip_grad, i.loss_scaler.state_dict()) for n, i in infos.items()}


def test_engine_per_module_loss_scale_equals_a_global_one() -> None:
    fp16 = ["train.precision=fp16", "optimizer.loss_scale_window=1000"]
    mixed, infos = _engine_steps([*fp16, "optimizer.initial_loss_scale=1024",
                                  "modules.vision.optimizer.initial_loss_scale=256",
                                  "modules.audio.optimizer.clip_grad=0.25"])
    assert {n: (c, s["scale"]) for n, (c, s) in infos.items()} == {
        "audio": (0.25, 1024.0), "language": (0.5, 1024.0), "vision": (0.5, 256.0)}
    same, _ = _engine_steps([*fp16, "optimizer.initial_loss_scale=256",
                             "modules.audio.optimizer.clip_grad=0.25"])
    # Power-of-two scales change no fp16 rounding: the backward scale is 256 in both.
    assert mixed == same
    assert all(s[3] == 256.0 and not s[1] for s in mixed)
