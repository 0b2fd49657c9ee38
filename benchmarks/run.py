"""Run the mimotron benchmarks and print a table: ``python benchmarks/run.py [--quick]``.

Cases (each measures two sides A/B interleaved, >= 5 repetitions, medians and min-max):

* ``overhead``   mimotron's step vs a hand-written PyTorch loop (world size 1)
* ``pipeline``   encoder rank + language rank vs one rank, m = 4 and 8 micro-batches
* ``pipeline_vs_torch`` our 1F1B vs torch.distributed.pipelining Schedule1F1B, same split
* ``stage_link`` language model at PP 2: stage-link shape headers and step time, with vs
                 without the header-free link and receives posted ahead
* ``bridge``     bytes the communicator sends vs the analytic minimum; its bandwidth vs
                 raw gloo send/recv of the same tensors
* ``checkpoint`` DCP save vs ``torch.save`` of the same tensors; async blocking time
* ``memory``     live tensor peak per rank and phase vs ``mimotron plan``'s estimate;
                 peak RSS beside it (runtime baseline named)
* ``experts``    bytes the expert-parallel token exchange sends vs the analytic minimum
* ``overlap``    DP 2 step time with vs without overlapped gradient reduction, plain
                 and ZeRO-1 (reduce-scatter in the backward, parameter gather overlapped)
* ``encoder_batching`` colocated step time with encoder batching off vs on (one rank)
* ``balance``    skewed images on 4 ranks: vision work and language tokens per DP replica
                 (max/mean) and step time, dealt by position vs by cost
* ``frozen_ahead`` a frozen vision encoder's step time in 1F1B vs running ahead (2 ranks)

``--json OUT`` writes every figure and raw measurement, ``--markdown OUT`` the README's
*Performance* section; ``--case NAME`` (repeatable) selects cases and ``--size tiny``
shrinks every model to seconds (the smoke test).
Exit status 0 even when a figure misses its target: this measures, it does not gate.
"""

from __future__ import annotations

import os

# One thread per rank, set before torch is imported (forked ranks inherit it).
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import (  # noqa: E402
    balance,
    bridge,
    checkpoint,
    encoder_batching,
    experts,
    frozen_ahead,
    memory,
    overhead,
    overlap,
    pipeline,
    pipeline_vs_torch,
    stage_link,
)
from benchmarks.common import SIZES, CaseResult, Options, machine_info, warm_imports  # noqa: E402

CASES: dict[str, Callable[[Options], CaseResult]] = {
    "overhead": overhead.run_case,
    "pipeline": pipeline.run_case,
    "pipeline_vs_torch": pipeline_vs_torch.run_case,
    "stage_link": stage_link.run_case,
    "bridge": bridge.run_case,
    "checkpoint": checkpoint.run_case,
    "memory": memory.run_case,
    "experts": experts.run_case,
    "overlap": overlap.run_case,
    "encoder_batching": encoder_batching.run_case,
    "balance": balance.run_case,
    "frozen_ahead": frozen_ahead.run_case,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer steps per repetition and smaller stand-ins (< 3 min)",
    )
    p.add_argument("--json", metavar="OUT", help="write every figure and measurement here")
    p.add_argument(
        "--markdown",
        metavar="OUT",
        help="write the README's Performance section (table + command) here",
    )
    p.add_argument(
        "--case",
        action="append",
        choices=sorted(CASES),
        metavar="NAME",
        help=f"run only this case (repeatable): {', '.join(CASES)}",
    )
    p.add_argument(
        "--size",
        choices=SIZES,
        default="default",
        help="model sizes: default, or tiny for a seconds-long smoke run",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help="A/B repetitions per case (>= 5; default 5 with --quick, else 7)",
    )
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 5 if args.quick else 7
    if args.reps < 5:
        p.error(f"--reps={args.reps} is invalid: expected an integer >= 5")
    return args


def format_table(results: list[CaseResult]) -> str:
    """A Markdown table: case, figure, value [min-max], target, status, what was compared."""
    lines = [
        "| case | figure | value [min-max] | target | status | measured |",
        "|---|---|---|---|---|---|",
    ]
    for res in results:
        for f in res.figures:
            spread = "" if f.spread is None else f" [{f.spread[0]:.2f}-{f.spread[1]:.2f}]"
            status = {None: "-", True: "ok", False: "MISS"}[f.passed]
            lines.append(
                f"| {res.name} | `{f.name}` | {f.value:.2f}{spread} | "
                f"{f.target or '-'} | {status} | {f.detail} |"
            )
    return "\n".join(lines)


def format_readme(table: str, command: str, machine: dict[str, Any], notes: list[str]) -> str:
    """The README's *Performance* section: how to reproduce, where, and the table."""
    where = (
        f"torch {machine['torch']}, {machine['cpu_count']} CPU cores, one thread per "
        f"rank, gloo over loopback"
    )
    lines = [
        "## Performance",
        "",
        "Measured by the benchmark suite (A/B interleaved repetitions; medians with the",
        "min-max over repetitions in brackets; every raw number in the JSON):",
        "",
        "```bash",
        command,
        "```",
        "",
        f"On {where}:",
        "",
        table,
    ]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    opts = Options(quick=args.quick, size=args.size, reps=args.reps)
    names = args.case or list(CASES)
    warm_imports()
    start = time.monotonic()
    results: list[CaseResult] = []
    timings: dict[str, float] = {}
    load: dict[str, list[float]] = {}
    for name in names:
        t0, load_before = time.monotonic(), os.getloadavg()[0]
        print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
        results.append(CASES[name](opts))
        timings[name] = time.monotonic() - t0
        # Recorded for the JSON: the 1-minute load lags and includes our own ranks.
        load[name] = [load_before, os.getloadavg()[0]]
        print(
            f"[benchmarks] {name} done in {timings[name]:.1f} s (load average "
            f"{load[name][0]:.1f} -> {load[name][1]:.1f})",
            file=sys.stderr,
            flush=True,
        )
    table = format_table(results)
    notes = [f"{res.name}: {note}" for res in results for note in res.notes]
    if load and next(iter(load.values()))[0] > 0.5 * (os.cpu_count() or 1):
        # Only the load before the first case is others' alone (later ones include ours).
        notes.append(
            f"other processes were running (1-minute load average "
            f"{next(iter(load.values()))[0]:.1f} on {os.cpu_count()} cores before "
            "the first case): timing figures may be skewed"
        )
    print(table)
    for note in notes:
        print(f"note: {note}")
    command = " ".join(["python benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    if args.markdown:
        # What to type to get these figures again (output paths left out).
        again = (
            ["python benchmarks/run.py"]
            + (["--quick"] if opts.quick else [])
            + [f"--case {n}" for n in args.case or []]
            + ([f"--size {opts.size}"] if opts.tiny else [])
            + ([f"--reps {opts.reps}"] if opts.reps != (5 if opts.quick else 7) else [])
        )
        Path(args.markdown).write_text(format_readme(table, " ".join(again), machine_info(), notes))
    if args.json:
        doc = {
            "command": command,
            "options": {"quick": opts.quick, "size": opts.size, "reps": opts.reps},
            "machine": machine_info(),
            "wall_s": time.monotonic() - start,
            "case_wall_s": timings,
            "load_avg_1m_before_after": load,
            "figures": {f.name: f.value for r in results for f in r.figures},
            "cases": {r.name: r.to_json() for r in results},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
