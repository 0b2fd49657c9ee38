"""Loss scalers: a constant one (fp32/bf16) and Megatron's dynamic one (fp16).

The training step multiplies the loss by ``scale`` before backward; the optimizer
divides the gradients by it (``inv_scale``) before the norm and the step. A dynamic
scaler halves the scale after ``hysteresis`` steps with non-finite gradients and
doubles it after ``growth_interval`` consecutive clean steps.

:class:`~mimotron.optim.mimo_optimizer.MimoOptimizer` keeps one scaler per module (with
the module's own settings) on every rank and updates every one of them from the *world*
found-inf flag, so each module's scale is the same on every rank. Backward applies one
common factor, the minimum over the modules' scales, and gradients are unscaled by it.
"""

from __future__ import annotations

from typing import Any

import torch


class _ScaleHolder:
    """What both scalers share: the current scale and its inverse (from ``_scale``)."""

    _scale: float

    @property
    def scale(self) -> torch.Tensor:
        """The current scale as a 0-dim float32 tensor."""
        return torch.tensor(self._scale, dtype=torch.float32)

    @property
    def inv_scale(self) -> float:
        """``1 / scale``, the factor that unscales gradients."""
        return 1.0 / self._scale


class ConstantLossScaler(_ScaleHolder):
    """A loss scale that never changes (1.0 means no scaling).

    Args:
        scale: the fixed scale.
    """

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale={scale!r} is invalid: expected a positive number")
        self._scale = float(scale)

    @property
    def is_dynamic(self) -> bool:
        """False: gradients never need a non-finite check because of scaling."""
        return False

    def update(self, found_inf: bool) -> None:
        """Nothing to adapt; present so both scalers share one interface."""
        del found_inf

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (safe to store as a checkpoint object)."""
        return {"scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scale written by :meth:`state_dict`."""
        self._scale = float(state.get("scale", self._scale))


class DynamicLossScaler(_ScaleHolder):
    """Megatron's dynamic loss scaler with hysteresis.

    Args:
        initial_scale: starting scale (e.g. ``2**16``).
        min_scale: the scale never drops below this.
        growth_interval: consecutive clean steps before the scale grows
            (``optimizer.loss_scale_window`` in the config).
        hysteresis: overflowing steps tolerated before the scale backs off; the count
            is reset when the scale grows.
        growth_factor: multiplier applied on growth.
        backoff_factor: multiplier applied on back-off.

    Raises:
        ValueError: a non-positive scale or factor, or an interval/hysteresis below 1.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        if initial_scale <= 0 or min_scale <= 0:
            raise ValueError(
                f"loss scale initial={initial_scale!r}, min={min_scale!r} is invalid: "
                "expected positive numbers"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"growth_interval={growth_interval!r}, hysteresis={hysteresis!r} is invalid: "
                "expected integers >= 1"
            )
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"growth_factor={growth_factor!r}, backoff_factor={backoff_factor!r} is "
                "invalid: expected growth_factor > 1 and 0 < backoff_factor < 1"
            )
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def is_dynamic(self) -> bool:
        """True: scaled fp16 gradients may overflow and must be checked."""
        return True

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after one step.

        Args:
            found_inf: whether any rank saw a non-finite gradient this step (the
                caller passes the world-reduced flag so every rank agrees).
        """
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (safe to store as a checkpoint object)."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state written by :meth:`state_dict`.

        A checkpoint written with a constant scaler only carries ``scale``; the trackers
        then restart from their initial values.
        """
        self._scale = float(state["scale"])
        self._growth_tracker = int(state.get("growth_tracker", 0))
        self._hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))


LossScaler = ConstantLossScaler | DynamicLossScaler
