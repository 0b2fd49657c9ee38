"""Case 5 - memory: live tensor bytes per rank vs the analytic estimate of ``mimotron plan``.

The estimate (:func:`mimotron.estimate.memory.estimate_memory`) counts tensors: weights,
gradients, optimizer state, the activations of the micro-batches in flight, the
backward's workspace and the gradient-reduction bucket. The headline measures the same
thing, at the allocator (:mod:`benchmarks.tensor_memory`: the device allocator's
statistics on an accelerator, the profiler's allocation events on the CPU), one fresh
run per model in the config's layout, every rank:

* marks at each phase of every step (start, each module's forward, the end of
  forward-backward, gradient reduction, optimizer) give the live bytes there and the
  peak between marks; the last step (optimizer state exists) is the steady state;
* tensors held at the step's start that are none of weights, gradients and optimizer
  state (the data sets and the step's precomputed batches, RoPE tables; on the CPU also
  a finished collective's buffer freed on a gloo thread, which the profiler does not
  see) are not what the estimate models: they are measured, reported (``other_bytes``)
  and subtracted from every phase;
* ``memory_ratio_tensors`` = steady-state peak / estimate on the rank with the largest
  estimate (where memory runs out first), target 0.80-1.25; every rank's ratio and
  phases are in the JSON.

Peak RSS is reported beside it, without a target: each process first holds a runtime
baseline (interpreter, torch, gloo; measured after process-group initialisation and
before the model exists) that the estimate does not model, then the allocator's cached
frees and the data pipeline. ``rss_ratio_minus_baseline`` = (peak RSS - that baseline) /
estimate, ``rss_ratio_raw`` = peak RSS / estimate.

Models: the default digits config in its shipped layout (``configs/digits.toml``); the
full run adds a wider one where the model, not the runtime, dominates.
"""

from __future__ import annotations

from functools import partial
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
from benchmarks.tensor_memory import TensorMemoryMeter
from mimotron.forked_ranks import run_ranks

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
TARGET = "0.80-1.25"
PHASES = ("after_first_forward", "peak_forward_backward", "peak_grad_sync",
          "peak_optimizer", "after_optimizer")


def _estimate(cfg: Any, world: int, rank: int) -> dict[str, Any]:
    """This rank's estimate, summed over the modules it holds, with its terms."""
    from mimotron.config.vocab_size import padded_vocab_size
    from mimotron.data.tokenizer import CharTokenizer
    from mimotron.estimate.memory import estimate_memory
    from mimotron.parallel.layout import check_layout

    vocab = padded_vocab_size(CharTokenizer().vocab_size)
    est = estimate_memory(cfg, check_layout(cfg, world), vocab)[rank]
    keys = ("weights", "grads", "optimizer", "activations", "workspace", "reduce_bucket",
            "param_gather")
    return {"total": sum(e.total for e in est),
            "parts": {k: sum(getattr(e, k) for e in est) for k in keys},
            "modules": [e.module for e in est],
            "modalities": [cfg.modules[e.module].modality for e in est]}


def _rss_rank(rank: int, world: int, overrides: list[str], num_steps: int) -> dict[str, Any]:
    cfg = make_config(digits_raw(), overrides)
    baseline = rss_bytes()["VmRSS"]
    reset = reset_peak_rss()
    run = setup_run(cfg)
    step = engine_stepper(run, precompute_steps(run, 2))
    for _ in range(num_steps):
        step()
    return {"baseline": baseline, "peak": rss_bytes()["VmHWM"], "peak_reset": reset,
            "estimate": _estimate(cfg, world, rank)["total"]}


def held_bytes(run: Any) -> dict[str, int]:
    """Bytes of the weights, gradients and optimizer state this rank holds now."""
    params = list(run.model.parameters())
    state = [t for info in run.optimizer.module_infos.values() if info.optimizer is not None
             for entry in info.optimizer.state.values() for t in entry.values()
             if isinstance(t, torch.Tensor)]
    return {"weights": sum(_nbytes(p) for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(_nbytes(t) for t in state)}


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().nbytes()


class _MarkingTimers:
    """The run's timers, marking the meter at every start and stop (``<step>:<name>.start``)."""

    def __init__(self, inner: Any, meter: TensorMemoryMeter) -> None:
        self.inner, self.meter, self.step = inner, meter, 0

    def __call__(self, name: str) -> Any:
        timer, meter, label = self.inner(name), self.meter, f"{self.step}:{name}"

        class Marking:
            def start(self) -> None:
                meter.mark(f"{label}.start")
                timer.start()

            def stop(self, sync: bool = False) -> None:
                timer.stop(sync=sync)
                meter.mark(f"{label}.stop")

        return Marking()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)


def _instrument(run: Any, meter: TensorMemoryMeter) -> _MarkingTimers:
    """Marks at every timer and after every training forward of each module part."""
    from mimotron.training.step import module_parts

    timers = _MarkingTimers(run.global_state.timers, meter)
    run.global_state.timers = timers

    def after_forward(name: str, module: torch.nn.Module, args: Any, out: Any) -> None:
        if module.training:
            meter.mark(f"{timers.step}:forward:{name}")

    for name, part in module_parts(run.model).items():
        part.register_forward_hook(partial(after_forward, name))
    return timers


def phases(marks: list[Any], step: int, other: int) -> dict[str, int]:
    """Live bytes / peaks of one step's phases from its marks, ``other`` subtracted."""
    mine = [m for m in marks if m.label.startswith(f"{step}:")]

    def peak(first: str, last: str) -> int:
        labels = [m.label for m in mine]
        i, j = labels.index(f"{step}:{first}"), labels.index(f"{step}:{last}")
        return max(m.peak_since_previous for m in mine[i + 1 : j + 1])

    first_forward = next(m for m in mine if ":forward:" in m.label)
    out = {
        "after_first_forward": first_forward.live,
        "peak_forward_backward": peak("forward-backward.start", "forward-backward.stop"),
        "peak_grad_sync": peak("grad-sync.start", "grad-sync.stop"),
        "peak_optimizer": peak("optimizer.start", "optimizer.stop"),
        "after_optimizer": next(m.live for m in mine if m.label == f"{step}:optimizer.stop"),
    }
    out = {k: v - other for k, v in out.items()}
    out["peak"] = max(m.peak_since_previous for m in mine) - other
    return out


def modality_fraction(steps: list[Any]) -> dict[str, float]:
    """Fraction of this rank's samples carrying each modality (``has_<modality>`` flags).

    The estimate sizes an encoder's activations as if every sample carried its modality;
    the digits data mixes images and tones, so an encoder rank sees fewer.
    """
    flags: dict[str, list[float]] = {}
    for microbatches in steps:
        for mb in microbatches:
            for batch in mb.values():
                for key, value in batch.items():
                    if key.startswith("has_"):
                        flags.setdefault(key[4:], []).append(value.float().mean().item())
    return {k: sum(v) / len(v) for k, v in flags.items()}


def _tensor_rank(rank: int, world: int, overrides: list[str], num_steps: int) -> dict[str, Any]:
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo

    cfg = make_config(digits_raw(), overrides)
    runtime = init_runtime()
    with TensorMemoryMeter(runtime.device) as meter:
        run = setup_mimo(cfg, runtime)
        meter.mark("built")
        built = held_bytes(run)
        timers = _instrument(run, meter)
        steps = precompute_steps(run, 2)
        step = engine_stepper(run, steps)
        for k in range(num_steps):
            timers.step = k
            held = held_bytes(run)
            meter.mark(f"{k}:start")
            step()
    start = next(m.live for m in meter.marks if m.label == f"{num_steps - 1}:start")
    other = start - sum(held.values())
    return {
        "accounting": "accelerator allocator" if meter.on_accelerator else "cpu profiler",
        "built_bytes": next(m.live for m in meter.marks if m.label == "built"),
        "built_held": built,
        "held": held,
        "other_bytes": other,
        "phases": phases(meter.marks, num_steps - 1, other),
        "first_step_peak": phases(meter.marks, 0, other)["peak"],
        "estimate": _estimate(cfg, world, rank),
        "modality_fraction": modality_fraction(steps),
        "marks": [(m.label, m.live, m.peak_since_previous) for m in meter.marks],
    }


def _measure(overrides: list[str], reps: int, num_steps: int) -> dict[str, Any]:
    """Tensor-level phases (one run) and RSS (``reps`` fresh runs) of every rank."""
    from mimotron.parallel.layout import check_layout

    world = check_layout(make_config(digits_raw(), overrides)).world_size
    tensors = run_ranks(world, _tensor_rank, overrides, num_steps, timeout_s=300)
    runs = interleave(
        reps, {"run": lambda: run_ranks(world, _rss_rank, overrides, num_steps, timeout_s=300)}
    )["run"]
    ranks = []
    for r in range(world):
        mine = [ranks_of_rep[r] for ranks_of_rep in runs]
        t = tensors[r]
        ranks.append({
            **t,
            "ratio_tensors": t["phases"]["peak"] / t["estimate"]["total"],
            "rss_ratio_minus_baseline": summarize(
                [(x["peak"] - x["baseline"]) / x["estimate"] for x in mine]),
            "rss_ratio_raw": summarize([x["peak"] / x["estimate"] for x in mine]),
            "rss_peak_bytes": summarize([float(x["peak"]) for x in mine]),
            "rss_baseline_bytes": summarize([float(x["baseline"]) for x in mine]),
        })
    return {"world_size": world, "ranks": ranks,
            "peak_reset": all(x["peak_reset"] for rep in runs for x in rep)}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def _figures(name: str, m: dict[str, Any]) -> tuple[list[Figure], list[str]]:
    suffix = "" if name == "digits" else f"_{name}"
    top = max(range(m["world_size"]), key=lambda i: m["ranks"][i]["estimate"]["total"])
    rk = m["ranks"][top]
    ph, est = rk["phases"], rk["estimate"]
    held = rk["held"]["weights"] + rk["held"]["optimizer"]
    tensor = Figure(
        f"memory_ratio_tensors{suffix}", rk["ratio_tensors"], TARGET, None,
        f"{name}, rank {top} of {m['world_size']} ({rk['accounting']}): tensor peak "
        f"{_mib(ph['peak'])} (weights+optimizer {_mib(held)}, first forward "
        f"{_mib(ph['after_first_forward'])}) vs estimate {_mib(est['total'])}; "
        f"data and buffers outside the model ({_mib(rk['other_bytes'])}) excluded")
    r, rr = rk["rss_ratio_minus_baseline"], rk["rss_ratio_raw"]
    rss = Figure(
        f"rss_ratio_minus_baseline{suffix}", r["median"], "", (r["min"], r["max"]),
        f"{name}, rank {top}: peak RSS {_mib(rk['rss_peak_bytes']['median'])} - runtime "
        f"baseline {_mib(rk['rss_baseline_bytes']['median'])} (interpreter, torch, gloo) "
        f"vs estimate {_mib(est['total'])}")
    raw = Figure(f"rss_ratio_raw{suffix}", rr["median"], "", (rr["min"], rr["max"]),
                 f"{name}, rank {top}: peak RSS (runtime baseline included) / estimate")
    per_rank = ", ".join(_rank_note(i, x) for i, x in enumerate(m["ranks"]))
    return [tensor, rss, raw], [f"{name}: memory_ratio_tensors per rank: {per_rank}"]


def _rank_note(i: int, x: dict[str, Any]) -> str:
    """``rank 0 (vision) 0.89, 73% of samples carry it`` (the share only for an encoder)."""
    modules = x["estimate"]["modules"]
    carried = [x["modality_fraction"].get(m) for m in x["estimate"]["modalities"] if m]
    tail = "".join(f", {c:.0%} of samples carry its input" for c in carried if c is not None)
    return f"rank {i} ({'+'.join(modules)}) {x['ratio_tensors']:.2f}{tail}"


def run_case(opts: Options) -> CaseResult:
    """``memory_ratio_tensors`` (target 0.80-1.25) for the default and a larger model.

    The headline rank is the one with the largest estimate; every rank's phases and
    ratios are in the JSON and listed in a note.
    """
    models = (
        {"digits": TINY} if opts.tiny else ({"digits": MODELS["digits"]} if opts.quick else MODELS)
    )
    num_steps = 2
    out = CaseResult("memory")
    for name, overrides in models.items():
        m = _measure(overrides, opts.reps, num_steps)
        figures, notes = _figures(name, m)
        out.figures += figures
        out.notes += notes
        out.measurements[name] = {**m, "overrides": overrides, "steps": num_steps}
        if not m["peak_reset"]:
            out.notes.append(
                "/proc/self/clear_refs was not writable: RSS peaks include the "
                "forking parent's high-water mark"
            )
    return out
