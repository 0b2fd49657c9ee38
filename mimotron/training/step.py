"""One training step: schedule, gradient finalisation, optimizer, schedulers.

:func:`train_step` runs one iteration of a :class:`StepRun`, the step's fixed inputs
(model, optimizer, schedulers, transport, state, the rank's plan and roles), built once
by :func:`build_step_run` before the first step. Megatron-Bridge's ``train_step_mimo``,
which takes those inputs on every call, is a thin layer over it
(:mod:`mimotron.training.megatron_compat`). Every collective below is issued by every
rank in the same order (world reductions use fixed-size vectors), so no rank takes a
branch the others don't.

The step's scalars cost two world collectives, each with one host sync: the loss-token
count, started before the schedule and waited for where first needed (the loss is
divided by it before backward; :class:`GlobalTokenCount`), and the optimizer's after
the gradient reduction, which carries found-inf, every module's norm
and zero slots and the logged loss, token, correct and sample sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from mimotron.names import LANGUAGE
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.parallel.fsdp import fsdp_modules
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.groups import MultiModuleProcessGroupCollection, ProcessGroupCollection
from mimotron.pipeline.actions import Action
from mimotron.pipeline.schedules import (
    MicrobatchOutput,
    StepContext,
    Transport,
    rank_actions,
    run_schedule,
)
from mimotron.training.data_provider import Microbatch, microbatches_to_device
from mimotron.training.infra import MimoModelInfra
from mimotron.training.language_step import (
    ForwardStepFunc,
    LanguageStep,
    check_forward_step,
)

# Re-exported: the forward-step API and the token count have always been importable here.
from mimotron.training.language_step import GlobalTokenCount as GlobalTokenCount
from mimotron.training.language_step import default_forward_step as default_forward_step
from mimotron.training.language_step import language_input as language_input
from mimotron.training.language_step import language_loss_step as language_loss_step
from mimotron.training.precision import autocast_factory as autocast_factory
from mimotron.training.precision import step_cast_scope
from mimotron.training.state import GlobalState

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer


def module_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The module parts of a ``MimoModel`` on this rank, keyed by module name."""
    parts: dict[str, nn.Module] = dict(model.modality_submodules.items())
    if model.language_model is not None:
        parts[LANGUAGE] = model.language_model
    return parts


def clear_grads(parts: dict[str, nn.Module]) -> None:
    """Clear every module part's gradients before a new step (set to ``None``)."""
    for part in parts.values():
        for p in part.parameters():
            p.grad = None


def local_output_sums(outputs: list[MicrobatchOutput], loss_leader: bool, loss_partial: bool,
                      device: torch.device) -> torch.Tensor:
    """This rank's ``[loss, tokens, correct, samples]`` addends (zeros off the leaders).

    Float64 on ``device``, no host sync; their world sums are :func:`named_sums`'s input.
    Under context parallelism every CP rank adds its partial loss sum
    (``loss_partial``: ``MimoModelInfra.is_loss_partial``); the counts (of whole
    sequences) come from the replica's loss leader (cp 0: ``is_loss_leader``) only.
    """
    vec = torch.zeros(4, dtype=torch.float64, device=device)
    if loss_partial:
        for out in outputs:
            vec[0] += out.loss_sum.double()
    if loss_leader:
        for out in outputs:
            vec[1] += out.num_tokens.double()
            vec[2] += out.metrics.get("correct", torch.tensor(0)).double()
            vec[3] += out.metrics.get("samples", torch.tensor(0)).double()
    return vec


def named_sums(sums: list[float]) -> dict[str, float]:
    """World sums of :func:`local_output_sums`, by name."""
    loss_sum, tokens, correct, samples = sums
    return {"loss_sum": loss_sum, "tokens": tokens, "correct": correct, "samples": samples}


class StepResult(NamedTuple):
    """What one step returns, identical on every rank (a tuple in Megatron's order)."""

    loss_dict: dict[str, float]
    """Floats: ``loss`` (per token), ``num_tokens``, ``accuracy`` and ``num_samples``."""
    skipped: bool
    grad_norm: float | None
    num_zeros: int | None


@dataclass
class StepRun:
    """The fixed inputs of every step of one run (:func:`build_step_run` builds it).

    What the config, the layout and the infra decide is decided here once, so a step
    reads it instead of asking the files that decide it again.
    """

    model: nn.Module
    optimizer: MimoOptimizer
    schedulers: dict[str, OptimizerParamScheduler]
    state: GlobalState
    infra: MimoModelInfra
    transport: Transport
    language: LanguageStep
    parts: dict[str, nn.Module]
    """This rank's module parts by name: the gradients the step clears and reduces."""
    process_groups: dict[str, ProcessGroupCollection]
    """This rank's groups per module; their data-parallel groups reduce the gradients."""
    loss_leader: bool
    loss_partial: bool
    frozen: set[str]
    """Modules frozen whole (a frozen tower is left out by ``requires_grad`` instead)."""
    fsdp: set[str]
    """FSDP2 modules: they reduce-scatter their gradients in their own backward hooks."""
    bucket_bytes: int
    pipelined: bool
    plan: list[Action]
    """This rank's plan for ``num_microbatches`` micro-batches."""
    num_microbatches: int
    autocast: Callable[[], Any]


def build_step_run(model: nn.Module, optimizer: MimoOptimizer,
                   schedulers: dict[str, OptimizerParamScheduler], state: GlobalState,
                   infra: MimoModelInfra, transport: Transport,
                   forward_step_func: ForwardStepFunc | LanguageStep = default_forward_step,
                   pg_collection: MultiModuleProcessGroupCollection | None = None) -> StepRun:
    """The fixed inputs of a run's steps, from what ``setup_mimo`` built.

    Args:
        model: the ``MimoModel`` holding this rank's modules.
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module ``OptimizerParamScheduler`` (active modules).
        state: config, runtime, timers, train state.
        infra: grids, process groups and roles of this rank.
        transport: the run's transport (``build_transport``).
        forward_step_func: the language step function (see ``default_forward_step``) or a
            ``LanguageStep`` around one (whose auxiliary metrics the loop reads).
        pg_collection: this rank's process groups (``None``: ``infra``'s).

    Raises:
        ValueError: a custom ``forward_step_func`` with a context-parallel language model.
    """
    cfg = state.cfg
    check_forward_step(forward_step_func, infra.layout.modules[LANGUAGE].parallel.context)
    pipelined = cfg.train.schedule == "1f1b"
    groups = pg_collection if pg_collection is not None else infra.multimodule_pg_collection
    return StepRun(
        model=model, optimizer=optimizer, schedulers=schedulers, state=state, infra=infra,
        transport=transport, language=LanguageStep.of(forward_step_func),
        parts=module_parts(model), process_groups=dict(groups.items()),
        loss_leader=infra.is_loss_leader, loss_partial=infra.is_loss_partial,
        frozen={n for n, m in cfg.modules.items() if m.fully_frozen},
        fsdp=fsdp_modules(cfg), bucket_bytes=int(cfg.train.grad_bucket_mb * 2**20),
        pipelined=pipelined,
        plan=rank_actions(infra.layout, infra.rank, cfg.num_microbatches, pipelined),
        num_microbatches=cfg.num_microbatches,
        autocast=autocast_factory(cfg.train.precision, state.runtime.device))


def train_step(run: StepRun, microbatches: list[Microbatch]) -> StepResult:
    """Run one training iteration on this rank.

    Args:
        run: the run's fixed inputs (:func:`build_step_run`).
        microbatches: the step's micro-batches for this rank (on the host or the device).

    Returns:
        ``(loss_dict, skipped, grad_norm, num_zeros)``; identical on all ranks.
    """
    cfg, timers = run.state.cfg, run.state.timers
    device = run.state.runtime.device
    timers("data").start()
    # Host batches go to the device here (a no-op on the CPU), so any iterator works.
    microbatches = microbatches_to_device(microbatches, device)
    timers("data").stop()
    clear_grads(run.parts)
    token_count = GlobalTokenCount(microbatches, run.loss_leader, device)  # waited on first use
    optimizer = run.optimizer
    sharded = {n for n, info in optimizer.module_infos.items() if info.zero is not None}
    zero = {n: info.zero for n, info in optimizer.module_infos.items()
            if info.zero is not None and info.is_active and n in run.parts}
    for shards in zero.values():  # forget reduce-scatters of a step that raised
        shards.zero_model_grads()
    # Plain, overlapped or ZeRO-1: one finalisation (mimotron.parallel.grad_sync).
    grad_sync = GradSync({n: p for n, p in run.parts.items() if n not in run.fsdp},
                         run.process_groups, run.frozen, run.bucket_bytes, zero,
                         overlap=cfg.train.overlap_grad_reduce, sharded=sharded)
    timers("forward-backward").start()
    ctx = StepContext(
        model=run.model, layout=run.infra.layout, rank=run.infra.rank,
        microbatches=microbatches, language=run.language, transport=run.transport,
        token_count=token_count.value, loss_scale=float(optimizer.get_loss_scale()),
        autocast=run.autocast, grad_sync=grad_sync,
        encoder_batching=cfg.train.encoder_batching)
    plan = (run.plan if len(microbatches) == run.num_microbatches
            else rank_actions(run.infra.layout, run.infra.rank, len(microbatches), run.pipelined))
    try:
        # One 16-bit copy of each weight for the step's micro-batches, freed before the
        # optimizer changes the weights (mimotron.training.precision).
        with step_cast_scope(cfg.train.precision, device):
            outputs = run_schedule(ctx, plan)
        num_tokens = token_count.value()
        timers("forward-backward").stop(sync=True)
        timers("grad-sync").start()
        grad_sync.finish()
    finally:
        grad_sync.close()
    timers("grad-sync").stop(sync=True)
    timers("optimizer").start()
    # The logged loss sums ride on the optimizer's one world collective (found-inf, norm).
    success, grad_norm, num_zeros, reduced = optimizer.step_with_world_sums(
        local_output_sums(outputs, run.loss_leader, run.loss_partial, device))
    if success:
        for scheduler in run.schedulers.values():
            scheduler.step()
    timers("optimizer").stop(sync=True)
    sums = named_sums(reduced)
    loss = sums["loss_sum"] / max(num_tokens, 1.0)
    loss_dict = {"loss": loss, "num_tokens": num_tokens,
                 "accuracy": sums["correct"] / max(sums["samples"], 1.0),
                 "num_samples": sums["samples"]}
    return StepResult(loss_dict, not success, grad_norm, num_zeros)
