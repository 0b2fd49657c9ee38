"""Case ``stage_link`` - a language model at PP 2: shape headers and step time.

The ``pipeline`` case has no intra-module stage link (encoder rank + language rank), so
this one splits the language model of the same two-module model (``vision`` on rank 0,
``language`` stages 0 and 1 on ranks 1 and 2; every sample carries an image) and trains
``m = 4`` micro-batches per step in two variants:

* **known**: as shipped. The stage link's tensors (``[micro-batch, seq_length,
  hidden]``, known to both stages from the config) travel without a shape header, so
  do the bridge's (every sample carries an image: one row per sample), and every
  receive is posted as soon as the previous one of its direction completed;
* **headers**: the previous behaviour (every transfer with its header, each receive
  posted when the schedule reaches it), switched back inside the ranks.

``stage_link_headers`` counts, per step, the headers sent and received by the language
model's last stage: everything it sends or receives crosses the stage link, so the
figure is the link's headers alone (target 0); the detail adds the headers of every link
(the bridge included) and the bytes and messages saved.
``stage_link_step_ratio`` = known step time / headers step time (the slowest rank's;
3 ranks share this machine's cores, so it is noisy; lower is better).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    CaseResult,
    Figure,
    Options,
    engine_stepper,
    fmt_stats,
    interleave,
    make_config,
    parallel,
    precompute_steps,
    ratio_figure,
    setup_run,
    summarize,
    timed,
)
from benchmarks.pipeline import SIZES, _two_module_raw, model_overrides
from mimotron.forked_ranks import run_ranks

NUM_MICROBATCHES = 4
HEADER_BYTES = 64  # HEADER_LEN int64 values (mimotron.pipeline.p2p)
LAYOUT = (parallel("vision", data=1, rank_offset=0)
          + parallel("language", data=1, pipeline=2, rank_offset=1))


def _switch_to_headers() -> None:
    """Inside this forked rank only: every transfer with its header, nothing ahead."""
    from mimotron.pipeline import communicator as communicator_module
    from mimotron.training import loop as loop_module

    communicator_module.stage_link_shape = lambda *args, **kwargs: None
    communicator_module.MultiModulePipelineCommunicator.expect = lambda self, plan: None
    loop_module.bridge_row_shapes = lambda *args: {}


def _rank(rank: int, world: int, overrides: list[str], steps_per_rep: int, headers: bool
          ) -> dict[str, Any]:
    del world
    if headers:
        _switch_to_headers()
    run = setup_run(make_config(_two_module_raw(), LAYOUT + overrides))
    step = engine_stepper(run, precompute_steps(run, 1))
    step()  # warm-up
    before = dataclasses.asdict(run.communicator.counts)
    dist.barrier()
    t = torch.tensor([timed(step, steps_per_rep)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
    after = dataclasses.asdict(run.communicator.counts)
    per_step = {k: (after[k] - before[k]) / steps_per_rep for k in after}
    last_stage = rank == 2
    return {"step_s": float(t), "counts": per_step, "last_stage": last_stage}


def run_case(opts: Options) -> CaseResult:
    """Measure ``stage_link_headers`` (target 0) and ``stage_link_step_ratio``."""
    size = "tiny" if opts.tiny else ("quick" if opts.quick else "default")
    vh, vl, lh, ll, mbs = SIZES[size]
    overrides = model_overrides((vh, vl, lh, max(ll, 2), mbs)) + [
        f"train.global_batch_size={NUM_MICROBATCHES * mbs}"]
    steps_per_rep = 1 if opts.tiny else (2 if opts.quick else 3)
    res = interleave(opts.reps, {
        name: (lambda h=headers: run_ranks(3, _rank, overrides, steps_per_rep, h,
                                           timeout_s=600))
        for name, headers in (("known", False), ("headers", True))})
    out = CaseResult("stage_link")
    link = {}
    for name in res:
        last = [r for ranks in res[name] for r in ranks if r["last_stage"]]
        link[name] = max(c["counts"]["headers_sent"] + c["counts"]["headers_received"]
                         for c in last)
    total = {name: max(sum(r["counts"]["headers_sent"] for r in ranks) for ranks in res[name])
             for name in res}
    out.figures.append(Figure(
        "stage_link_headers", link["known"], "<= 0", None,
        f"per step, m={NUM_MICROBATCHES}: {link['known']:.0f} headers on the language stage "
        f"link (was {link['headers']:.0f}); all links {total['known']:.0f} headers sent (was "
        f"{total['headers']:.0f}), {HEADER_BYTES * (total['headers'] - total['known']):.0f} B "
        "and as many messages saved"))
    known = [ranks[0]["step_s"] for ranks in res["known"]]
    old = [ranks[0]["step_s"] for ranks in res["headers"]]
    out.figures.append(ratio_figure(
        "stage_link_step_ratio", known, old, "",
        f"3 ranks (vision | language PP 2), m={NUM_MICROBATCHES}: "
        f"{fmt_stats(summarize(known))} vs {fmt_stats(summarize(old))} per step"))
    out.measurements.update({
        "known_step_s": summarize(known), "headers_step_s": summarize(old),
        "stage_link_headers_per_step": link, "headers_sent_per_step": total,
        "counts_per_rank": {name: res[name][0] for name in res},
        "model": {"vision_hidden": vh, "vision_layers": vl, "language_hidden": lh,
                  "language_layers": max(ll, 2), "micro_batch_size": mbs},
        "steps_per_rep": steps_per_rep,
    })
    return out
