"""OptimizerParamScheduler: Megatron warm-up/decay semantics, wd schedules, per-module builds.

End to end: the ``lr`` object of ``metrics.jsonl`` follows each module's own schedule
when ``[modules.<m>.optimizer]`` overrides lr, warm-up, decay style and min lr.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from mimotron.config import MimoConfig, ModuleConfig, SchedulerConfig
from mimotron.forked_ranks import run_ranks
from mimotron.optim import (
    OptimizerParamScheduler,
    build_schedulers,
    get_mimo_optimizer,
    load_schedulers_state_dict,
    schedulers_state_dict,
)
from mimotron.training.model_setup import freeze_modules
from tests.parity import metrics_lines, train


def _opt(wd: float = 0.1) -> torch.optim.Optimizer:
    decay, no_decay = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    return torch.optim.AdamW(
        [{"params": [decay], "weight_decay": wd}, {"params": [no_decay], "weight_decay": 0.0}],
        lr=1.0,
    )


def _sched(**kw: object) -> OptimizerParamScheduler:
    args = dict(max_lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110, decay_style="cosine")
    args.update(kw)
    return OptimizerParamScheduler(_opt(), **args)


def test_warmup_is_linear_from_zero_and_initial_lr_is_step_zero() -> None:
    s = _sched()
    assert s.optimizer.param_groups[0]["lr"] == 0.0  # before any step: the lr of step 0
    s.step()
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    for _ in range(9):
        s.step()
    assert s.num_steps == 10
    assert all(g["lr"] == pytest.approx(1.0) for g in s.optimizer.param_groups)
    assert [s.get_lr(k) for k in (0, 5, 10)] == pytest.approx([0.0, 0.5, 1.0])


def test_cosine_midpoint_and_min_lr_floor() -> None:
    s = _sched()
    assert s.get_lr(60) == pytest.approx(0.1 + 0.5 * 0.9)
    assert s.get_lr(35) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.25) + 1))
    assert s.get_lr(110) == pytest.approx(0.1)
    assert s.get_lr(111) == 0.1 and s.get_lr(10_000) == 0.1
    # Decreasing after warm-up, never below min_lr.
    lrs = [s.get_lr(k) for k in range(10, 200)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)) and min(lrs) == 0.1


def test_linear_and_constant_styles() -> None:
    lin = _sched(decay_style="linear")
    assert lin.get_lr(85) == pytest.approx(0.1 + 0.25 * 0.9)
    assert lin.get_lr(60) == pytest.approx(0.55)
    const = _sched(decay_style="constant")
    assert const.get_lr(5) == pytest.approx(0.5)
    assert const.get_lr(60) == const.get_lr(500) == 1.0


def test_no_warmup_starts_at_max_lr() -> None:
    s = _sched(warmup_iters=0, decay_iters=100)
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)
    assert s.get_lr(50) == pytest.approx(0.55)


def test_weight_decay_schedule_skips_no_decay_groups() -> None:
    s = _sched(start_wd=0.0, end_wd=0.2, wd_incr_style="linear")
    decay, no_decay = s.optimizer.param_groups
    assert decay["weight_decay"] == 0.0  # step 0 of a rising schedule
    s.step(55)
    assert decay["weight_decay"] == pytest.approx(0.1)
    assert no_decay["weight_decay"] == 0.0
    s.step(100)
    assert decay["weight_decay"] == pytest.approx(0.2)
    # Unscheduled weight decay is left alone.
    plain = _sched()
    plain.step(50)
    assert [g["weight_decay"] for g in plain.optimizer.param_groups] == [0.1, 0.0]


def test_state_dict_round_trip() -> None:
    a = _sched()
    a.step(37)
    b = _sched()
    b.load_state_dict(a.state_dict())
    assert b.num_steps == 37
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(a.get_lr(37))
    a.step()
    b.step()
    assert b.optimizer.param_groups[0]["lr"] == a.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "kw",
    [
        {"decay_style": "exp"},
        {"decay_iters": 5},
        {"min_lr": 2.0},
        {"warmup_iters": -1},
        {"start_wd": 0.1},
        {"start_wd": 0.0, "end_wd": 0.1},  # constant style needs start == end
        {"start_wd": 0.0, "end_wd": 0.1, "wd_incr_style": "step"},
    ],
)
def test_invalid_arguments_raise_value_error(kw: dict) -> None:
    with pytest.raises(ValueError):
        _sched(**kw)


def _model() -> SimpleNamespace:
    torch.manual_seed(0)
    return SimpleNamespace(
        modality_submodules=nn.ModuleDict({"vision": nn.Linear(4, 4), "audio": nn.Linear(4, 4)}),
        language_model=nn.Linear(4, 4),
    )


def test_build_schedulers_per_module_overrides() -> None:
    cfg = MimoConfig(
        modules={
            "vision": ModuleConfig(kind="vit", optimizer={"lr": 0.5, "warmup_iters": 0}),
            "audio": ModuleConfig(kind="audio", freeze=True),
            "language": ModuleConfig(kind="language", optimizer={"min_lr": 0.01}),
        },
        scheduler=SchedulerConfig(warmup_iters=4, decay_style="linear"),
    )
    cfg.optimizer.lr = 0.1
    cfg.train.iters = 20
    model = _model()
    freeze_modules(model, cfg)
    opt = get_mimo_optimizer(model, cfg)
    scheds = build_schedulers(cfg, opt)
    assert sorted(scheds) == ["language", "vision"]  # frozen audio has no optimizer
    vis, lang = scheds["vision"], scheds["language"]
    assert (vis.max_lr, vis.warmup_iters, vis.decay_iters) == (0.5, 0, 20)
    assert (lang.max_lr, lang.min_lr, lang.warmup_iters) == (0.1, 0.01, 4)
    assert vis.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)
    assert lang.optimizer.param_groups[0]["lr"] == 0.0
    for s in scheds.values():
        s.step(2)
    lrs = {g["module"]: g["lr"] for g in opt.param_groups}
    assert lrs["vision"] == pytest.approx(0.5 - 0.5 * 2 / 20)
    assert lrs["language"] == pytest.approx(0.05)
    assert lang.get_lr(20) == pytest.approx(0.01)


def test_build_schedulers_global_min_lr_and_weight_decay() -> None:
    cfg = MimoConfig(
        modules={"language": ModuleConfig(kind="language")},
        scheduler=SchedulerConfig(
            min_lr=0.0002, decay_iters=10, start_weight_decay=0.0, end_weight_decay=0.1,
            weight_decay_style="cosine",
        ),
    )
    cfg.optimizer.weight_decay = 0.05
    opt = get_mimo_optimizer(_model(), cfg)
    sched = build_schedulers(cfg, opt)["language"]
    assert (sched.min_lr, sched.decay_iters) == (0.0002, 10)
    decay, no_decay = opt.param_groups  # "weight" decays, "bias" does not
    sched.step(5)
    assert decay["weight_decay"] == pytest.approx(0.05)
    assert no_decay["weight_decay"] == 0.0


def test_schedulers_state_round_trip_and_fresh_modules() -> None:
    a = {"vision": _sched(), "language": _sched()}
    for s in a.values():
        s.step(7)
    saved = schedulers_state_dict({"language": a["language"]})  # vision was frozen then
    b = {"vision": _sched(), "language": _sched()}
    assert load_schedulers_state_dict(b, saved) == ["vision"]
    assert b["language"].num_steps == 7 and b["vision"].num_steps == 0
    assert b["vision"].optimizer.param_groups[0]["lr"] == 0.0  # its warm-up starts again
    assert load_schedulers_state_dict({"language": _sched()}, schedulers_state_dict(a)) == []


# ---- end to end: metrics.jsonl logs each module's own schedule -------------------------

NUM_ITERS = 6
LR_RUN = [
    "modules.vision.hidden_size=32", "modules.vision.num_layers=1",
    "modules.audio.hidden_size=32", "modules.language.hidden_size=64",
    "train.global_batch_size=16", "train.micro_batch_size=8", f"train.iters={NUM_ITERS}",
    "eval.interval=1000", "eval.iters=1", "log.interval=1", "log.tensorboard=false",
    "log.progress=false",
    # language: the global schedule (lr 3e-3, 2 warm-up steps, cosine to 0 at iteration 6)
    "optimizer.lr=3e-3", "optimizer.min_lr=0.0", "scheduler.warmup_iters=2",
    "scheduler.decay_style=cosine",
    # vision: its own lr, warm-up, linear decay and floor
    "modules.vision.optimizer.lr=5e-3", "modules.vision.optimizer.warmup_iters=4",
    "modules.vision.optimizer.decay_style=linear", "modules.vision.optimizer.min_lr=1e-4",
    # audio: constant, no warm-up
    "modules.audio.optimizer.lr=1e-3", "modules.audio.optimizer.warmup_iters=0",
    "modules.audio.optimizer.decay_style=constant",
] + [f"modules.{m}.parallel.{k}={v}" for i, m in enumerate(("vision", "audio", "language"))
     for k, v in (("data", 1), ("rank_offset", i))]


def _expected_lr(module: str, k: int) -> float:
    """The lr after ``k`` steps, written out from the schedule definitions above."""
    if module == "audio":
        return 1e-3
    if module == "vision":
        if k <= 4:
            return 5e-3 * k / 4
        return 1e-4 + (1 - (k - 4) / (NUM_ITERS - 4)) * (5e-3 - 1e-4)
    if k <= 2:
        return 3e-3 * k / 2
    return 0.5 * (math.cos(math.pi * (k - 2) / (NUM_ITERS - 2)) + 1) * 3e-3


def test_logged_lr_follows_each_modules_own_schedule(tmp_path: Path) -> None:
    run_ranks(3, train, LR_RUN + [f"log.dir={tmp_path}"], timeout_s=240)
    lines = metrics_lines(tmp_path)
    logged = [x for x in lines if "lr" in x]
    assert [x["iteration"] for x in logged] == list(range(1, NUM_ITERS + 1))
    for x in logged:
        assert not x["skipped"]
        # lr of iteration k is logged after its (successful) step: the schedule at k.
        want = {m: _expected_lr(m, x["iteration"]) for m in ("audio", "language", "vision")}
        assert x["lr"] == pytest.approx(want, rel=1e-9, abs=1e-15), x["iteration"]
