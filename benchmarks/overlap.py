"""Case - overlap: DP 2 step time with and without overlapped gradient reduction.

Two forked ranks, every module colocated with data parallelism 2. Each rank builds two
runs of the same config from the same seed, ``train.overlap_grad_reduce`` false (A) and
true (B), both with ``train.grad_bucket_mb = 1`` so that each module has several
buckets (the default 32 MiB would put each demo module in one). The steps'
micro-batches are precomputed and cycled; A and B step alternately, each side on its
own run, so the k-th step of both sides sees the same data and weights and their
losses must be bitwise equal (``losses_bitwise_equal``).

``t_reduction`` is the time ``finalize_model_grads`` takes on side A (the whole
non-overlapped reduction), measured by wrapping the step's reference to it;
``overlap_hidden_fraction = (t_A - t_B) / t_reduction``: 1 = the reduction is hidden
completely, 0 = nothing gained, negative = overlap costs more than it hides (two ranks
sharing two cores: gloo's worker threads compete with the backward for a CPU).
``reduction_wait_fraction`` (median ``finalize_model_grads`` time with overlap / without)
is the load-robust cross-check: the share of the reduction the step still waits for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import mimotron.training.step as step_module
from benchmarks.common import (
    TINY,
    CaseResult,
    Figure,
    Options,
    digits_raw,
    engine_stepper,
    fmt_stats,
    interleave,
    make_config,
    parallel,
    precompute_steps,
    setup_run,
    summarize,
)
from mimotron.testing import run_ranks

BUCKET = ["train.grad_bucket_mb=1"]


def _timed_finalize(record: dict[str, list[float]], side: dict[str, str]) -> Callable:
    """``finalize_model_grads`` that adds its wall time to ``record[side["name"]]``."""
    finalize = step_module.finalize_model_grads

    def timed(*args: Any, **kwargs: Any) -> None:
        t0 = time.perf_counter()
        finalize(*args, **kwargs)
        record[side["name"]].append(time.perf_counter() - t0)

    return timed


def _rank(rank: int, world: int, overrides: list[str], reps: int,
          steps_per_rep: int) -> dict[str, Any]:
    del world
    raw = digits_raw()
    layout = [o for m in raw["modules"] for o in parallel(m, data=2, rank_offset=0)]
    runs = {name: setup_run(make_config(raw, layout + BUCKET + overrides + extra))
            for name, extra in (("off", []), ("on", ["train.overlap_grad_reduce=true"]))}
    steps = precompute_steps(runs["off"], 2)
    steppers = {name: engine_stepper(run, steps) for name, run in runs.items()}
    finalize_s: dict[str, list[float]] = {"off": [], "on": []}
    current = {"name": "off"}
    step_module.finalize_model_grads = _timed_finalize(finalize_s, current)  # this rank only
    losses: dict[str, list[float]] = {"off": [], "on": []}

    def side(name: str) -> float:
        current["name"] = name
        dist.barrier()  # both ranks start the side together
        t0 = time.perf_counter()
        for _ in range(steps_per_rep):
            losses[name].append(steppers[name]()["loss"])
        return (time.perf_counter() - t0) / steps_per_rep

    for _ in range(2):  # warm-up: allocator, optimizer state, first-call paths
        side("off")
        side("on")
    for v in finalize_s.values():
        v.clear()
    times = interleave(reps, {"off": lambda: side("off"), "on": lambda: side("on")})
    return {"off": times["off"], "on": times["on"], "finalize_s": finalize_s,
            "losses_bitwise_equal": losses["off"] == losses["on"], "rank": rank}


def run_case(opts: Options) -> CaseResult:
    """Measure ``overlap_hidden_fraction`` (target >= 0.5, issue 17)."""
    steps_per_rep = 1 if opts.tiny else (2 if opts.quick else 4)
    res = run_ranks(2, _rank, TINY if opts.tiny else [], opts.reps, steps_per_rep,
                    timeout_s=900)[0]
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    t_red = statistics.median(res["finalize_s"]["off"])
    paired = [(a - b) / t_red for a, b in zip(res["off"], res["on"], strict=True)]
    fig = Figure("overlap_hidden_fraction", (off - on) / t_red, ">= 0.5",
                 (min(paired), max(paired)),
                 f"DP 2 step {fmt_stats(summarize(res['off']))} without vs "
                 f"{fmt_stats(summarize(res['on']))} with overlap; reduction "
                 f"{fmt_stats(summarize(res['finalize_s']['off']))}")
    out = CaseResult("overlap", [fig])
    out.measurements = {
        "step_s_no_overlap": summarize(res["off"]),
        "step_s_overlap": summarize(res["on"]),
        "finalize_s_no_overlap": summarize(res["finalize_s"]["off"]),
        "finalize_s_overlap_wait": summarize(res["finalize_s"]["on"]),
        # Load-robust cross-check: the share of the reduction the step still waits for.
        "reduction_wait_fraction": (statistics.median(res["finalize_s"]["on"]) / t_red),
        "losses_bitwise_equal": res["losses_bitwise_equal"],
        "steps_per_rep": steps_per_rep,
        "grad_bucket_mb": 1,
        "rank": res["rank"],
    }
    spread = max(res["off"]) - min(res["off"])
    if spread > t_red:
        out.notes.append(
            f"the step time without overlap varies by {spread * 1e3:.0f} ms over the "
            f"repetitions, more than the whole reduction ({t_red * 1e3:.0f} ms): the "
            "hidden fraction is not resolved on this machine at this load")
    if not res["losses_bitwise_equal"]:
        out.notes.append("losses with and without overlap differ: a bug")
    return out
