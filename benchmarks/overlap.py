"""Case - overlap: DP 2 step time with and without overlapped gradient reduction.

Two forked ranks, every module colocated with data parallelism 2, one micro-batch per
replica and step (so the whole backward is the last micro-batch's and can hide the
reduction), ``train.grad_bucket_mb = 1`` so that each module has several buckets. Two
variants, each with two runs of the same config from the same seed, overlap off (A)
and on (B):

* ``dp``: plain data parallelism, ``train.overlap_grad_reduce``;
* ``zero``: every module ZeRO-1 (``parallel.shard_optimizer``), with
  ``train.overlap_grad_reduce`` (reduce-scatters in the backward) and
  ``train.overlap_param_gather`` (the all-gather lands in the next forward).

Method (chosen so that an idle machine resolves the 50% target): the runs step in
*blocks* of a few steps, A and B alternating block by block (ABBA...), many blocks.
Every block ends by landing B's pending parameter gather inside the timed region, so
B never gains from A's steps running while its gather is in flight. Per step, the time
spent inside the reduction's entry points is recorded (``GradSync.finish``, and
ZeRO's ``reduce_grads`` / ``gather_params`` / ``finish_gather``, outermost calls only):
on A that is the whole standalone reduction ``t_reduction``, on B only what the step
still waits for.

* ``overlap_hidden_fraction`` = median over blocks of the paired per-step difference
  ``t_A - t_B``, divided by the median ``t_reduction``: 1 = the reduction is hidden
  completely, 0 = nothing gained, negative = overlap costs more than it hides (gloo's
  threads compete with the backward for the rank's core). Pairing cancels drift; the
  median ignores spikes; the spread is a distribution-free ~95% interval of the median
  (order statistics), so the figure is resolved when the interval excludes the target.
* ``reduction_wait_fraction`` = median per-step wait on B / median ``t_reduction`` on A:
  the share of the reduction the step still waits for. Load-robust (no step times), but
  blind to what the overlap costs the backward; ``1 - reduction_wait_fraction`` is the
  upper bound of the hidden fraction.
* ``overlap_compute_slowdown_ms`` = median over paired blocks of the per-step time
  *outside* the reduction's entry points (forward, backward, optimizer), B minus A: what
  the overlapped reduction costs the rest of the step. So that
  ``hidden ~ 1 - wait - slowdown / t_reduction``.
* ``reduction_cpu_fraction`` = process CPU time (``time.process_time``, all threads,
  gloo's included) inside A's reduction entry points / their wall time: how much of a
  core the reduction needs. With both cores busy computing (one rank per core), that
  CPU comes out of the backward when the reduction overlaps it. Per-step process CPU
  time of both sides is in the JSON (``cpu_s_per_step_*``, ``paired_cpu_extra_s``).

Full runs also repeat plain DP at 0.25 and 4 MiB buckets (``by_bucket_mb_dp``,
measurements only): does the bucket size move the balance between waiting and slowdown.

Both variants must train bit-identically: their losses are compared
(``losses_bitwise_equal``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from benchmarks.common import (
    TINY,
    CaseResult,
    Figure,
    Options,
    digits_raw,
    engine_stepper,
    fmt_stats,
    make_config,
    parallel,
    precompute_steps,
    setup_run,
    summarize,
)
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.zero import ZeroShards

BUCKET_MB = 1.0
EXTRA_BUCKETS_MB = (0.25, 4.0)  # plain DP only, full runs: does the bucket size matter?
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    # name: (layout extras, overrides of side B)
    "dp": ([], ["train.overlap_grad_reduce=true"]),
    "zero": (["shard_optimizer=true"],
             ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true"]),
}
ZERO_CALLS = ("reduce_grads", "gather_params", "finish_gather")


class CommClock:
    """Wall and process CPU time inside the reduction's entry points (outermost calls only).

    ``time.process_time`` counts every thread of the process, so on the non-overlapped
    side it includes gloo's own threads (copies, the sum, socket I/O) while the main
    thread waits: CPU-seconds / wall-seconds of the standalone reduction.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.acc = 0.0
        self.cpu = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.acc += time.perf_counter() - t0
                    self.cpu += time.process_time() - c0

        return timed

    def take(self) -> float:
        out, self.acc = self.acc, 0.0
        return out

    def take_cpu(self) -> float:
        out, self.cpu = self.cpu, 0.0
        return out


def _install(clock: CommClock) -> None:
    """Time this forked rank's reduction entry points (patched in this rank only)."""
    GradSync.finish = clock.wrap(GradSync.finish)
    for name in ZERO_CALLS:
        setattr(ZeroShards, name, clock.wrap(getattr(ZeroShards, name)))


def _layout(raw: dict[str, Any], overrides: list[str], extras: list[str],
            bucket_mb: float) -> list[str]:
    """DP 2 colocated, one micro-batch per replica (after ``overrides``' batch size)."""
    global_batch = make_config(raw, overrides).train.global_batch_size
    out = [f"train.grad_bucket_mb={bucket_mb}", *overrides,
           f"train.micro_batch_size={global_batch // 2}"]
    for m in raw["modules"]:
        out += parallel(m, data=2, rank_offset=0)
        out += [f"modules.{m}.parallel.{e}" for e in extras]
    return out


def _rank(rank: int, world: int, overrides: list[str], variant: str, num_blocks: int,
          steps_per_block: int, bucket_mb: float) -> dict[str, Any]:
    del world
    raw = digits_raw()
    extras, side_b = VARIANTS[variant]
    base = _layout(raw, overrides, extras, bucket_mb)
    runs = {"off": setup_run(make_config(raw, base)),
            "on": setup_run(make_config(raw, base + side_b))}
    steps = precompute_steps(runs["off"], 2)
    steppers = {name: engine_stepper(run, steps) for name, run in runs.items()}
    clock = CommClock()
    _install(clock)
    keys = ("block_s", "comm_s", "comm_block_s", "comm_cpu_s", "cpu_block_s", "losses")
    out: dict[str, Any] = {n: {k: [] for k in keys} for n in runs}

    def block(name: str) -> None:
        side = out[name]
        dist.barrier()  # both ranks start the block together
        clock.take()
        clock.take_cpu()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps_per_block):
            side["losses"].append(steppers[name]()["loss"])
            side["comm_s"].append(clock.take())
        runs[name].optimizer.finish_param_gather()  # no gain from the other side's block
        side["comm_s"][-1] += clock.take()
        side["block_s"].append((time.perf_counter() - t0) / steps_per_block)
        side["cpu_block_s"].append((time.process_time() - c0) / steps_per_block)
        side["comm_block_s"].append(sum(side["comm_s"][-steps_per_block:]) / steps_per_block)
        side["comm_cpu_s"].append(clock.take_cpu() / steps_per_block)

    for _ in range(2):  # warm-up: allocator, optimizer state, first-call paths
        block("off")
        block("on")
    for side in out.values():
        for key in keys[:-1]:
            side[key].clear()
    for i in range(num_blocks):
        for name in ("off", "on") if i % 2 == 0 else ("on", "off"):
            block(name)
    out["losses_bitwise_equal"] = out["off"]["losses"] == out["on"]["losses"]
    out["rank"] = rank
    return out


def median_interval(values: list[float]) -> tuple[float, float]:
    """A distribution-free ~95% interval of the median (order statistics, n >= 1)."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * math.sqrt(n)
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[lo], ordered[hi]


def _paired(off: list[float], on: list[float]) -> tuple[float, tuple[float, float]]:
    """Median of the per-block differences ``on - off`` and its ~95% interval."""
    diffs = [b - a for a, b in zip(off, on, strict=True)]
    return statistics.median(diffs), median_interval(diffs)


def _compute_s(side: dict[str, Any]) -> list[float]:
    """Per block: step time outside the reduction's entry points (forward, backward, ...)."""
    return [b - c for b, c in zip(side["block_s"], side["comm_block_s"], strict=True)]


def _cost_figures(res: dict[str, Any], suffix: str, t_red: float) -> tuple[list[Figure],
                                                                          dict[str, Any]]:
    """What overlapping costs the rest of the step, and the reduction's CPU demand."""
    off, on = res["off"], res["on"]
    slow, (slo, shi) = _paired(_compute_s(off), _compute_s(on))
    cpu_extra, (clo, chi) = _paired(off["cpu_block_s"], on["cpu_block_s"])
    cpu_frac = sum(off["comm_cpu_s"]) / sum(off["comm_block_s"])
    figures = [
        Figure(f"overlap_compute_slowdown_ms{suffix}", slow * 1e3, "",
               (slo * 1e3, shi * 1e3),
               f"step time outside the reduction, with minus without overlap = "
               f"{slow / t_red:.2f} of the reduction; [interval of the median]"),
        Figure(f"reduction_cpu_fraction{suffix}", cpu_frac, "", None,
               "process CPU-seconds (all threads) / wall-seconds of the standalone "
               f"reduction; CPU per step {fmt_stats(summarize(off['cpu_block_s']))} "
               f"without vs {fmt_stats(summarize(on['cpu_block_s']))} with overlap"),
    ]
    measurements = {
        f"compute_s_no_overlap{suffix}": summarize(_compute_s(off)),
        f"compute_s_overlap{suffix}": summarize(_compute_s(on)),
        f"cpu_s_per_step_no_overlap{suffix}": summarize(off["cpu_block_s"]),
        f"cpu_s_per_step_overlap{suffix}": summarize(on["cpu_block_s"]),
        f"paired_cpu_extra_s{suffix}": {"median": cpu_extra, "interval": [clo, chi]},
        f"reduction_cpu_s_no_overlap{suffix}": summarize(off["comm_cpu_s"]),
    }
    return figures, measurements


def _figures(res: dict[str, Any], suffix: str) -> tuple[list[Figure], dict[str, Any]]:
    off, on = res["off"], res["on"]
    t_red = statistics.median(off["comm_s"])
    paired = [a - b for a, b in zip(off["block_s"], on["block_s"], strict=True)]
    lo, hi = median_interval(paired)
    wait = statistics.median(on["comm_s"]) / t_red
    step_off, step_on = summarize(off["block_s"]), summarize(on["block_s"])
    hidden = Figure(
        f"overlap_hidden_fraction{suffix}", statistics.median(paired) / t_red, ">= 0.5",
        (lo / t_red, hi / t_red),
        f"DP 2{' ZeRO-1' if suffix else ''} step {fmt_stats(step_off)} without vs "
        f"{fmt_stats(step_on)} with overlap; reduction {fmt_stats(summarize(off['comm_s']))}"
        f"; [interval of the median over {len(paired)} paired blocks]")
    waited = Figure(f"reduction_wait_fraction{suffix}", wait, "", None,
                    f"the step waits {fmt_stats(summarize(on['comm_s']))} of the reduction "
                    "with overlap")
    cost_figures, cost_measurements = _cost_figures(res, suffix, t_red)
    measurements = {
        f"step_s_no_overlap{suffix}": step_off,
        f"step_s_overlap{suffix}": step_on,
        f"reduction_s_no_overlap{suffix}": summarize(off["comm_s"]),
        f"reduction_s_overlap_wait{suffix}": summarize(on["comm_s"]),
        f"paired_step_gain_s{suffix}": summarize(paired),
        f"losses_bitwise_equal{suffix}": res["losses_bitwise_equal"],
        **cost_measurements,
    }
    return [hidden, waited, *cost_figures], measurements


def _bucket_sweep(opts: Options, num_blocks: int, steps_per_block: int) -> dict[str, Any]:
    """Plain DP at other bucket sizes (measurements only): hidden, waited, slowdown."""
    out: dict[str, Any] = {}
    for mb in EXTRA_BUCKETS_MB:
        res = run_ranks(2, _rank, TINY if opts.tiny else [], "dp", num_blocks,
                        steps_per_block, mb, timeout_s=900)[0]
        figures, _ = _figures(res, "")
        out[f"{mb:g}"] = {f.name: {"value": f.value, "interval": f.spread,
                                   "detail": f.detail} for f in figures}
    return out


def run_case(opts: Options) -> CaseResult:
    """Measure ``overlap_hidden_fraction`` (target >= 0.5, issue 17), plain and ZeRO-1."""
    steps_per_block = 2 if opts.tiny or opts.quick else 3
    num_blocks = (2 if opts.tiny else 4 if opts.quick else 8) * opts.reps
    out = CaseResult("overlap")
    out.measurements = {"grad_bucket_mb": BUCKET_MB, "steps_per_block": steps_per_block,
                        "num_blocks": num_blocks}
    for variant, suffix in (("dp", ""), ("zero", "_zero")):
        res = run_ranks(2, _rank, TINY if opts.tiny else [], variant, num_blocks,
                        steps_per_block, BUCKET_MB, timeout_s=900)[0]
        figures, measurements = _figures(res, suffix)
        out.figures += figures
        out.measurements.update(measurements)
        lo, hi = figures[0].spread
        if lo < 0.5 <= hi:
            out.notes.append(
                f"{figures[0].name}: the interval of the median [{lo:.2f}, {hi:.2f}] "
                "contains the target: not resolved at this load and number of blocks")
        if not res["losses_bitwise_equal"]:
            out.notes.append(f"{variant}: losses with and without overlap differ: a bug")
    if not opts.tiny:
        out.measurements["by_bucket_mb_dp"] = _bucket_sweep(opts, num_blocks, steps_per_block)
    return out
