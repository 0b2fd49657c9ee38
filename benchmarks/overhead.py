"""Case 1 - overhead: mimotron's training step vs a hand-written PyTorch loop.

Both sides run in one forked rank (world size 1, one thread) on the same micro-batches
with the same initial weights (``build_mimo_model`` initialises from (seed, name)):

* A: ``train_step_mimo`` on a run built by ``setup_mimo`` (what ``mimotron train`` runs);
* B: the loop anyone would write: ``model(batch)`` per micro-batch, loss sum divided by
  the step's token count, ``backward``, ``clip_grad_norm_``, one ``AdamW`` (decay and
  no-decay groups) and a ``LambdaLR`` warm-up/cosine schedule.

The steps' micro-batches are built before timing and cycled, so data building is
excluded from both sides. Both sides train on the same batch sequence with the same
hyper-parameters, so their losses must agree: ``max_loss_rel_diff`` checks that B does
the same work as A (a fast but different loop would be no baseline).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from benchmarks.common import (
    TINY,
    CaseResult,
    Options,
    digits_raw,
    engine_stepper,
    fmt_stats,
    host_sync_figure,
    interleave,
    make_config,
    one_rank,
    precompute_steps,
    ratio_figure,
    runqueue_wait_s,
    setup_run,
    summarize,
    timed_cpu,
)
from mimotron.config import MimoConfig
from mimotron.forked_ranks import run_ranks


def plain_loop(
    cfg: MimoConfig, vocab_size: int, placeholders: dict[str, int]
) -> tuple[torch.nn.Module, Any]:
    """The baseline: the default model, one AdamW, a LambdaLR; returns (model, step)."""
    from mimotron.models.build import build_mimo_model

    model = build_mimo_model(cfg, vocab_size, placeholders)
    oc, sc = cfg.optimizer, cfg.scheduler
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if any(s in n for s in oc.no_decay)]
    decay = [p for n, p in named if not any(s in n for s in oc.no_decay)]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": oc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=oc.lr,
        betas=tuple(oc.betas),
        eps=oc.eps,
    )
    warmup, decay_iters = sc.warmup_iters, sc.decay_iters or cfg.train.iters
    min_ratio = oc.min_lr / oc.lr

    def lr_factor(step: int) -> float:
        if warmup and step <= warmup:
            return step / warmup
        progress = min((step - warmup) / max(decay_iters - warmup, 1), 1.0)
        return min_ratio + 0.5 * (math.cos(math.pi * progress) + 1) * (1 - min_ratio)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    params = [p for _, p in named]

    def step(batches: list[dict[str, torch.Tensor]]) -> float:
        opt.zero_grad(set_to_none=True)
        num_tokens = sum(b["loss_mask"].sum() for b in batches)
        total = torch.zeros(())
        for b in batches:
            loss_sum, _, _ = model(b)
            (loss_sum / num_tokens).backward()
            total += loss_sum.detach()
        if oc.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, oc.clip_grad)
        opt.step()
        sched.step()
        return float(total / num_tokens)

    return model, step


def _rank(
    rank: int, world: int, overrides: list[str], reps: int, steps_per_rep: int
) -> dict[str, Any]:
    del rank, world
    raw = digits_raw()
    cfg = make_config(raw, one_rank(raw) + overrides)
    run = setup_run(cfg)
    steps = precompute_steps(run, 2)
    mimo_step = engine_stepper(run, steps)
    placeholders = {
        n: run.tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names
    }
    # The engine may pad the vocabulary (TP divisibility): build the baseline alike.
    vocab_size = run.model.language_model.embed.num_embeddings
    _, plain = plain_loop(cfg, vocab_size, placeholders)
    plain_batches = [[mb["language"] for mb in step] for step in steps]
    cursor = {"mimo": 0, "plain": 0}
    losses: dict[str, list[float]] = {"mimo": [], "plain": []}
    cpu: dict[str, list[float]] = {"mimo": [], "plain": []}

    def side(name: str) -> float:
        def one() -> None:
            if name == "mimo":
                losses[name].append(mimo_step()["loss"])
            else:
                batch = plain_batches[cursor[name] % len(plain_batches)]
                losses[name].append(plain(batch))
            cursor[name] += 1

        wall, cpu_s = timed_cpu(one, steps_per_rep)
        cpu[name].append(cpu_s)
        return wall

    for _ in range(2):  # warm-up: allocator, lazy optimizer state, first-call paths
        side("mimo")
        side("plain")
    cpu["mimo"].clear()
    cpu["plain"].clear()
    waited = runqueue_wait_s()
    times = interleave(reps, {"mimo": lambda: side("mimo"), "plain": lambda: side("plain")})
    timed_s = (sum(times["mimo"]) + sum(times["plain"])) * steps_per_rep
    cpu_wait = (runqueue_wait_s() - waited) / timed_s  # share of the time without a CPU
    diffs = [
        abs(a - b) / max(abs(b), 1e-12)
        for a, b in zip(losses["mimo"], losses["plain"], strict=True)
    ]
    num_params = sum(p.numel() for p in run.model.parameters())
    return {
        "mimo": times["mimo"],
        "plain": times["plain"],
        "cpu": cpu,
        "cpu_wait": cpu_wait,
        "max_loss_rel_diff": max(diffs),
        "num_params": num_params,
        "num_microbatches": len(steps[0]),
        "micro_batch_size": cfg.train.micro_batch_size,
    }


def run_case(opts: Options) -> CaseResult:
    """Measure ``overhead_ratio`` = mimotron step time / plain step time (target <= 1.05)."""
    steps_per_rep = 1 if opts.tiny else (2 if opts.quick else 4)
    res = run_ranks(1, _rank, TINY if opts.tiny else [], opts.reps, steps_per_rep, timeout_s=600)[0]
    mimo, plain = summarize(res["mimo"]), summarize(res["plain"])
    fig = ratio_figure(
        "overhead_ratio",
        res["mimo"],
        res["plain"],
        "<= 1.05",
        f"mimotron {fmt_stats(mimo)} vs plain {fmt_stats(plain)} per step",
    )
    raw = digits_raw()
    out = CaseResult("overhead", [fig, host_sync_figure(
        make_config(raw, one_rank(raw) + (TINY if opts.tiny else [])))])
    out.measurements = {
        "mimotron_step_s": mimo,
        "plain_step_s": plain,
        "mimotron_step_cpu_s": summarize(res["cpu"]["mimo"]),
        "plain_step_cpu_s": summarize(res["cpu"]["plain"]),
        "overhead_ratio_cpu": ratio_figure("cpu", res["cpu"]["mimo"], res["cpu"]["plain"]).value,
        "max_loss_rel_diff": res["max_loss_rel_diff"],
        "num_params": res["num_params"],
        "num_microbatches": res["num_microbatches"],
        "micro_batch_size": res["micro_batch_size"],
        "steps_per_rep": steps_per_rep,
        "data": "micro-batches precomputed before timing (data building excluded from both)",
    }
    out.measurements["cpu_wait_fraction"] = res["cpu_wait"]
    if res["cpu_wait"] > 0.05:
        out.notes.append(
            f"the rank waited for a CPU {res['cpu_wait']:.0%} of the time "
            "(other processes): both sides are slowed, the ratio less so"
        )
    if res["max_loss_rel_diff"] > 1e-4:
        out.notes.append(
            f"losses of the two loops differ by {res['max_loss_rel_diff']:.2e} "
            "(relative): the baseline may not do the same work"
        )
    return out
