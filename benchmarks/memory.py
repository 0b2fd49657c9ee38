"""Case 5 - memory: peak RSS per rank vs the analytic estimate of ``mimotron plan``.

Each repetition forks fresh ranks. In every rank, after imports and process-group
initialisation and before the model exists, the resident set is the *baseline*
(interpreter, torch, the libraries: a fixed per-process cost the estimate does not
model); the kernel's peak counter is then reset (``/proc/self/clear_refs``), the run is
built and trains a few steps, and the peak (``VmHWM``) is read.

The estimate is ``mimotron.parallel.memory.estimate_memory``: weights, gradients,
optimizer state and activations of the modules on the rank. Two ratios per rank:

* ``memory_ratio`` = (peak - baseline) / estimate - the headline: what training adds
  to the process, against what the estimate claims training needs;
* ``memory_ratio_raw`` = peak / estimate - dominated by the runtime baseline for small
  models, so reported but not used.

The headline is the rank with the largest estimate (where memory runs out first); every
rank's ratios are in the JSON. To tell an estimate that is off from memory the estimate
does not model (data sets, allocator caching), one more run records the live *tensor*
bytes through one step with ``torch.profiler`` (``profile_memory``): weights and
optimizer state held before the step plus the step's peak of live allocations, over the
same estimate (``memory_ratio_tensors``).

Models: the default digits config in its shipped layout (``configs/digits.toml``); the
full run adds a wider one where the model, not the runtime, dominates.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import (
    TINY,
    CaseResult,
    Figure,
    Options,
    digits_raw,
    engine_stepper,
    interleave,
    make_config,
    precompute_steps,
    reset_peak_rss,
    rss_bytes,
    setup_run,
    summarize,
)
from mimotron.testing import run_ranks

MODELS = {
    "digits": [],
    "large": [
        "modules.vision.hidden_size=256",
        "modules.language.hidden_size=512",
        "modules.language.num_layers=4",
        "train.global_batch_size=32",
        "train.micro_batch_size=16",
    ],
}


def _rank(rank: int, world: int, overrides: list[str], num_steps: int) -> dict[str, Any]:
    from mimotron.data.tokenizer import CharTokenizer
    from mimotron.parallel.layout import plan_layout
    from mimotron.parallel.memory import estimate_memory

    cfg = make_config(digits_raw(), overrides)
    baseline = rss_bytes()["VmRSS"]
    reset = reset_peak_rss()
    run = setup_run(cfg)
    step = engine_stepper(run, precompute_steps(run, 2))
    for _ in range(num_steps):
        step()
    peak = rss_bytes()["VmHWM"]
    est = estimate_memory(cfg, plan_layout(cfg, world), CharTokenizer().vocab_size)[rank]
    parts = {
        k: sum(getattr(e, k) for e in est) for k in ("weights", "grads", "optimizer", "activations")
    }
    return {
        "baseline": baseline,
        "peak": peak,
        "peak_reset": reset,
        "estimate": sum(e.total for e in est),
        "estimate_parts": parts,
        "num_params": sum(e.num_params for e in est),
    }


def step_tensor_peak(step: Any) -> int | None:
    """Peak of live tensor bytes allocated during one ``step()`` (None if unavailable)."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    kineto = getattr(prof.profiler, "kineto_results", None)
    if kineto is None:
        return None
    events = sorted(
        (e for e in kineto.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:  # nbytes() is negative for frees
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop chatter on fd 2 (this rank only)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _tensor_rank(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from mimotron.data.tokenizer import CharTokenizer
    from mimotron.parallel.layout import plan_layout
    from mimotron.parallel.memory import estimate_memory

    cfg = make_config(digits_raw(), overrides)
    run = setup_run(cfg)
    step = engine_stepper(run, precompute_steps(run, 2))
    step()  # optimizer state exists from here on
    held = sum(p.numel() * p.element_size() for p in run.model.parameters())
    for group in run.optimizer.param_groups:
        for p in group["params"]:
            held += sum(
                t.numel() * t.element_size()
                for t in run.optimizer.module_infos[group["module"]].optimizer.state[p].values()
                if isinstance(t, torch.Tensor)
            )
    in_step = step_tensor_peak(step)
    est = estimate_memory(cfg, plan_layout(cfg, world), CharTokenizer().vocab_size)[rank]
    return {"held": held, "in_step_peak": in_step, "estimate": sum(e.total for e in est)}


def _measure(overrides: list[str], reps: int, num_steps: int) -> dict[str, Any]:
    """Fresh runs in the config's layout: every rank's figures per repetition."""
    from mimotron.parallel.layout import plan_layout

    world = plan_layout(make_config(digits_raw(), overrides)).world_size
    runs = interleave(
        reps, {"run": lambda: run_ranks(world, _rank, overrides, num_steps, timeout_s=300)}
    )["run"]
    ranks = []
    for r in range(world):
        mine = [ranks_of_rep[r] for ranks_of_rep in runs]
        ranks.append(
            {
                "ratio": summarize([(x["peak"] - x["baseline"]) / x["estimate"] for x in mine]),
                "ratio_raw": summarize([x["peak"] / x["estimate"] for x in mine]),
                "peak_bytes": summarize([float(x["peak"]) for x in mine]),
                "baseline_bytes": summarize([float(x["baseline"]) for x in mine]),
                "estimate_bytes": mine[0]["estimate"],
                "estimate_parts": mine[0]["estimate_parts"],
                "num_params": mine[0]["num_params"],
            }
        )
    return {
        "world_size": world,
        "ranks": ranks,
        "peak_reset": all(x["peak_reset"] for rep in runs for x in rep),
        "tensors": run_ranks(world, _tensor_rank, overrides, timeout_s=300),
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f} MiB"


def run_case(opts: Options) -> CaseResult:
    """``memory_ratio`` (target <= 1.3) for the default and a larger model.

    The headline rank is the one with the largest estimate (where memory runs out first);
    every rank's ratios are in the JSON and the worst one is named in a note.
    """
    models = (
        {"digits": TINY} if opts.tiny else ({"digits": MODELS["digits"]} if opts.quick else MODELS)
    )
    num_steps = 1 if opts.tiny else 3
    out = CaseResult("memory")
    for name, overrides in models.items():
        m = _measure(overrides, opts.reps, num_steps)
        suffix = "" if name == "digits" else f"_{name}"
        top = max(range(m["world_size"]), key=lambda i: m["ranks"][i]["estimate_bytes"])
        rk = m["ranks"][top]
        r, rr = rk["ratio"], rk["ratio_raw"]
        out.figures.append(
            Figure(
                f"memory_ratio{suffix}",
                r["median"],
                "<= 1.3",
                (r["min"], r["max"]),
                f"{name}, rank {top} of {m['world_size']}: peak {_mib(rk['peak_bytes']['median'])} "
                f"- baseline {_mib(rk['baseline_bytes']['median'])} vs estimate "
                f"{_mib(rk['estimate_bytes'])}",
            )
        )
        out.figures.append(
            Figure(
                f"memory_ratio_raw{suffix}",
                rr["median"],
                "",
                (rr["min"], rr["max"]),
                f"{name}, rank {top}: peak RSS / estimate",
            )
        )
        t = m["tensors"][top]
        if t["in_step_peak"] is not None:
            live = t["held"] + t["in_step_peak"]
            out.figures.append(
                Figure(
                    f"memory_ratio_tensors{suffix}",
                    live / t["estimate"],
                    "",
                    None,
                    f"{name}, rank {top}: live tensors {_mib(live)} (weights+optimizer "
                    f"{_mib(t['held'])}, step peak {_mib(t['in_step_peak'])}) vs estimate "
                    f"{_mib(t['estimate'])}",
                )
            )
        else:
            out.notes.append("torch.profiler gave no memory events: no tensor-level figure")
        worst = max(range(m["world_size"]), key=lambda i: m["ranks"][i]["ratio"]["median"])
        if worst != top:
            w = m["ranks"][worst]
            grew = w["peak_bytes"]["median"] - w["baseline_bytes"]["median"]
            out.notes.append(
                f"{name}: rank {worst} has the highest ratio, {w['ratio']['median']:.2f} "
                f"(peak - baseline {_mib(grew)} vs estimate {_mib(w['estimate_bytes'])}): "
                "small modules' ranks are dominated by what the estimate leaves out"
            )
        out.measurements[name] = {
            **m,
            "headline_rank": top,
            "overrides": overrides,
            "steps": num_steps,
        }
        if not m["peak_reset"]:
            out.notes.append(
                "/proc/self/clear_refs was not writable: peaks include the "
                "forking parent's high-water mark"
            )
    return out
