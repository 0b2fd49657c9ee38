"""Layout parity: the engine on forked ranks against the plain loop, and the comparisons.

Every parity test has the same three parts: the config of a layout (``schedule + layout +
extra`` over ``tests.common.BASE``), the engine trained on forked gloo ranks
(:func:`engine_results`: per-iteration losses, grad norms and token counts, the per-module
gradients the optimizer steps, the final weights of every rank), and the plain loop of
``tests.reference`` on the ``schedule + extra`` overrides (:func:`reference`, cached per
process). :func:`assert_matches_reference` holds the comparisons and their tolerances.
A new layout needs one row::

    def test_my_layout_matches_plain_loop():
        run_against_plain_loop(noncolocated({}, {}, {"tensor": 2}), SMALL_MB)

Runs through ``mimotron.training.loop.run_training`` (checkpoint and resume tests) use
:func:`train` on every rank and read back ``metrics.jsonl`` with :func:`metrics_lines`,
:func:`training_records` or :func:`records_by_iteration`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.layout import check_layout
from mimotron.runtime import init_runtime
from mimotron.training.loop import run_training
from tests.common import BASE, DIGITS, engine_run, module_of
from tests.reference import PACKING, ReferenceRun, packed_reference_run, reference_run

NUM_ITERS = 10
# Cosine decay over 12 iterations (after 2 warm-up steps) at lr 3e-3 with clipping at 0.5,
# of which the first 10 run (the schedule's lr is still well above its floor).
PARITY = ["train.iters=12"]
SMALL_MB = ["train.micro_batch_size=4"]  # 4 micro-batches; DP slices of 1-2 samples
LOSS_REL = 1e-4
WEIGHT_REL = 1e-4  # the worst measured is 2.2e-6 (docs/layouts.md, Heterogeneous parallelism)
# The fields of a training record that a resumed run must reproduce bitwise (no timings).
TINY_BUCKETS = ["train.grad_bucket_mb=0.01"]  # ~2600 fp32 values: several per module
RECORD_FIELDS = ("iteration", "loss", "grad_norm", "num_zeros", "lr", "consumed_samples")


def world_size(overrides: list[str]) -> int:
    """Ranks of the layout ``BASE + overrides`` describes."""
    return check_layout(load_config(DIGITS, BASE + overrides)).world_size


def checked_modules(overrides: list[str]) -> set[str]:
    """Modules whose model gradients the optimizer steps (not frozen, not ZeRO-sharded)."""
    cfg = load_config(DIGITS, BASE + overrides)
    return {n for n, m in cfg.modules.items() if not m.freeze and not m.parallel.shard_optimizer}


@cache
def _reference(key: tuple[str, ...], num_iters: int) -> ReferenceRun:
    return reference_run(key, num_iters)


def reference(extra: list[str], num_iters: int = NUM_ITERS,
              schedule: Sequence[str] = tuple(PARITY)) -> ReferenceRun:
    """The plain loop of ``schedule + extra`` (cached: every caller only reads it).

    Args:
        extra: overrides shared with the engine run (model, optimizer, batch).
        num_iters: iterations.
        schedule: the run length overrides (``PARITY``, or a file's own).
    """
    return _reference(tuple([*schedule, *extra]), num_iters)


@cache
def _packed_reference(key: tuple[str, ...], num_iters: int) -> ReferenceRun:
    return packed_reference_run(key, num_iters)


def packed_reference(overrides: Sequence[str] = tuple(PACKING), num_iters: int = NUM_ITERS
                     ) -> ReferenceRun:
    """The plain loop of ``overrides`` on rows packed by ``tests.reference``'s own packer
    (cached: every caller only reads it)."""
    return _packed_reference(tuple(overrides), num_iters)


def engine_results(overrides: list[str], num_iters: int = NUM_ITERS,
                   run: Callable[..., dict] = engine_run, world: int | None = None,
                   timeout_s: float = 300) -> list[dict]:
    """Every rank's ``run(rank, world, overrides, num_iters)``, in rank order.

    Args:
        overrides: the whole run's overrides after ``BASE`` (schedule, layout, extra).
        num_iters: iterations to train.
        run: the per-rank function (``engine_run`` or a wrapper recording more).
        world: ranks to fork (``None``: the layout's world size).
        timeout_s: the hard timeout of the forked job.
    """
    world = world_size(overrides) if world is None else world
    return run_ranks(world, run, overrides, num_iters, timeout_s=timeout_s)


def run_against_plain_loop(layout: list[str], extra: list[str],
                           run: Callable[..., dict] = engine_run,
                           num_iters: int = NUM_ITERS,
                           schedule: Sequence[str] = tuple(PARITY)) -> list[dict]:
    """Train ``schedule + layout + extra`` through the engine (``run`` on every rank) and
    check it against the plain loop of ``schedule + extra``: steps, per-module norms,
    final weights.

    Args:
        layout: overrides of the engine only (the layout, engine options).
        extra: overrides shared with the reference (model, optimizer, batch).
        run: the per-rank function (``engine_run`` or a wrapper counting more).
        num_iters: iterations to train (at least 10).
        schedule: the run length overrides, shared by both sides.

    Returns:
        Every rank's results, for a case's own further checks.
    """
    overrides = [*schedule, *layout, *extra]
    results = engine_results(overrides, num_iters, run)
    assert_matches_reference(results, reference(extra, num_iters, schedule),
                             checked_modules(overrides))
    return results


def assert_matches_reference(results: list[dict], ref: ReferenceRun, modules: set[str]
                             ) -> dict[str, float]:
    """Steps, the grad norms of ``modules`` as stepped, and the final weights.

    Returns:
        Parameter name -> relative L2 error of its final value.
    """
    assert_steps_match(results, ref)
    assert_module_norms_match(results, ref, modules)
    return assert_weights_match(results, ref)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def assert_steps_match(results: list[dict], ref: ReferenceRun) -> None:
    """Loss, global grad norm and token count of every rank, every iteration."""
    for rank, res in enumerate(results):
        for it, (loss, norm, skipped, tokens) in enumerate(res["steps"]):
            where = f"rank {rank} iteration {it}"
            assert skipped is False, where
            assert tokens == ref.num_tokens[it], f"{where}: loss-token counts differ"
            assert _rel(loss, ref.losses[it]) <= LOSS_REL, (
                f"{where}: loss {loss} vs {ref.losses[it]}")
            assert _rel(norm, ref.grad_norms[it]) <= LOSS_REL, (
                f"{where}: grad norm {norm} vs {ref.grad_norms[it]}")


def assert_module_norms_match(results: list[dict], ref: ReferenceRun, modules: set[str]
                              ) -> None:
    """Per-module grad norms as stepped; every copy of a parameter's gradient agrees."""
    for it in range(len(ref.module_norms)):
        merged: dict[str, float] = {}
        for rank, res in enumerate(results):
            for pname, sq in res["grad_sq"][it].items():
                if pname in merged:
                    assert sq == merged[pname], (
                        f"iteration {it}: {pname} gradient differs on rank {rank}")
                merged[pname] = sq
        norms: dict[str, float] = {}
        for pname, sq in merged.items():
            norms[module_of(pname)] = norms.get(module_of(pname), 0.0) + sq
        assert set(norms) == modules, f"iteration {it}: gradients of {sorted(norms)}"
        for module, sq in norms.items():
            want = ref.module_norms[it][module]
            assert _rel(math.sqrt(sq), want) <= LOSS_REL, (
                f"iteration {it}: module {module} grad norm {math.sqrt(sq)} vs {want}")


def assert_weights_match(results: list[dict], ref: ReferenceRun) -> dict[str, float]:
    """Final weights: replicas bitwise equal, full set present, close to the reference.

    Returns:
        Parameter name -> relative L2 error of its final value.
    """
    merged: dict[str, torch.Tensor] = {}
    for rank, res in enumerate(results):
        for pname, value in res["weights"].items():
            if pname in merged:
                assert torch.equal(value, merged[pname]), f"{pname} differs on rank {rank}"
            merged[pname] = value
    assert sorted(merged) == sorted(ref.weights), "parameter sets differ"
    errors = {}
    for pname, want in ref.weights.items():
        err = float((merged[pname] - want).norm() / want.norm().clamp_min(1e-12))
        assert err <= WEIGHT_REL, f"{pname}: relative L2 {err:.2e}"
        errors[pname] = err
    return errors


def assert_bitwise_equal(off: dict, on: dict, rank: int) -> None:
    """Losses, grad norms, token counts, stepped gradients and final weights: same bits."""
    assert on["steps"] == off["steps"], f"rank {rank}: losses or grad norms differ"
    for it, (g_on, g_off) in enumerate(zip(on["grad_sq"], off["grad_sq"], strict=True)):
        assert g_on == g_off, f"rank {rank} iteration {it}: a stepped gradient differs"
    assert sorted(on["weights"]) == sorted(off["weights"])
    for name, value in off["weights"].items():
        assert torch.equal(on["weights"][name], value), f"rank {rank}: {name} differs"


def train(rank: int, world: int, overrides: list[str], config: Path = DIGITS) -> None:
    """``run_training`` of ``config`` with ``overrides`` on this rank (for ``run_ranks``)."""
    run_training(load_config(config, overrides), init_runtime())


def metrics_lines(log_dir: Path) -> list[dict[str, Any]]:
    """Every line of ``log_dir/metrics.jsonl``."""
    return [json.loads(x) for x in (log_dir / "metrics.jsonl").read_text().splitlines()]


def training_records(log_dir: Path, fields: Sequence[str] | None = None
                     ) -> list[dict[str, Any]]:
    """The training lines (those with a ``loss``), cut to ``fields`` (``None``: all)."""
    lines = [r for r in metrics_lines(log_dir) if "loss" in r]
    return lines if fields is None else [{k: r[k] for k in fields} for r in lines]


def records_by_iteration(log_dir: Path, key: str = "loss") -> dict[int, dict[str, Any]]:
    """Iteration -> the line holding ``key`` (``loss``: training, ``eval_loss``: evaluation)."""
    return {r["iteration"]: r for r in metrics_lines(log_dir) if key in r}


def assert_records_follow(got: list[dict[str, Any]], want: list[dict[str, Any]],
                          rel: float = LOSS_REL, lr_rel: float | None = 1e-9,
                          same: Sequence[str] = ("consumed_samples",)) -> None:
    """Each training record of ``got`` is its iteration's record of ``want`` (a run that
    resumed or resharded following a straight one): loss and grad norm within ``rel``,
    the learning rates within ``lr_rel`` (``None``: not compared), ``same`` fields equal."""
    ref = {r["iteration"]: r for r in want}
    for r in got:
        w, it = ref[r["iteration"]], r["iteration"]
        for key in same:
            assert r[key] == w[key], (it, key)
        assert r["loss"] == pytest.approx(w["loss"], rel=rel), it
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=rel), it
        if lr_rel is not None:
            assert r["lr"] == pytest.approx(w["lr"], rel=lr_rel), it
