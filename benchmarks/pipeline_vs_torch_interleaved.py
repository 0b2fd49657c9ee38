"""Our interleaved 1F1B vs torch's ``ScheduleInterleaved1F1B``, side by side.

Part of the ``pipeline_vs_torch`` case. The language model alone (no encoder: torch's
interleaved schedule needs every rank to hold the same number of stages) with
``pipeline = 2``, ``virtual_pipeline = 2``: 4 chunks, rank 0 holding chunks 0 and 2,
rank 1 chunks 1 and 3. Both sides are built by ``setup_mimo`` from the same config and
seed and run the same precomputed micro-batches:

* ours: ``train_step_mimo`` (the interleaved plan, ``parallel.virtual_pipeline = 2``);
* torch: one ``PipelineStage`` per model chunk (``forward(chunk=j)`` of the same
  language-model part) under ``ScheduleInterleaved1F1B`` on gloo (``scale_grads=False``,
  loss = sum / global token count, the engine's), then what the engine's optimizer
  does: global grad-norm clipping over both ranks and the loss sum (one ``all_reduce``)
  and AdamW with the config's groups (:mod:`benchmarks.torch_side`).

The first step's losses and the weights after it are asserted equal before timing.
After the timing, a few steps of each side are instrumented
(:mod:`benchmarks.pipeline_breakdown`): per rank, where the step's time went. Figures:
``pipeline_vs_torch_ratio_interleaved`` = our step time / torch's (<= 1.00), and both
sides' efficiency against the interleaved bound ``(m + (p - 1) / v)`` x the slower
rank's forward+backward of one micro-batch through both its chunks (measured alone)
+ the slower rank's optimizer step (>= 0.97).
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import (
    CaseResult,
    Figure,
    Options,
    digits_raw,
    engine_stepper,
    fmt_stats,
    make_config,
    parallel,
    precompute_steps,
    ratio_figure,
    runqueue_wait_s,
    setup_run,
    summarize,
    timed,
)
from benchmarks.pipeline_breakdown import (
    breakdown_note,
    gather,
    ours_breakdown,
    torch_breakdown,
)
from benchmarks.torch_side import CONSTANT_LR, Finisher, adamw, first_step_check
from mimotron.forked_ranks import run_ranks

P, V = 2, 2


def ab_times(sides: dict[str, Any], reps: int, steps: int
             ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step seconds (the slower rank's) and run-queue wait fraction of each side; the
    order alternates every repetition (A/B, B/A)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    waits: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier()
            waited = runqueue_wait_s()
            t = torch.tensor([timed(sides[name], steps), 0.0])
            t[1] = (runqueue_wait_s() - waited) / steps / t[0]
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends with the slower rank
            times[name].append(float(t[0]))
            waits[name].append(float(t[1]))
    return times, waits


class _Chunk(torch.nn.Module):
    """One model chunk as a torch pipeline stage; reads its micro-batches in order."""

    def __init__(self, model: Any, chunk: int, first: bool, last: bool, mbs: list[Any],
                 num_tokens: float) -> None:
        super().__init__()
        self.model, self.chunk, self.first, self.last = model, chunk, first, last
        self.num_tokens = num_tokens
        self.feed = itertools.cycle(mbs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _chunk_forward(self.model, next(self.feed)["language"], self.chunk, self.first,
                              self.last, x, self.num_tokens)


def _chunk_forward(model: Any, batch: dict[str, Any], chunk: int, first: bool, last: bool,
                   x: torch.Tensor, num_tokens: float) -> torch.Tensor:
    from mimotron.models.attention import document_args
    from mimotron.training.language_step import language_input, language_loss_step

    if first:
        x = language_input(model, batch, {})
    out = model.language_model(x, chunk=chunk, **document_args(batch))
    if not last:
        return out
    return (language_loss_step(model, batch, out)[0] / num_tokens).reshape(1)


def _torch_side(run: Any, cfg: Any, rank: int, mbs: list[Any], shape: tuple[int, ...],
                num_tokens: float) -> Any:
    """One ``ScheduleInterleaved1F1B`` step, clipping, AdamW (a callable returning the
    world loss), the optimizer, the stages and the finisher (for the breakdown)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    m, stages = len(mbs), []
    for chunk in range(V):
        index = chunk * P + rank
        first, last = index == 0, index == P * V - 1
        hidden = torch.zeros(shape, requires_grad=True)  # the boundary is differentiable
        stages.append(PipelineStage(
            _Chunk(run.model, chunk, first, last, mbs, num_tokens), index, P * V,
            torch.device("cpu"),
            input_args=(torch.zeros(1, 1),) if first else (hidden,),
            output_args=(torch.zeros(1),) if last else (hidden,)))
    sched = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, _t: out.sum(),
                                    scale_grads=False)
    opt, params = adamw(run.model, cfg)
    finish = Finisher(opt, params, cfg.optimizer.clip_grad)
    inputs, target = torch.zeros(m, 1), torch.zeros(m, 1)

    def step() -> float:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(inputs)
        else:
            sched.step(target=target, losses=losses)
        return finish(float(sum(float(x.detach().sum()) for x in losses)))

    return step, opt, stages, finish


def _rank_alone(run: Any, rank: int, mb: dict[str, Any], shape: tuple[int, ...]) -> float:
    """Forward+backward seconds of this rank's chunks on one micro-batch (no peer)."""
    def fwd_bwd() -> None:
        for chunk in range(V):
            index = chunk * P + rank
            first, last = index == 0, index == P * V - 1
            x = torch.randn(shape, requires_grad=True)
            out = _chunk_forward(run.model, mb["language"], chunk, first, last, x, 1.0)
            out.backward(torch.ones_like(out))

    fwd_bwd()  # warm-up
    return statistics.median(timed(fwd_bwd, 2) for _ in range(5))


def _rank(rank: int, world: int, overrides: list[str], shape: tuple[int, ...], reps: int,
          steps: int) -> dict[str, Any]:
    raw = digits_raw()
    for name in ("vision", "audio"):
        del raw["modules"][name]
    cfg = make_config(raw, overrides)
    ours, theirs = setup_run(cfg), setup_run(cfg)  # same seed: same initial weights
    batches = precompute_steps(ours, 1)
    mbs = list(batches[0])
    num_tokens = float(sum(mb["language"]["loss_mask"].float().sum() for mb in mbs))
    ours_step = engine_stepper(ours, batches)
    torch_step, opt, stages, finish = _torch_side(theirs, cfg, rank, mbs, shape, num_tokens)
    # Sanity (not timed): the first step gives the same loss and the same weights.
    losses = first_step_check(ours_step, torch_step, finish, ours, theirs, P - 1, "interleaved")
    alone = torch.zeros(2, world)
    for r in range(world):  # one rank at a time: each measured alone
        if r == rank:
            alone[0, rank] = _rank_alone(theirs, rank, mbs[0], shape)
            alone[1, rank] = timed(opt.step, 3)
        dist.barrier()
    opt.zero_grad(set_to_none=True)
    dist.all_reduce(alone)
    times, waits = ab_times({"ours": ours_step, "torch": torch_step}, reps, steps)
    split = gather({"ours": ours_breakdown(ours, ours_step),
                    "torch": torch_breakdown(theirs, stages, finish, torch_step)})
    return {"times": times, "cpu_wait": waits, "loss": list(losses), "breakdown": split,
            "rank_s": alone[0].tolist(), "optimizer_s": alone[1].tolist()}


def interleaved_case(opts: Options, sizes: tuple[int, ...], m: int, steps: int,
                     out: CaseResult) -> None:
    """Add the interleaved figures and measurements to the ``pipeline_vs_torch`` result.

    Args:
        opts: the run's options (repetitions).
        sizes: ``(vision hidden, vision layers, language hidden, language layers,
            micro-batch size)`` of the 1F1B comparison; the language model here has the
            same width and ``4 x`` its layers (at least 4: one per chunk).
        m: micro-batches per step (a multiple of ``P``).
        steps: steps per timed repetition.
        out: the case result to extend.
    """
    _, _, hidden, layers, mbs = sizes
    layers, seq = max(4, 4 * layers), 96
    overrides = parallel("language", data=1, rank_offset=0, pipeline=P, virtual_pipeline=V) + [
        f"modules.language.hidden_size={hidden}", f"modules.language.num_layers={layers}",
        f"train.micro_batch_size={mbs}", f"train.global_batch_size={m * mbs}",
        f"data.seq_length={seq}"] + CONSTANT_LR
    res = run_ranks(P, _rank, overrides, (mbs, seq, hidden), opts.reps, steps,
                    timeout_s=900)[0]
    ours_loss, torch_loss = res["loss"]
    if abs(ours_loss - torch_loss) > 1e-4 * max(abs(ours_loss), 1e-12):
        raise AssertionError(f"interleaved first-step losses differ: ours {ours_loss} vs "
                             f"torch {torch_loss}: not the same work")
    ours, theirs = res["times"]["ours"], res["times"]["torch"]
    bound = (m + (P - 1) / V) * max(res["rank_s"]) + max(res["optimizer_s"])
    out.figures.append(ratio_figure(
        "pipeline_vs_torch_ratio_interleaved", ours, theirs, "<= 1.00",
        f"m={m} p={P} v={V} language alone ({layers} layers): ours "
        f"{fmt_stats(summarize(ours))} vs torch ScheduleInterleaved1F1B "
        f"{fmt_stats(summarize(theirs))}"))
    for key, t in (("pipeline_efficiency_vs_bound_interleaved", ours),
                   ("torch_pipeline_efficiency_vs_bound_interleaved", theirs)):
        effs = [bound / x for x in t]
        out.figures.append(Figure(
            key, bound / statistics.median(t), ">= 0.97", (min(effs), max(effs)),
            f"bound {bound * 1e3:.1f} ms = ({m}+({P}-1)/{V}) x slower rank fwd+bwd "
            f"{max(res['rank_s']) * 1e3:.1f} ms + optimizer "
            f"{max(res['optimizer_s']) * 1e3:.1f} ms"))
    out.measurements["interleaved"] = {
        "ours_step_s": summarize(ours), "torch_step_s": summarize(theirs),
        "first_step_loss_ours_torch": [ours_loss, torch_loss],
        "rank_fwd_bwd_s": res["rank_s"], "optimizer_s_per_rank": res["optimizer_s"],
        "bound_s": bound, "microbatches": m, "pipeline": P, "virtual_pipeline": V,
        "language_layers": layers, "language_hidden": hidden,
        "cpu_wait_fraction_ours": summarize(res["cpu_wait"]["ours"]),
        "cpu_wait_fraction_torch": summarize(res["cpu_wait"]["torch"]),
        "torch_side": "one PipelineStage per chunk + ScheduleInterleaved1F1B (gloo), "
        "scale_grads=False; global grad-norm clip (one all_reduce with the loss sum), "
        "AdamW as ours; first-step losses and weights asserted equal",
        "step_breakdown_per_rank": res["breakdown"],
    }
    out.notes.append(breakdown_note(res["breakdown"]))
