"""Case - frozen_ahead: a frozen vision encoder in 1F1B (before) and running ahead (after).

The skewed data set of :mod:`benchmarks.balance` on its toy Qwen2.5-VL, the vision module
frozen whole (``freeze = true``) on rank 0 and the language model on rank 1: one rank per
core of a 2-core machine. With ``train.frozen_ahead = false`` the vision rank follows
1F1B, waiting for each micro-batch's (useless) gradient before its next forward, and the
language rank computes and sends those gradients; with it on (the default) the vision
rank runs every forward without autograd and sends each output when done, and no
gradient travels back. Both configs are set up in one run and stepped alternately on
their own precomputed steps; the figure is the after / before ratio of rank 1's median
step time (reported, no target), with both sides' losses compared (equal: the same math).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.balance import skewed_raw, timed_rank
from benchmarks.common import CaseResult, Figure, Options, make_config, summarize
from benchmarks.skewed_data import write_skewed_assets
from mimotron.forked_ranks import run_ranks

LAYOUT = ["modules.vision.freeze=true", "modules.vision.parallel.rank_offset=0",
          "modules.language.parallel.rank_offset=1"]


def run_case(opts: Options) -> CaseResult:
    """The step time ratio with the frozen encoder running ahead vs in 1F1B."""
    num_samples = 160 if opts.tiny else 600
    steps_per_rep = 1 if opts.tiny or opts.quick else 2
    out = CaseResult("frozen_ahead")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = skewed_raw(write_skewed_assets(root / "assets", num_samples), root)
        torch.set_num_threads(1)
        configs = {"before": make_config(raw, LAYOUT + ["train.frozen_ahead=false"]),
                   "after": make_config(raw, LAYOUT)}
        ranks = run_ranks(2, timed_rank, configs, opts.reps, steps_per_rep, timeout_s=1500)
    times = ranks[1]["times"]
    before, after = (statistics.median(times[s]) for s in ("before", "after"))
    paired = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
    out.figures.append(Figure("frozen_ahead_step_time_ratio", after / before, "",
                              (min(paired), max(paired)),
                              f"vision frozen | language, 2 ranks: step {before * 1e3:.0f} ms "
                              f"in 1F1B, {after * 1e3:.0f} ms ahead (rank 1, median)"))
    out.measurements = {"step_s_before": summarize(times["before"]),
                        "step_s_after": summarize(times["after"]),
                        "max_loss_rel_diff": ranks[1]["max_loss_rel_diff"]}
    if ranks[1]["max_loss_rel_diff"] > 1e-5:
        out.notes.append(f"losses ahead and in 1F1B differ by {ranks[1]['max_loss_rel_diff']:.1e}"
                         " (relative): a bug")
    return out
