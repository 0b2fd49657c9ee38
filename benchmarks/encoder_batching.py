"""Case - encoder_batching: colocated step time with encoder batching off vs on.

One rank holds every module (colocated, DP 1). Two runs of the same config from the
same seed, ``train.encoder_batching`` false (A) and true (B), step alternately on the
same precomputed micro-batches (cycled), so the k-th step of both sides sees the same
data. The demo's global batch of 64 is cut into 16 micro-batches of 4 (``--size tiny``:
8 of 1), the regime batching is for: without it every encoder runs 16 small forwards and
backwards per step, with it one of each on 64 samples.

``encoder_batching_speedup = median(t_A) / median(t_B)`` (> 1: batching is faster); the
spread is the min-max of the per-repetition ratios. The losses of the two sides are
compared (``max_loss_rel_diff``): equal to rounding, not bitwise, because the encoder
matmuls change shape. Process CPU time per step is recorded too (it barely moves when
other processes load the machine, so its ratio cross-checks the wall-time one).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

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
    one_rank,
    precompute_steps,
    setup_run,
    summarize,
)
from mimotron.forked_ranks import run_ranks

BATCH = {"default": ["train.global_batch_size=64", "train.micro_batch_size=4"],
         "tiny": ["train.global_batch_size=8", "train.micro_batch_size=1"]}


def _rank(rank: int, world: int, overrides: list[str], reps: int,
          steps_per_rep: int) -> dict[str, Any]:
    del rank, world
    raw = digits_raw()
    runs = {name: setup_run(make_config(raw, one_rank(raw) + overrides + extra))
            for name, extra in (("off", []), ("on", ["train.encoder_batching=true"]))}
    steps = precompute_steps(runs["off"], 2)
    steppers = {name: engine_stepper(run, steps) for name, run in runs.items()}
    losses: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}

    def side(name: str) -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps_per_rep):
            losses[name].append(steppers[name]()["loss"])
        cpu[name].append((time.process_time() - c0) / steps_per_rep)
        return (time.perf_counter() - t0) / steps_per_rep

    for _ in range(2):  # warm-up: allocator, optimizer state, first-call paths
        side("off")
        side("on")
    for v in cpu.values():
        v.clear()
    times = interleave(reps, {"off": lambda: side("off"), "on": lambda: side("on")})
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["off"], losses["on"],
                                                           strict=True)]
    return {"off": times["off"], "on": times["on"], "cpu": cpu, "max_loss_rel_diff": max(rel),
            "num_microbatches": runs["on"].global_state.cfg.num_microbatches}


def run_case(opts: Options) -> CaseResult:
    """Measure ``encoder_batching_speedup`` (off time / on time; reported, no target)."""
    steps_per_rep = 1 if opts.tiny else (2 if opts.quick else 4)
    overrides = (TINY + BATCH["tiny"]) if opts.tiny else BATCH["default"]
    res = run_ranks(1, _rank, overrides, opts.reps, steps_per_rep, timeout_s=900)[0]
    off, on = statistics.median(res["off"]), statistics.median(res["on"])
    paired = [a / b for a, b in zip(res["off"], res["on"], strict=True)]
    n = res["num_microbatches"]
    fig = Figure("encoder_batching_speedup", off / on, "", (min(paired), max(paired)),
                 f"colocated step ({n} micro-batches, one rank) "
                 f"{fmt_stats(summarize(res['off']))} off vs "
                 f"{fmt_stats(summarize(res['on']))} on")
    out = CaseResult("encoder_batching", [fig])
    out.measurements = {
        "step_s_off": summarize(res["off"]),
        "step_s_on": summarize(res["on"]),
        "cpu_s_off": summarize(res["cpu"]["off"]),
        "cpu_s_on": summarize(res["cpu"]["on"]),
        "cpu_speedup": statistics.median(res["cpu"]["off"]) / statistics.median(
            res["cpu"]["on"]),
        "max_loss_rel_diff": res["max_loss_rel_diff"],
        "num_microbatches": n,
        "steps_per_rep": steps_per_rep,
    }
    if res["max_loss_rel_diff"] > 1e-4:
        out.notes.append(f"losses with and without encoder batching differ by "
                         f"{res['max_loss_rel_diff']:.1e} (relative): a bug")
    return out
