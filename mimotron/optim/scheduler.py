"""Learning-rate and weight-decay schedules, one per module (Megatron semantics).

Linear warm-up from 0 to ``max_lr`` over ``warmup_iters`` steps, then a cosine, linear
or constant decay to ``min_lr`` at ``decay_iters``, then ``min_lr``. ``step()`` is called
once per *successful* iteration and increments the count before computing the new
value, so iteration ``k`` trains with the lr of step ``k - 1``; the lr in force before
any step is that of step 0 (0 when there is a warm-up).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mimotron.config.schema import DECAY_STYLES

WD_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    """Set lr (and optionally weight decay) on an optimizer's param groups each step.

    Args:
        optimizer: anything with ``param_groups`` (a torch optimizer, usually one
            module's inner optimizer).
        max_lr: lr at the end of warm-up.
        min_lr: lr at and after ``decay_iters``.
        warmup_iters: steps of linear warm-up from 0.
        decay_iters: step at which the decay reaches ``min_lr``.
        decay_style: ``cosine``, ``linear`` or ``constant`` (stays at ``max_lr``).
        start_wd: weight decay at step 0; ``None`` (with ``end_wd``) leaves the groups'
            weight decay untouched.
        end_wd: weight decay at and after ``decay_iters``.
        wd_incr_style: ``constant``, ``linear`` or ``cosine`` increase from ``start_wd``.

    Raises:
        ValueError: an unknown style, negative counts, ``min_lr > max_lr``, a decaying
            schedule that ends before its warm-up, or a constant weight decay whose start
            and end differ.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float,
        min_lr: float,
        warmup_iters: int,
        decay_iters: int,
        decay_style: str = "cosine",
        start_wd: float | None = None,
        end_wd: float | None = None,
        wd_incr_style: str = "constant",
    ) -> None:
        _check_args(max_lr, min_lr, warmup_iters, decay_iters, decay_style)
        if (start_wd is None) != (end_wd is None):
            raise ValueError(
                f"start_wd={start_wd!r}, end_wd={end_wd!r} is invalid: give both or neither"
            )
        if wd_incr_style not in WD_STYLES:
            raise ValueError(
                f"wd_incr_style={wd_incr_style!r} is invalid: expected one of {WD_STYLES}"
            )
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(
                f"start_wd={start_wd!r} != end_wd={end_wd!r} needs a linear or cosine "
                "wd_incr_style, not constant"
            )
        self.optimizer = optimizer
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.warmup_iters = int(warmup_iters)
        self.decay_iters = int(decay_iters)
        self.decay_style = decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_style = wd_incr_style
        # Which groups decay is fixed at build time: a group whose wd starts at 0 (a
        # no-decay group, or one that a rising schedule set to 0) would otherwise be lost.
        self._wd_mults = [
            float(g.get("wd_mult", 1.0 if g.get("weight_decay", 0.0) > 0 else 0.0))
            for g in optimizer.param_groups
        ]
        self.num_steps = 0
        self.step(0)

    def get_lr(self, step: int) -> float:
        """The lr after ``step`` scheduler steps (pure; no side effects)."""
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.max_lr * step / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_iters:
            return self.min_lr
        ratio = (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def get_wd(self, step: int) -> float | None:
        """The weight decay after ``step`` steps, or ``None`` when it is not scheduled."""
        if self.start_wd is None or self.end_wd is None:
            return None
        if step > self.decay_iters or self.wd_incr_style == "constant" or self.decay_iters == 0:
            return self.end_wd
        ratio = step / self.decay_iters
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    @property
    def lr(self) -> float:
        """The lr currently set (that of ``num_steps``)."""
        return self.get_lr(self.num_steps)

    def step(self, increment: int = 1) -> None:
        """Advance ``increment`` steps and write lr (and scheduled wd) into the groups."""
        self.num_steps += increment
        lr = self.get_lr(self.num_steps)
        wd = self.get_wd(self.num_steps)
        for group, mult in zip(self.optimizer.param_groups, self._wd_mults, strict=True):
            group["lr"] = lr * group.get("lr_mult", 1.0)  # expert groups (expert_lr)
            if wd is not None:
                group["weight_decay"] = wd * mult

    def state_dict(self) -> dict[str, Any]:
        """The step count plus the schedule it was written with (for inspection)."""
        return {
            "num_steps": self.num_steps,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters,
            "decay_style": self.decay_style,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step; the schedule itself comes from the current config."""
        self.num_steps = int(state["num_steps"])
        self.step(0)


def schedulers_state_dict(schedulers: dict[str, OptimizerParamScheduler]) -> dict[str, Any]:
    """``{module: scheduler state}`` for the modules that train on this rank."""
    return {name: s.state_dict() for name, s in schedulers.items()}


def load_schedulers_state_dict(
    schedulers: dict[str, OptimizerParamScheduler], state: dict[str, Any]
) -> list[str]:
    """Resume each module's schedule from ``state``.

    A module absent from ``state`` (frozen when the checkpoint was written, so it had no
    schedule) keeps its fresh schedule: it starts at step 0, warm-up included, like its
    fresh optimizer state (see ``MimoOptimizer.load_state_dict``). Saved schedules of
    modules that no longer train are ignored.

    Returns:
        The modules that start fresh.
    """
    fresh = []
    for name, sched in schedulers.items():
        if name in state:
            sched.load_state_dict(state[name])
        else:
            fresh.append(name)
    return fresh


def _check_args(max_lr: float, min_lr: float, warmup: int, decay: int, style: str) -> None:
    if style not in DECAY_STYLES:
        raise ValueError(f"decay_style={style!r} is invalid: expected one of {DECAY_STYLES}")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"min_lr={min_lr!r} is invalid: expected 0 <= min_lr <= max_lr ({max_lr})")
    if warmup < 0 or decay < 0:
        raise ValueError(
            f"warmup_iters={warmup!r}, decay_iters={decay!r} is invalid: expected integers >= 0"
        )
    if style != "constant" and decay < warmup:
        raise ValueError(
            f"decay_iters={decay!r} is invalid: expected >= warmup_iters ({warmup}) "
            f"for decay_style={style!r}"
        )
