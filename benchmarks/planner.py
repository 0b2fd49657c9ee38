"""The planner's predicted step time against training's measured one, layout by layout.

On this machine, the demo model (``configs/digits.toml``: vision ViT, audio encoder,
language model) on 4 CPU ranks, over layouts the validator accepts (split blocks with
pipeline, tensor and data parallel variations, and colocated ones):

1. calibrate (:mod:`mimotron.planner.calibration`, cached in the output folder);
2. per layout, train it for ``--iters`` iterations with ``mimotron train`` (the
   launcher, a fresh run folder, ``train.overwrite=true``), discard the first ``--skip``
   iterations and take the median ``step_time_s`` of the rest from the run's
   ``metrics.jsonl``; repetitions (``--reps``) run the layouts in alternating order, so a
   slow spell of the machine hits them alike, and the figure is the median over every
   kept step of every repetition, with the spread of the repetitions' medians;
3. predict the same layout's step with the planner's model
   (:func:`mimotron.planner.cost.step_cost`, device ``cpu`` with the calibration; also
   without it, the device constants alone, for comparison);
4. print the table (layout, measured s/step, predicted s/step, ratio), the Spearman rank
   correlation of measured and predicted, and whether the planner's first choice among
   these layouts (and, when :mod:`mimotron.planner.search` is there, its first choice
   from the full search) is within 10% of the fastest measured step.

Targets: Spearman >= 0.8; the first choice within 10% of the fastest.

Usage::

    python benchmarks/planner.py                      # every layout, 2 repetitions
    python benchmarks/planner.py --iters 40 --reps 3 --json out.json
    python benchmarks/planner.py --layout split-lm-dp2 --layout colocated-dp4
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mimotron.config import MimoConfig, load_config  # noqa: E402
from mimotron.parallel.layout import check_layout  # noqa: E402
from mimotron.planner.calibration import calibrate_cached  # noqa: E402
from mimotron.planner.cost import Calibration, step_cost  # noqa: E402
from mimotron.planner.devices import device_table  # noqa: E402
from mimotron.training.metrics_file import read_metrics_file  # noqa: E402

CONFIG = ROOT / "configs" / "digits.toml"
WORLD = 4
TARGET_SPEARMAN = 0.8
TARGET_FIRST = 1.10


def _par(module: str, **kw: int) -> list[str]:
    return [f"modules.{module}.parallel.{k}={v}" for k, v in kw.items()]


def _split(vision: dict, audio: dict, language: dict) -> list[str]:
    """Disjoint blocks vision | audio | language, each with its degrees."""
    out, offset = [], 0
    for name, degrees in (("vision", vision), ("audio", audio), ("language", language)):
        degrees = {"data": 1, "tensor": 1, "pipeline": 1, **degrees}
        out += _par(name, rank_offset=offset, **degrees)
        offset += degrees["data"] * degrees["tensor"] * degrees["pipeline"]
    return out


def _colocated(vision: dict, audio: dict, language: dict) -> list[str]:
    """Every module on ranks 0-3, each with its degrees."""
    out = []
    for name, degrees in (("vision", vision), ("audio", audio), ("language", language)):
        out += _par(name, rank_offset=0, **{"data": 1, "tensor": 1, "pipeline": 1, **degrees})
    return out


LAYOUTS: dict[str, list[str]] = {
    # The config as shipped: vision rank 0, audio rank 1, language DP 2 on ranks 2-3.
    "split-lm-dp2": _split({}, {}, {"data": 2}),
    "split-lm-tp2": _split({}, {}, {"tensor": 2}),
    "split-lm-pp2": _split({}, {}, {"pipeline": 2}),
    "split-vision-dp2": _split({"data": 2}, {}, {}),
    "split-audio-dp2": _split({}, {"data": 2}, {}),
    "colocated-dp4": _colocated({"data": 4}, {"data": 4}, {"data": 4}),
    "colocated-lm-tp2": _colocated({"data": 4}, {"data": 4}, {"data": 2, "tensor": 2}),
    "colocated-lm-tp4": _colocated({"data": 4}, {"data": 4}, {"tensor": 4}),
    "colocated-tp2": _colocated({"data": 2, "tensor": 2}, {"data": 2, "tensor": 2},
                                {"data": 2, "tensor": 2}),
}


@dataclass
class Row:
    """One layout's figures."""

    name: str
    overrides: list[str]
    steps: list[list[float]] = field(default_factory=list)  # kept step times, per rep
    loads: list[float] = field(default_factory=list)  # 1-minute load average after each
    predicted: float = 0.0
    predicted_constants: float = 0.0
    bottleneck: str = ""

    @property
    def measured(self) -> float:
        """Median of every kept step of every repetition."""
        return statistics.median(t for rep in self.steps for t in rep)

    @property
    def rep_medians(self) -> list[float]:
        return [statistics.median(rep) for rep in self.steps]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def _base(args: argparse.Namespace) -> list[str]:
    """Overrides every run shares: short, no warm-up worth noting, one cheap evaluation."""
    return [f"train.iters={args.iters}", "log.interval=1", "scheduler.warmup_iters=2",
            f"eval.interval={args.iters}", "eval.iters=1", "checkpoint.interval=0",
            "train.overwrite=true"]


def train_once(row: Row, args: argparse.Namespace, out: Path, rep: int) -> list[float]:
    """Train ``row``'s layout once; the step times after the first ``--skip``."""
    log_dir = out / f"{row.name}-{rep}"
    cmd = [sys.executable, "-m", "mimotron", "train", str(CONFIG), *row.overrides,
           *_base(args), f"log.dir={log_dir}"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{row.name}: mimotron train exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")
    records = read_metrics_file(log_dir / "metrics.jsonl").records
    times = [r["step_time_s"] for r in records
             if "step_time_s" in r and r["iteration"] > args.skip]
    if len(times) < 3:
        raise RuntimeError(f"{row.name}: only {len(times)} step times after --skip")
    return times


def predict(row: Row, calibration: Calibration) -> None:
    """The planner's step for ``row``'s layout, with and without the calibration."""
    cfg = load_config(CONFIG, row.overrides)
    layout = check_layout(cfg)
    cpu = device_table()["cpu"]
    with_cal = step_cost(cfg, layout, cpu, calibration)
    row.predicted, row.bottleneck = with_cal.total, with_cal.bottleneck
    row.predicted_constants = step_cost(cfg, layout, cpu).total


def search_first_choice(calibration: Calibration) -> tuple[str, list[str]] | None:
    """The full search's first choice as ``(description, overrides)``; None without
    :mod:`mimotron.planner.search`."""
    try:
        from mimotron.planner.search import SearchRequest, search
    except ImportError:
        return None
    cpu = device_table()["cpu"]
    result = search(SearchRequest(str(CONFIG), [], WORLD, cpu, cpu.memory_bytes,
                                  calibration=calibration))
    if not result.candidates:
        return None
    best = result.candidates[0]
    where = "colocated" if best.colocated else "split"
    what = ", ".join(f"{m} {o.describe()}" for m, o in best.options.items())
    return f"{where} mbs {best.micro_batch}: {what}", best.overrides


def signature(overrides: list[str]) -> str:
    """What makes two override lists the same layout: every module's parallel settings
    and recompute, and the micro-batch size, as the config resolves them."""
    cfg = load_config(CONFIG, overrides)
    doc = {name: [dataclasses.asdict(m.parallel), m.recompute, m.recompute_num_layers]
           for name, m in cfg.modules.items()}
    return json.dumps([doc, cfg.train.micro_batch_size], sort_keys=True, default=str)


def _calibrate(out: Path) -> Calibration:
    cfg: MimoConfig = load_config(CONFIG, [f"log.dir={out / 'calibration'}"])
    start = time.perf_counter()
    calibration, reused = calibrate_cached(cfg, WORLD, log=lambda line: print(line, flush=True))
    print(f"calibration {'reused' if reused else 'measured'} in "
          f"{time.perf_counter() - start:.1f} s: {out / 'calibration'}", flush=True)
    for name, (f, b) in calibration.module_seconds.items():
        ff, fb = calibration.module_fixed_seconds.get(name, (0.0, 0.0))
        print(f"  {name:<9} forward {f * 1e3:7.2f} ms  backward {b * 1e3:7.2f} ms "
              f"(one micro-batch of {calibration.samples}; fixed part {ff * 1e3:.2f} / "
              f"{fb * 1e3:.2f} ms)")
    print(f"  host cores: {calibration.host_cores}")
    for kind, sizes in calibration.collectives.items():
        print("  " + f"{kind:<15}" + "  ".join(
            f"n={n}: {c.latency_s * 1e6:6.0f} us + {c.bytes_per_s / 1e9:5.2f} GB/s"
            for n, c in sorted(sizes.items())))
    return calibration


def report(rows: list[Row], search_row: Row | None) -> dict[str, Any]:
    """Print the table and the verdicts; return them for ``--json``."""
    print(f"\n{'layout':<20} {'measured s/step':>16} {'reps (min-max)':>16} "
          f"{'predicted':>10} {'ratio':>6} {'constants':>10}  bottleneck")
    for r in rows:
        meds = r.rep_medians
        print(f"{r.name:<20} {r.measured:>16.4f} {min(meds):>7.4f}-{max(meds):<8.4f} "
              f"{r.predicted:>10.4f} {r.predicted / r.measured:>6.2f} "
              f"{r.predicted_constants:>10.4f}  {r.bottleneck}")
    rho = spearman([r.measured for r in rows], [r.predicted for r in rows])
    rho_constants = spearman([r.measured for r in rows], [r.predicted_constants for r in rows])
    fastest = min(rows, key=lambda r: r.measured)
    first = min(rows, key=lambda r: r.predicted)
    print(f"\nSpearman(measured, predicted) = {rho:.3f} (target >= {TARGET_SPEARMAN}); "
          f"with the device constants alone: {rho_constants:.3f}")
    print(f"fastest measured: {fastest.name} {fastest.measured:.4f} s; planner's first "
          f"choice among these: {first.name} {first.measured:.4f} s = "
          f"{first.measured / fastest.measured:.3f} x the fastest (target <= {TARGET_FIRST})")
    doc: dict[str, Any] = {
        "rows": [{"layout": r.name, "overrides": r.overrides, "measured": r.measured,
                  "rep_medians": r.rep_medians, "steps": r.steps, "loads": r.loads,
                  "predicted": r.predicted,
                  "predicted_constants": r.predicted_constants, "bottleneck": r.bottleneck}
                 for r in rows],
        "spearman": rho, "spearman_constants": rho_constants, "fastest": fastest.name,
        "first_choice": first.name, "first_choice_ratio": first.measured / fastest.measured,
    }
    if search_row is not None:
        ratio = search_row.measured / fastest.measured
        print(f"full search's first choice ({search_row.name}): measured "
              f"{search_row.measured:.4f} s = {ratio:.3f} x the fastest above")
        doc["search_choice"] = {"layout": search_row.name, "overrides": search_row.overrides,
                                "measured": search_row.measured, "ratio": ratio}
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=30, help="iterations per run")
    parser.add_argument("--skip", type=int, default=8, help="first iterations discarded")
    parser.add_argument("--reps", type=int, default=2, help="runs per layout")
    parser.add_argument("--layout", action="append", choices=sorted(LAYOUTS),
                        help="measure only these (repeatable; default: all)")
    parser.add_argument("--out", help="folder for the runs (default: a temporary one)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(3600, exit=True)  # a hung run says where
    if args.skip >= args.iters - 2:
        parser.error(f"--skip={args.skip} leaves fewer than 3 of --iters={args.iters}")
    out = Path(args.out or tempfile.mkdtemp(prefix="mimotron-planner-bench-"))
    os.environ.pop("OMP_NUM_THREADS", None)  # the launcher's own choice, as a user gets
    calibration = _calibrate(out)
    rows = [Row(name, LAYOUTS[name]) for name in (args.layout or LAYOUTS)]
    choice = search_first_choice(calibration)
    search_row, measured = None, list(rows)
    if choice is not None:
        print(f"full search's first choice: {choice[0]}", flush=True)
        same = [r for r in rows if signature(r.overrides) == signature(choice[1])]
        search_row = same[0] if same else Row("search-first", choice[1])
        if not same:  # measured too, but outside the table's fixed set
            measured.append(search_row)
    for row in measured:
        predict(row, calibration)
    for rep in range(args.reps):
        for row in (measured if rep % 2 == 0 else measured[::-1]):
            start = time.perf_counter()
            row.steps.append(train_once(row, args, out, rep))
            row.loads.append(os.getloadavg()[0])  # other work on the host meanwhile
            print(f"rep {rep} {row.name:<20} median {statistics.median(row.steps[-1]):.4f} "
                  f"s/step ({time.perf_counter() - start:.0f} s, load average "
                  f"{row.loads[-1]:.1f})", flush=True)
    doc = report(rows, search_row)
    doc.update(command=" ".join(["python", "benchmarks/planner.py", *(argv or sys.argv[1:])]),
               iters=args.iters, skip=args.skip, reps=args.reps,
               calibration=json.loads(calibration.to_json()))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
