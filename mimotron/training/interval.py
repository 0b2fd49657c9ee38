"""Means over a log interval: what a logged train record's losses and accuracy mean.

With ``log.interval = N`` a train record covers the ``N`` iterations since the previous
one. Like Megatron's ``training_log``, its ``loss`` is the mean over those iterations,
not the value of the logged iteration alone, so a curve sampled every ``N`` iterations
does not jump with the noise of single batches:

* ``loss`` — token-weighted: ``sum(loss_sum) / sum(loss tokens)`` over the interval;
* ``train_accuracy`` — sample-weighted: ``sum(correct) / sum(samples)``;
* auxiliary metrics a forward step returns — a ``[sum, count]`` pair is summed over the
  interval then divided (so it is count-weighted), a scalar is the mean of its
  per-iteration global sums.

Iterations whose update was skipped (non-finite loss or gradients) are left out of the
means and counted; the last iteration's values are kept beside the means with a
``_last`` suffix. :class:`IntervalMeans` holds one interval; the loop feeds it every
iteration and reads and resets it at each log line.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Suffix of the last iteration's value beside each interval mean.
LAST = "_last"


def aux_value(sums: list[float], iters: int) -> float | None:
    """One auxiliary metric from its (world) sums over ``iters`` iterations.

    Args:
        sums: ``[sum, count]`` (a pair: logged as sum / count) or ``[sum]`` (a scalar:
            logged as its sum per iteration).
        iters: iterations the sums cover.

    Returns:
        The value, or ``None`` when nothing was counted.
    """
    if len(sums) == 2:
        return sums[0] / sums[1] if sums[1] else None
    return sum(sums) / iters if iters else None


class IntervalMeans:
    """Accumulates the iterations of one log interval (identical on every rank).

    ``loss_dict`` values (``loss``, ``num_tokens``, ``accuracy``, ``num_samples``) are
    world-reduced and so the same on every rank; auxiliary sums are this rank's (the
    logger adds them up over ranks, see :func:`aux_value`).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new interval (after each log line)."""
        self.iters = 0
        self.skipped = 0
        self._loss_sum = 0.0
        self._tokens = 0.0
        self._correct = 0.0
        self._samples = 0.0
        self._aux: dict[str, torch.Tensor] = {}
        self._aux_last: dict[str, torch.Tensor] = {}
        self._last: dict[str, float] = {}

    @property
    def counted(self) -> int:
        """Iterations that enter the means (not skipped)."""
        return self.iters - self.skipped

    def add(self, loss_dict: dict[str, float], skipped: bool,
            aux: dict[str, torch.Tensor] | None = None) -> None:
        """Add one iteration.

        Args:
            loss_dict: ``train_step_mimo``'s: ``loss`` (per token), ``num_tokens``, and
                optionally ``accuracy`` with ``num_samples``.
            skipped: the optimizer skipped the update; the iteration is left out of the
                means (as is any iteration with a non-finite loss) and counted.
            aux: this rank's auxiliary metric sums of the iteration, by name.
        """
        aux = aux or {}
        loss = float(loss_dict["loss"])
        self.iters += 1
        self._last = {"loss": loss}
        if "accuracy" in loss_dict:
            self._last["train_accuracy"] = float(loss_dict["accuracy"])
        self._aux_last = {k: v.detach().double().flatten() for k, v in aux.items()}
        if skipped or not math.isfinite(loss):
            self.skipped += 1
            return
        tokens = float(loss_dict.get("num_tokens", 1.0))
        self._loss_sum += loss * tokens
        self._tokens += tokens
        if "accuracy" in loss_dict:
            samples = float(loss_dict.get("num_samples", 1.0))
            self._correct += float(loss_dict["accuracy"]) * samples
            self._samples += samples
        for key, value in self._aux_last.items():
            self._aux[key] = self._aux[key] + value if key in self._aux else value.clone()

    def record(self) -> dict[str, Any]:
        """The interval's loss and accuracy fields of a train record.

        Returns:
            ``loss`` (token-weighted mean; NaN when every iteration was skipped),
            ``loss_last``, ``train_accuracy`` / ``train_accuracy_last`` (when reported),
            ``interval_iters`` and ``interval_skipped_iters``.
        """
        out: dict[str, Any] = {
            "loss": self._loss_sum / self._tokens if self._tokens else float("nan"),
            "loss" + LAST: self._last.get("loss", float("nan"))}
        if "train_accuracy" in self._last:
            out["train_accuracy"] = (self._correct / self._samples if self._samples
                                     else float("nan"))
            out["train_accuracy" + LAST] = self._last["train_accuracy"]
        out.update(interval_iters=self.iters, interval_skipped_iters=self.skipped)
        return out

    def aux_sums(self) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """This rank's auxiliary sums: over the counted iterations, and of the last one."""
        return ({k: v.tolist() for k, v in self._aux.items()},
                {k: v.tolist() for k, v in self._aux_last.items()})
