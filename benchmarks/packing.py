"""Sequence packing vs padding: real (non-padding) tokens per second on the demo data.

``python benchmarks/packing.py [--iters N] [--reps R] [--seq-length S]``

Both sides train the demo config (``configs/digits.toml``, every module on one rank, one
thread) through ``run_training`` — what ``mimotron train`` runs — for ``--iters``
iterations; A has ``data.packing = true``, B pads every sample to ``data.seq_length``.
The figures are the runs' own metrics (``real_tokens_per_second``, ``padding_fraction``
of the last record), medians over ``--reps`` interleaved repetitions. Data building is
inside the step time on both sides (packing reads more samples per step).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mimotron.config import load_config  # noqa: E402
from mimotron.forked_ranks import run_ranks  # noqa: E402
from mimotron.runtime import init_runtime  # noqa: E402
from mimotron.training.loop import run_training  # noqa: E402

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
ONE_RANK = [f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
            for k, v in (("data", 1), ("rank_offset", 0))]


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """One run; returns the last metrics record (real tokens/s, padding fraction)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(DIGITS, [*ONE_RANK, *overrides, f"log.dir='{tmp}'",
                                   "eval.interval=1000000", "checkpoint.interval=0",
                                   'checkpoint.load="none"', "log.progress=false",
                                   "log.tensorboard=false"])
        run_training(cfg, init_runtime())
        lines = next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()
    records = [json.loads(x) for x in lines]
    train = [r for r in records if "real_tokens_per_second" in r]
    return train[-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seq-length", type=int, default=64)
    args = p.parse_args(argv)
    common = [f"train.iters={args.iters}", f"log.interval={max(args.iters // 2, 1)}",
              "scheduler.warmup_iters=1",
              f"data.seq_length={args.seq_length}"]
    sides = {"packing": ["data.packing=true"], "padding": []}
    got: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for _ in range(args.reps):
        for name, extra in sides.items():
            got[name].append(run_ranks(1, _train, [*common, *extra], timeout_s=1800)[0])
    table = {}
    for name, recs in got.items():
        table[name] = {
            "real_tokens_per_second": statistics.median(r["real_tokens_per_second"]
                                                        for r in recs),
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in recs),
            "samples_per_second_rows": statistics.median(r["samples_per_second"] for r in recs),
            "padding_fraction": statistics.median(r["padding_fraction"] for r in recs),
            "step_time_s": statistics.median(r["step_time_s"] for r in recs),
        }
    table["speedup_real_tokens"] = (table["packing"]["real_tokens_per_second"]
                                    / table["padding"]["real_tokens_per_second"])
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
