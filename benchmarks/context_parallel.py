"""Activation memory per rank with context parallelism vs without, measured and analytic.

``python benchmarks/context_parallel.py [--json OUT] [--model digits|wide]``

One training step of the digits model (vision | audio | language, non-colocated, one
micro-batch per step) with the language model on one rank, with language CP 2, and with
CP 2 x TP 2 with sequence parallelism. On every language rank the tensors autograd
saves for backward are counted as in ``benchmarks/sequence_parallel.py`` (each distinct
storage once, parameters excluded); the ratio of the busiest CP rank to the one-rank
run is printed next to the analytic ratio of ``mimotron plan``
(:func:`mimotron.estimate.memory.activation_bytes`).

Under CP the attention all-gathers keys and values (``[B, S, ...]`` on every rank) and
its scores are ``[S / c, S]``, so the measured saving is below ``1 / c`` where attention
dominates; the residual stream, norms and MLP scale with ``S / c`` exactly.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import parallel  # noqa: E402
from benchmarks.sequence_parallel import MODELS, ONE_MICRO_BATCH, saved_by_layout  # noqa: E402

ENCODERS = [*parallel("vision", rank_offset=0, data=1), *parallel("audio", rank_offset=1, data=1)]
# name: (language degrees, world size)
LAYOUTS: dict[str, tuple[list[str], int]] = {
    "one_rank": (parallel("language", rank_offset=2, data=1), 3),
    "cp2": (parallel("language", rank_offset=2, data=1, context=2), 4),
    "tp2": (parallel("language", rank_offset=2, data=1, tensor=2), 4),
    "cp2_tp2_sp": ([*parallel("language", rank_offset=2, data=1, context=2, tensor=2),
                    "modules.language.parallel.sequence_parallel=true"], 6),
}


def measure(model: list[str]) -> dict[str, Any]:
    """Saved bytes per language rank, analytic bytes, and ratios to the one-rank run."""
    out = saved_by_layout({name: ([*ENCODERS, *language, *ONE_MICRO_BATCH, *model], world)
                           for name, (language, world) in LAYOUTS.items()})
    for name in LAYOUTS:
        out[f"{name}_measured_ratio"] = max(out[name]) / max(out["one_rank"])
        out[f"{name}_analytic_ratio"] = out[f"{name}_analytic"] / out["one_rank_analytic"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="write the measurements here")
    p.add_argument("--model", choices=sorted(MODELS), action="append",
                   help="models to measure (default: all)")
    args = p.parse_args(argv)
    results = {name: measure(MODELS[name]) for name in (args.model or sorted(MODELS))}
    for model, r in results.items():
        print(f"{model}: saved activations per language rank (MiB), ratio to one rank "
              "measured / analytic")
        for name in LAYOUTS:
            print(f"  {name:<11} {[round(b / 2**20, 3) for b in r[name]]}  "
                  f"{r[f'{name}_measured_ratio']:.3f} / {r[f'{name}_analytic_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
