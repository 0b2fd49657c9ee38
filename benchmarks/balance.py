"""Case - balance: uneven vision work, dealt by position (before) and by cost (after).

A skewed data set (:mod:`benchmarks.skewed_data`: a third text only, image sides from a
Pareto law, so one image is a few patch rows and the next several hundred) on a toy
Qwen2.5-VL at native resolution, 4 ranks, in two layouts: vision DP 2 | language DP 2
(split) and vision DP 4 with language DP 4 (colocated).

* **Balance** (the data provider's own deal, every rank's provider built in one process
  and stepped over ``steps`` global batches): per step, the max/mean over the encoder's
  DP replicas of the patch rows they encode (``vision_tokens``) and of the sum over their
  images of rows squared (``vision_tokens_sq``, full attention's cost), and over the
  language DP replicas of their real tokens; the mean over steps of that ratio, before
  (``data.balance_encoders`` and ``data.balance_tokens`` off) and after (on). Targets:
  vision after <= 1.10, language after <= 1.05.
* **Step time** (4 forked ranks, both configs set up side by side and stepped
  alternately on their own precomputed steps, cycled): the median step time of rank 0
  before and after, and their ratio (< 1: balancing is faster). Reading the data is not
  in it (balancing reads whole batches on every rank, which this leaves out).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import CaseResult, Figure, Options, interleave, make_config, summarize
from benchmarks.skewed_data import write_skewed_assets
from mimotron.config.schema import MimoConfig
from mimotron.data import build_datasets
from mimotron.data.run_data import build_tokenizer
from mimotron.forked_ranks import run_ranks
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import check_layout
from mimotron.training.balanced_batches import Balance
from mimotron.training.data_provider import MicrobatchProvider

LAYOUTS = {
    "split": ["modules.vision.parallel.data=2", "modules.language.parallel.data=2",
              "modules.language.parallel.rank_offset=2"],
    # Colocated with encoder batching on both sides: a rank encodes its items of the
    # whole step in one forward, so the per-step deal is what its step waits for (the
    # bridge, a collective, would otherwise make every micro-batch wait for its slowest
    # rank).
    "colocated": ["modules.vision.parallel.data=4", "modules.language.parallel.data=4",
                  "modules.language.parallel.rank_offset=0", "train.encoder_batching=true"],
    # One rank per core of a 2-core machine (4 ranks share them, and then the total
    # work, which balancing does not change, sets the step time).
    "colocated-2": ["modules.vision.parallel.data=2", "modules.language.parallel.data=2",
                    "modules.language.parallel.rank_offset=0", "train.encoder_batching=true"],
}
BALANCED = ["data.balance_encoders=true", "data.balance_tokens=true"]


def skewed_raw(assets: dict[str, Path], root: Path) -> dict[str, Any]:
    return {
        "name": "skewed", "hf_path": str(assets["model"]),
        "modules": {"vision": {"parallel": {"data": 1, "rank_offset": 0}},
                    "language": {"parallel": {"data": 1, "rank_offset": 1}}},
        "data": {"dataset": "llava", "path": str(assets["data"]), "seq_length": 192,
                 "train_fraction": 0.95, "index_dir": str(root / "index")},
        "train": {"iters": 1000, "global_batch_size": 128, "micro_batch_size": 16,
                  "seed": 1234, "precision": "fp32"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "clip_grad": 1.0},
        "scheduler": {"warmup_iters": 10},
        "log": {"dir": str(root / "runs")},
    }


def _replica_loads(cfg: MimoConfig, num_steps: int) -> list[dict[str, list[float]]]:
    """Per step: each replica's vision rows, rows squared per frame and language tokens."""
    layout = check_layout(cfg)
    task, _ = build_datasets(cfg, build_tokenizer(cfg))
    stream = task.stream(cfg.train.seed)
    providers = [MicrobatchProvider(layout, r, cfg.train.micro_batch_size, cfg.data.seq_length,
                                    stream.samples, {"pad_id": task.pad_id,
                                                     "image_shape": task.image_shape,
                                                     "audio_shape": task.audio_shape},
                                    Balance.from_config(cfg))
                 for r in range(layout.world_size)]
    gbs, num_mb = cfg.train.global_batch_size, cfg.num_microbatches
    out = []
    for step in range(num_steps):
        loads: dict[str, dict[int, float]] = {"rows": {}, "rows_sq": {}, "language": {}}
        for p in providers:
            for mb in p.step(step * gbs, num_mb):
                for module, batch in mb.items():
                    replica = p.balanced.replica[module]
                    if module == LANGUAGE:
                        n = float((batch["tokens"] != task.pad_id).sum())
                        _add(loads["language"], replica, n)
                        continue
                    grid = batch["image_grid"][batch["has_image"].bool()].double()
                    frame = grid[:, 1] * grid[:, 2]
                    _add(loads["rows"], replica, float((grid[:, 0] * frame).sum()))
                    _add(loads["rows_sq"], replica, float((grid[:, 0] * frame ** 2).sum()))
        # each rank of a replica added the same: a replica's share is its rank count's
        out.append({k: list(v.values()) for k, v in loads.items()})
    return out


def _add(loads: dict[int, float], replica: int, value: float) -> None:
    loads[replica] = loads.get(replica, 0.0) + value


def _ratio(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def timed_rank(rank: int, world: int, configs: dict[str, MimoConfig], reps: int,
               steps_per_rep: int) -> dict[str, Any]:
    """Both configs (``before``, ``after``) set up on this rank and stepped alternately:
    their step times, and how far apart their losses are (relative; the same math)."""
    from benchmarks.common import engine_stepper, precompute_steps, setup_run

    del world
    runs = {name: setup_run(cfg) for name, cfg in configs.items()}
    steppers = {name: engine_stepper(run, precompute_steps(run, 2))
                for name, run in runs.items()}
    losses: dict[str, list[float]] = {name: [] for name in runs}

    def side(name: str) -> float:
        t0 = time.perf_counter()
        for _ in range(steps_per_rep):
            losses[name].append(float(steppers[name]()["loss"]))
        return (time.perf_counter() - t0) / steps_per_rep

    for name in runs:  # warm-up: allocator, optimizer state, first-call paths
        side(name)
    times = interleave(reps, {name: (lambda n=name: side(n)) for name in runs})
    rel = [abs(a - b) / max(abs(b), 1e-12)
           for a, b in zip(losses["after"], losses["before"], strict=True)]
    return {"times": times, "rank": rank, "max_loss_rel_diff": max(rel)}


def run_case(opts: Options) -> CaseResult:
    """Balance figures (targets after) and the step time ratio (reported)."""
    num_samples = 160 if opts.tiny else 1200
    num_steps = 2 if opts.tiny else 30
    steps_per_rep = 1 if opts.tiny or opts.quick else 2
    out = CaseResult("balance")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = write_skewed_assets(root / "assets", num_samples)
        raw = skewed_raw(assets, root)
        torch.set_num_threads(1)
        for name, layout in LAYOUTS.items():
            configs = {side: make_config(raw, layout + (BALANCED if side == "after" else []))
                       for side in ("before", "after")}
            for side, cfg in configs.items():
                steps = _replica_loads(cfg, num_steps)
                for key in ("rows", "rows_sq", "language"):
                    ratios = [_ratio(s[key]) for s in steps]
                    out.measurements[f"{name}_{key}_max_over_mean_{side}"] = summarize(ratios)
            world = check_layout(configs["before"]).world_size
            timed = run_ranks(world, timed_rank, configs, opts.reps, steps_per_rep,
                              timeout_s=1500)[0]
            out.measurements[f"{name}_max_loss_rel_diff"] = timed["max_loss_rel_diff"]
            before, after = (statistics.median(timed["times"][s]) for s in ("before", "after"))
            out.measurements[f"{name}_step_s_before"] = summarize(timed["times"]["before"])
            out.measurements[f"{name}_step_s_after"] = summarize(timed["times"]["after"])
            paired = [a / b for a, b in zip(timed["times"]["after"], timed["times"]["before"],
                                            strict=True)]
            out.figures.append(Figure(f"balance_{name}_step_time_ratio", after / before, "",
                                      (min(paired), max(paired)),
                                      f"{name}: step {before * 1e3:.0f} ms before, "
                                      f"{after * 1e3:.0f} ms after (rank 0, median)"))
            for key, target in (("rows", "<= 1.10"), ("rows_sq", "<= 1.10"),
                                ("language", "<= 1.05")):
                b = out.measurements[f"{name}_{key}_max_over_mean_before"]["median"]
                a = out.measurements[f"{name}_{key}_max_over_mean_after"]["median"]
                out.figures.append(Figure(
                    f"balance_{name}_{key}_max_over_mean", a, target, None,
                    f"{name}: {key} per DP replica per step, max/mean {b:.2f} before, "
                    f"{a:.2f} after (median of {num_steps} steps)"))
    return out
