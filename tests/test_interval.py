"""The log-interval accumulator: token/sample weighting, skipped iterations, resets."""

from __future__ import annotations

import math

import pytest
import torch

from mimotron.training.interval import IntervalMeans, aux_value


def _it(loss: float, tokens: float, accuracy: float = 0.5, samples: float = 4.0) -> dict:
    return {"loss": loss, "num_tokens": tokens, "accuracy": accuracy, "num_samples": samples}


def test_loss_is_token_weighted_and_accuracy_sample_weighted():
    acc = IntervalMeans()
    acc.add(_it(2.0, 10.0, accuracy=1.0, samples=1.0), skipped=False)
    acc.add(_it(1.0, 30.0, accuracy=0.0, samples=3.0), skipped=False)
    rec = acc.record()
    assert rec["loss"] == pytest.approx((2.0 * 10 + 1.0 * 30) / 40)  # 1.25, not 1.5
    assert rec["loss_last"] == 1.0
    assert rec["train_accuracy"] == pytest.approx(1 / 4)  # Not the plain mean 0.5.
    assert rec["train_accuracy_last"] == 0.0
    assert (rec["interval_iters"], rec["interval_skipped_iters"]) == (2, 0)


def test_skipped_and_non_finite_iterations_are_excluded_and_counted():
    acc = IntervalMeans()
    acc.add(_it(3.0, 10.0), skipped=False)
    acc.add(_it(float("nan"), 10.0), skipped=True)
    acc.add(_it(float("inf"), 10.0), skipped=False)  # Non-finite even if not skipped.
    acc.add(_it(100.0, 10.0), skipped=True)  # E.g. an fp16 overflow: finite but skipped.
    acc.add(_it(1.0, 30.0), skipped=False)
    rec = acc.record()
    assert rec["loss"] == pytest.approx((30.0 + 30.0) / 40)
    assert rec["loss_last"] == 1.0
    assert (rec["interval_iters"], rec["interval_skipped_iters"]) == (5, 3)
    assert acc.counted == 2


def test_an_interval_of_only_skipped_iterations_has_a_nan_mean_and_the_last_value():
    acc = IntervalMeans()
    acc.add(_it(float("nan"), 10.0), skipped=True)
    rec = acc.record()
    assert math.isnan(rec["loss"]) and math.isnan(rec["loss_last"])
    assert math.isnan(rec["train_accuracy"]) and rec["train_accuracy_last"] == 0.5
    assert (rec["interval_iters"], rec["interval_skipped_iters"]) == (1, 1)


def test_reset_starts_a_new_interval():
    acc = IntervalMeans()
    acc.add(_it(5.0, 10.0), skipped=False)
    acc.add(_it(float("nan"), 10.0), skipped=True)
    acc.reset()
    acc.add(_it(2.0, 10.0), skipped=False)
    rec = acc.record()
    assert rec["loss"] == 2.0 and rec["loss_last"] == 2.0
    assert (rec["interval_iters"], rec["interval_skipped_iters"]) == (1, 0)
    assert acc.aux_sums() == ({}, {})


def test_no_accuracy_fields_without_accuracy():
    acc = IntervalMeans()
    acc.add({"loss": 1.0, "num_tokens": 2.0}, skipped=False)
    assert set(acc.record()) == {"loss", "loss_last", "interval_iters",
                                 "interval_skipped_iters"}


def test_auxiliary_sums_skip_skipped_iterations_and_keep_the_last():
    acc = IntervalMeans()
    pair, scalar = torch.tensor([6.0, 3.0]), torch.tensor(2.0)
    acc.add(_it(1.0, 1.0), False, {"lm_loss": pair, "calls": scalar})
    acc.add(_it(float("nan"), 1.0), True, {"lm_loss": torch.tensor([99.0, 1.0]),
                                           "calls": torch.tensor(50.0)})
    acc.add(_it(1.0, 1.0), False, {"lm_loss": torch.tensor([2.0, 1.0]),
                                   "calls": torch.tensor(4.0)})
    sums, last = acc.aux_sums()
    assert sums == {"lm_loss": [8.0, 4.0], "calls": [6.0]}
    assert last == {"lm_loss": [2.0, 1.0], "calls": [4.0]}
    # A pair is count-weighted over the interval; a scalar is its mean per iteration.
    assert aux_value(sums["lm_loss"], acc.counted) == 2.0
    assert aux_value(sums["calls"], acc.counted) == 3.0
    assert aux_value(last["lm_loss"], 1) == 2.0 and aux_value(last["calls"], 1) == 4.0
    assert aux_value([1.0, 0.0], 2) is None and aux_value([1.0], 0) is None
