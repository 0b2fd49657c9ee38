"""A prepared GPU check, one command: ``python benchmarks/gpu_check.py --json out.json``.

Three parts, each run through ``mimotron train`` (the public entry point; one
subprocess per run, its ``metrics.jsonl`` read back), each ending ``ok``, ``failed`` or
``skipped: <why>``:

1. **throughput** (one GPU): ``configs/gpu_llava_1b.toml`` (ViT + projector + decoder
   LM, ~1.01B parameters by ``mimotron plan``'s count, bf16) for ``--steps`` steps:
   tokens/s, model TFLOP/s and MFU (FLOPs from :mod:`mimotron.estimate.flops`, the peak
   from ``--peak-tflops`` or a small table keyed by the device name), and the peak
   allocated memory against ``mimotron plan``'s estimate for the same config.
2. **cpu_vs_gpu**: ``--compare-iters`` iterations of a reduced variant of that config
   (same seed, bf16) on the GPU and on the CPU (``MIMOTRON_DEVICE=cpu``); the losses
   must agree within ``--loss-rtol`` (bf16 rounding differs between the devices'
   kernels).
3. **layouts** (>= 2 GPUs, NCCL): the split-layout demo and a pipeline-parallel (PP 2)
   layout for ``--layout-iters`` iterations each, launched by ``mimotron train`` (its
   own launcher, one rank per GPU), each under a timeout so a hang is reported as one.
   With >= 4 GPUs: ``configs/digits.toml`` as is (vision | audio | language DP 2) and
   with the language model at PP 2; with 2-3 GPUs the 2-rank variants (vision |
   language; the language model alone at PP 2).

``--cpu-smoke`` runs the same code paths on the CPU at a tiny size for a few steps (the
GPU parts then say why they were skipped); ``--cpu-layouts`` also runs part 3 on the
CPU (gloo). A Markdown summary goes to stdout, everything to ``--json``. Exit status 1
when a part failed, else 0 (skipped parts included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, digits_raw  # noqa: E402

CONFIG_1B = REPO / "configs" / "gpu_llava_1b.toml"
DIGITS = REPO / "configs" / "digits.toml"

# Dense bf16 peak TFLOP/s per device (vendor datasheets); the first key found in
# torch's device name wins, so the more specific names come first.
PEAK_TFLOPS_BF16 = {"H100 PCIe": 756.0, "H200": 989.0, "H100": 989.0, "A100": 312.0,
                    "L40S": 362.0}

# What the timed runs leave out: periodic evaluation (one one-step evaluation remains at
# the end), checkpoints, TensorBoard and the console lines.
QUIET = ["eval.interval=1000000", "eval.iters=1", "checkpoint.interval=0",
         'checkpoint.load="none"', "log.tensorboard=false", "log.progress=false"]

# The reduced variant of configs/gpu_llava_1b.toml (same kinds, seed, precision and
# optimizer), small enough for a CPU: the CPU-vs-GPU comparison and --cpu-smoke.
REDUCED = ["modules.vision.hidden_size=64", "modules.vision.num_layers=2",
           "modules.vision.num_heads=4", "modules.vision.image_size=56",
           "modules.language.hidden_size=128", "modules.language.num_layers=2",
           "modules.language.num_heads=4", "data.seq_length=48",
           "train.global_batch_size=8", "train.micro_batch_size=4"]

# Small digits model for the layouts on the CPU (--cpu-layouts): seconds, not minutes.
SMALL_DIGITS = ["modules.vision.hidden_size=16", "modules.vision.num_layers=1",
                "modules.audio.hidden_size=16", "modules.language.hidden_size=32",
                "train.global_batch_size=16", "train.micro_batch_size=4"]

ONE_BILLION = 1e9
PARAM_TOLERANCE = 0.1  # "about 1B": within 10%

# Runs done in this process, by (config, sorted overrides, on the CPU).
_RUNS: dict[tuple[str, tuple[str, ...], bool], dict[str, Any]] = {}


def gpu_info() -> dict[str, Any]:
    """The one place this script asks torch.cuda: how many GPUs there are, and which.

    ``MIMOTRON_DEVICE=cpu`` hides them, as it does from mimotron itself.
    """
    import torch

    if os.environ.get("MIMOTRON_DEVICE") == "cpu" or not torch.cuda.is_available():
        return {"count": 0, "name": None}
    return {"count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0)}


def peak_tflops(device_name: str | None, override: float | None) -> float | None:
    """Dense bf16 peak TFLOP/s for MFU: ``--peak-tflops``, else the table, else None."""
    if override:
        return override
    for key, value in PEAK_TFLOPS_BF16.items():
        if device_name and key in device_name:
            return value
    return None


# ---- running mimotron train ------------------------------------------------------------


def train(config: Path, overrides: list[str], log_dir: Path, timeout_s: float,
          cpu: bool) -> dict[str, Any]:
    """Run ``mimotron train`` once; its per-iteration records and how it ended.

    The command runs in a session of its own so that a timeout (a hang) kills the
    launcher and every rank it started, and nothing else.
    """
    key = (str(config), tuple(sorted(overrides)), cpu)
    if key in _RUNS:  # The same command twice (--cpu-smoke): deterministic, run once.
        return {**_RUNS[key], "reused": True}
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "mimotron", "train", str(config), *QUIET, *overrides,
            f"log.dir={json.dumps(str(log_dir))}"]
    env = dict(os.environ)
    if cpu:
        env["MIMOTRON_DEVICE"] = "cpu"
    out_path = log_dir / "console.txt"
    start = time.monotonic()
    with out_path.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    tail = out_path.read_text(errors="replace")[-3000:]
    if rc != 0:  # Shown at once: the operator of a one-off GPU session needs it now.
        print(f"[gpu_check] {' '.join(argv)}\n{tail}", file=sys.stderr, flush=True)
    _RUNS[key] = {"command": " ".join(argv), "device": "cpu" if cpu else "gpu",
                  "returncode": rc, "timed_out": rc is None,
                  "wall_s": time.monotonic() - start,
                  "records": train_records(log_dir / "metrics.jsonl"), "console_tail": tail}
    return _RUNS[key]


def train_records(path: Path) -> list[dict[str, Any]]:
    """The train records of a ``metrics.jsonl`` (eval records left out), by iteration."""
    if not path.is_file():
        return []
    by_iter: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_iter[record["iteration"]] = record
    return [by_iter[i] for i in sorted(by_iter)]


def run_failure(run: dict[str, Any], iters: int) -> str | None:
    """Why a run does not count (timeout, exit status, missing iterations), or None."""
    if run["timed_out"]:
        return f"timed out after {run['wall_s']:.0f} s (a hang?); console tail in the JSON"
    if run["returncode"] != 0:
        return f"exit status {run['returncode']}; console tail in the JSON"
    if not run["records"] or run["records"][-1]["iteration"] != iters:
        return f"metrics.jsonl does not reach iteration {iters}"
    return None


def losses(run: dict[str, Any]) -> list[float]:
    """The loss of each logged iteration (log.interval=1: every iteration)."""
    return [r["loss_last"] for r in run["records"]]


# ---- part 1: throughput, MFU, memory ---------------------------------------------------


def plan_numbers(config: Path, overrides: list[str]) -> dict[str, Any]:
    """What ``mimotron plan`` prints for rank 0: parameters per module, memory estimate."""
    from mimotron.config import load_config
    from mimotron.config.vocab_size import padded_vocab_size
    from mimotron.data.run_data import check_data
    from mimotron.estimate.memory import estimate_memory, stage_parameter_counts
    from mimotron.parallel.layout import check_layout

    cfg = load_config(config, [*QUIET, *overrides])
    vocab = padded_vocab_size(check_data(cfg).vocab_size)
    params = {name: sum(stage_parameter_counts(cfg, name, vocab)) for name in cfg.modules}
    estimate = estimate_memory(cfg, check_layout(cfg), vocab)[0]
    return {"params": params, "total_params": sum(params.values()),
            "estimate_bytes": sum(e.total for e in estimate),
            "estimate_bytes_per_module": {e.module: e.total for e in estimate},
            "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_length}


def steady_state(records: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the logged intervals, the first left out (warm-up: kernel choice,
    allocator growth, lazy optimizer state)."""
    steady = records[1:] or records
    step = statistics.median(r["step_time_s"] for r in steady)
    flops = statistics.median(r["model_flops_per_iteration"] for r in steady)
    return {"step_time_s": step, "tokens_per_second": statistics.median(
                r["tokens_per_second"] for r in steady),
            "model_flops_per_iteration": flops, "tflops_per_second": flops / step / 1e12,
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
            # mimotron's own MFU (its device table, mimotron.runtime), as a cross-check.
            "library_mfu": records[-1].get("mfu"),
            "intervals": len(steady)}


def throughput_part(args: argparse.Namespace, gpu: dict[str, Any], work: Path
                    ) -> dict[str, Any]:
    """Part 1: train the ~1B config on one GPU (or the reduced one, CPU smoke)."""
    if not args.cpu_smoke and gpu["count"] < 1:
        return {"status": "skipped: no GPU"}
    overrides = [*(REDUCED if args.cpu_smoke else []), f"train.iters={args.steps}",
                 f"scheduler.warmup_iters={max(1, args.steps // 10)}",
                 f"log.interval={max(1, args.steps // 12)}"]
    plan = plan_numbers(args.config, overrides)
    out: dict[str, Any] = {"config": str(args.config), "overrides": overrides, "plan": plan,
                           "device": "cpu" if args.cpu_smoke else gpu["name"]}
    if not args.cpu_smoke:  # The reduced smoke model is far from 1B by design.
        ratio = plan["total_params"] / ONE_BILLION
        out["params_about_1b"] = abs(ratio - 1) <= PARAM_TOLERANCE
    run = train(args.config, overrides, work / "throughput", args.timeout, args.cpu_smoke)
    out["run"] = run
    failure = run_failure(run, args.steps)
    if failure:
        return {**out, "status": "failed", "reason": failure}
    stats = steady_state(run["records"])
    peak = peak_tflops(None if args.cpu_smoke else gpu["name"], args.peak_tflops)
    stats["peak_tflops"] = peak
    stats["mfu"] = None if peak is None else stats["tflops_per_second"] / peak
    # On a GPU the peak is torch's max_memory_allocated; on the CPU it is the max RSS
    # (the runtime included), so the ratio is only meaningful on a GPU.
    stats["memory_ratio"] = stats["peak_memory_bytes"] / plan["estimate_bytes"]
    stats["losses_first_last"] = [losses(run)[0], losses(run)[-1]]
    out["measured"] = stats
    ok = out.get("params_about_1b", True) and all(map(math.isfinite, losses(run)))
    return {**out, "status": "ok" if ok else "failed",
            **({} if ok else {"reason": "parameter count not about 1B or a non-finite loss"})}


# ---- part 2: the same iterations on the GPU and on the CPU -----------------------------


def compare_losses(device: list[float], cpu: list[float], rtol: float) -> dict[str, Any]:
    """Per-iteration relative difference of two loss curves; ok within ``rtol``."""
    if len(device) != len(cpu) or not cpu:
        return {"ok": False, "max_rel_diff": None,
                "reason": f"{len(device)} vs {len(cpu)} iterations logged"}
    diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(device, cpu, strict=True)]
    finite = all(math.isfinite(x) for x in device + cpu)
    return {"ok": finite and max(diffs) <= rtol, "max_rel_diff": max(diffs),
            "rel_diffs": diffs, "rtol": rtol}


def compare_part(args: argparse.Namespace, gpu: dict[str, Any], work: Path
                 ) -> dict[str, Any]:
    """Part 2: ``--compare-iters`` iterations of the reduced config on GPU and CPU."""
    iters = args.compare_iters
    overrides = [*REDUCED, f"train.iters={iters}", "scheduler.warmup_iters=1", "log.interval=1"]
    out: dict[str, Any] = {"config": str(args.config), "overrides": overrides}

    def side(name: str) -> str | None:
        """Train one side into ``out``; its failure, if any."""
        run = train(args.config, overrides, work / f"compare_{name}", args.timeout,
                    cpu=name == "cpu")
        out[name] = run
        failure = run_failure(run, iters)
        if failure is None:
            out[f"{name}_losses"] = losses(run)
        return failure

    failure = side("cpu")
    if failure:
        return {**out, "status": "failed", "reason": f"CPU run: {failure}"}
    if args.cpu_smoke or gpu["count"] < 1:
        why = "no GPU" if gpu["count"] < 1 else "--cpu-smoke (CPU only)"
        return {**out, "status": f"skipped: {why}"}  # The CPU side ran: it cannot rot.
    failure = side("gpu")
    if failure:
        return {**out, "status": "failed", "reason": f"GPU run: {failure}"}
    out["comparison"] = compare_losses(out["gpu_losses"], out["cpu_losses"], args.loss_rtol)
    ok = out["comparison"]["ok"]
    return {**out, "status": "ok" if ok else "failed",
            **({} if ok else {"reason": f"losses differ beyond rtol {args.loss_rtol}"})}


# ---- part 3: multi-rank layouts under NCCL -----------------------------------------------


def write_toml(raw: dict[str, Any], path: Path) -> Path:
    """Write a nested dict of tables, scalars and lists as TOML (JSON scalars are TOML)."""
    lines: list[str] = []

    def table(node: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if prefix and scalars:
            lines.append(f"[{prefix}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in scalars.items())
        for k, v in node.items():
            if isinstance(v, dict):
                table(v, f"{prefix}.{k}" if prefix else k)

    table(raw, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def layout_cases(num_ranks: int, work: Path) -> dict[str, tuple[Path, list[str], int]]:
    """Name -> (config file, overrides, ranks): the split layout and a PP 2 layout.

    One rank per GPU (NCCL refuses two ranks on one device): with 4 ranks the demo as
    is and with its language model at PP 2; with 2-3 ranks, 2-rank variants of both.
    """
    pp2 = ["modules.language.parallel.data=1", "modules.language.parallel.pipeline=2"]
    work.mkdir(parents=True, exist_ok=True)
    if num_ranks >= 4:
        return {"split_digits_4ranks": (DIGITS, [], 4),
                "pp2_digits_4ranks": (DIGITS, pp2, 4)}
    raw = digits_raw()
    lang = raw["modules"]["language"]
    lang["parallel"] = {"data": 1, "rank_offset": 1}
    split = {**raw, "modules": {"vision": raw["modules"]["vision"], "language": lang}}
    alone = {**raw, "modules": {"language": {**lang, "parallel": {
        "data": 1, "pipeline": 2, "rank_offset": 0}}}}
    return {"split_vision_language_2ranks": (write_toml(split, work / "split2.toml"), [], 2),
            "pp2_language_2ranks": (write_toml(alone, work / "pp2.toml"), [], 2)}


def layouts_part(args: argparse.Namespace, gpu: dict[str, Any], work: Path
                 ) -> dict[str, Any]:
    """Part 3: each layout for ``--layout-iters`` iterations, under ``--layout-timeout``."""
    on_cpu = args.cpu_layouts
    if not on_cpu and (args.cpu_smoke or gpu["count"] < 2):
        why = ("--cpu-smoke (CPU only; --cpu-layouts runs them on gloo)" if args.cpu_smoke
               and gpu["count"] >= 2 else f"needs >= 2 GPUs, found {gpu['count']}")
        return {"status": f"skipped: {'no GPU' if gpu['count'] == 0 else why}"}
    iters = args.layout_iters
    common = [f"train.iters={iters}", "scheduler.warmup_iters=1", "log.interval=1",
              *(SMALL_DIGITS if on_cpu else [])]
    out: dict[str, Any] = {"backend": "gloo" if on_cpu else "nccl", "cases": {}}
    ranks = 4 if on_cpu else gpu["count"]
    for name, (config, extra, world) in layout_cases(ranks, work).items():
        run = train(config, [*common, *extra], work / name, args.layout_timeout, on_cpu)
        failure = run_failure(run, iters)
        out["cases"][name] = {"ranks": world, "finished": failure is None,
                              "losses": losses(run), "wall_s": run["wall_s"],
                              "timed_out": run["timed_out"], "reason": failure, "run": run}
    failed = [n for n, c in out["cases"].items() if not c["finished"]]
    return {**out, "status": "failed" if failed else "ok",
            **({"reason": f"did not finish: {', '.join(failed)}"} if failed else {})}


# ---- report ------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".4g", scale: float = 1.0) -> str:
    """``value * scale`` formatted, or ``n/a`` when it is not known."""
    return "n/a" if value is None else format(value * scale, spec)


def markdown(doc: dict[str, Any]) -> str:
    """The human summary: one table per part, statuses first."""
    lines = [f"## GPU check ({doc['mode']}, {doc['date']})", "",
             f"GPUs: {doc['gpu']['count']} ({doc['gpu']['name'] or 'none'}); torch "
             f"{doc['torch']}", "", "| part | status |", "|---|---|"]
    lines += [f"| {n} | {p['status']}{' - ' + p['reason'] if 'reason' in p else ''} |"
              for n, p in doc["parts"].items()]
    thr = doc["parts"]["throughput"]
    if "measured" in thr:
        m, plan = thr["measured"], thr["plan"]
        lines += ["", f"**throughput** on {thr['device']}: {plan['total_params']:,} parameters "
                  f"(plan: {plan['params']})", "", "| figure | value |", "|---|---|",
                  f"| tokens/s | {_fmt(m['tokens_per_second'], '.0f')} |",
                  f"| step time | {_fmt(m['step_time_s'], '.3f')} s |",
                  f"| model TFLOP/s | {_fmt(m['tflops_per_second'], '.2f')} |",
                  f"| MFU (peak {_fmt(m['peak_tflops'], '.0f')} TFLOP/s) | "
                  f"{_fmt(m['mfu'], '.1%')} |",
                  f"| peak memory{' (CPU: max RSS)' if thr['device'] == 'cpu' else ''} | "
                  f"{_fmt(m['peak_memory_bytes'], '.2f', 2**-30)} GiB |",
                  f"| plan estimate | {_fmt(plan['estimate_bytes'], '.2f', 2**-30)} GiB |",
                  f"| measured / estimate | {_fmt(m['memory_ratio'], '.2f')} |"]
    cmp_ = doc["parts"]["cpu_vs_gpu"]
    if "cpu_losses" in cmp_:
        lines += ["", "**cpu_vs_gpu** losses per iteration: CPU "
                  f"{[round(x, 4) for x in cmp_['cpu_losses']]}"
                  + (f", GPU {[round(x, 4) for x in cmp_['gpu_losses']]}, max relative "
                     f"difference {_fmt(cmp_['comparison']['max_rel_diff'], '.2e')}"
                     if "comparison" in cmp_ else "")]
    for name, case in doc["parts"]["layouts"].get("cases", {}).items():
        ended = "finished" if case["finished"] else "DID NOT FINISH"
        lines.append(f"- layout `{name}` ({case['ranks']} ranks, "
                     f"{doc['parts']['layouts']['backend']}): {ended} in "
                     f"{case['wall_s']:.0f} s, losses {[round(x, 4) for x in case['losses']]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; ``--cpu-smoke`` shrinks steps and iterations to seconds."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="write every figure and run here")
    p.add_argument("--config", type=Path, default=CONFIG_1B, help="the one-GPU config")
    p.add_argument("--steps", type=int, default=300, help="steps of the throughput run")
    p.add_argument("--compare-iters", type=int, default=5, help="iterations, GPU vs CPU")
    p.add_argument("--loss-rtol", type=float, default=0.02,
                   help="largest relative loss difference GPU vs CPU (bf16 rounding)")
    p.add_argument("--layout-iters", type=int, default=5, help="iterations per layout")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="device peak TFLOP/s for MFU (default: table by device name)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run")
    p.add_argument("--layout-timeout", type=float, default=300.0,
                   help="seconds per layout run; longer is reported as a hang")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the runs write (default: a temporary directory, removed)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU only, reduced model, a few steps: checks the script runs")
    p.add_argument("--cpu-layouts", action="store_true",
                   help="run the multi-rank layouts on the CPU (gloo), small model")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.steps, args.compare_iters, args.layout_iters = 3, 3, 2
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the three parts, print the summary, write the JSON; 1 if a part failed."""
    import torch

    args = parse_args(argv)
    if args.cpu_smoke:  # The runs inherit it: a tiny model gains nothing from threads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    gpu = gpu_info()
    doc: dict[str, Any] = {
        "command": " ".join(["python benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu", "gpu": gpu,
        "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "date": datetime.date.today().isoformat(), "parts": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = args.work_dir or Path(tmp)
        for name, part in (("throughput", throughput_part), ("cpu_vs_gpu", compare_part),
                           ("layouts", layouts_part)):
            print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
            doc["parts"][name] = part(args, gpu, work / name)
            print(f"[gpu_check] {name}: {doc['parts'][name]['status']}", file=sys.stderr,
                  flush=True)
    print(markdown(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 1 if any(p["status"] == "failed" for p in doc["parts"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
