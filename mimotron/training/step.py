"""One training step: schedule, gradient finalisation, optimizer, schedulers.

``train_step_mimo`` keeps Megatron-Bridge's signature and return value
``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``. Every collective below is
issued by every rank in the same order (world reductions use fixed-size vectors), so no
rank takes a branch the others don't.

The step's scalars cost two world collectives, each with one host sync: the loss-token
count, started before the schedule and waited for where first needed (the loss is
divided by it before backward; :class:`GlobalTokenCount`), and the optimizer's after
the gradient reduction, which carries found-inf, every module's norm
and zero slots and the logged loss, token, correct and sample sums.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mimotron import host_sync
from mimotron.names import LANGUAGE
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.parallel.data_parallel import zero_grad_buffer_for_multimodule
from mimotron.parallel.fsdp import fsdp_modules
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import MultiModuleProcessGroupCollection
from mimotron.pipeline.schedules import (
    MicrobatchOutput,
    StepContext,
    Transport,
    forward_backward_no_pipelining,
    forward_backward_pipelining_without_interleaving,
)
from mimotron.training.bridge_args import (
    check_batch_geometry,
    require_infra,
    resolve_module_parts,
    resolve_pg_collection,
)
from mimotron.training.data_provider import Microbatch, microbatches_to_device
from mimotron.training.infra import MimoModelInfra
from mimotron.training.language_step import ForwardStepFunc, LanguageStep, check_forward_step

# Re-exported: the forward-step API has always been importable from here.
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


class GlobalTokenCount:
    """Loss tokens of the whole global batch, reduced over the world in the background.

    Each language DP replica's leader contributes its slice's count; encoder-only ranks
    contribute zero but still join, so they can scale their gradients identically. This
    reduction cannot join the optimizer's: the loss is divided by the count before
    backward. It is started before the schedule and waited for on first use (the
    language model's last stage, at its first backward or MoE forward; every other rank
    after its schedule), so no rank waits for the others to reach it before its first
    forward: the encoders start at once. The value is the same float either way.
    """

    def __init__(self, microbatches: list[Microbatch], infra: MimoModelInfra,
                 device: torch.device) -> None:
        local = 0.0
        if infra.is_loss_leader:
            local = sum(mb[LANGUAGE]["loss_mask"].sum() for mb in microbatches)
        self._count = torch.as_tensor(local, dtype=torch.float64, device=device).reshape(1)
        self._work = dist.all_reduce(self._count, async_op=True)
        self._value: float | None = None

    def value(self) -> float:
        """The world's count (waits for the reduction once; one host sync)."""
        if self._value is None:
            self._work.wait()
            self._value = float(host_sync.item(self._count, host_sync.TOKEN_COUNT))
        return self._value


def count_global_tokens(microbatches: list[Microbatch], infra: MimoModelInfra,
                        device: torch.device) -> float:
    """Loss tokens of the whole global batch, known to every rank (one world reduction).

    See :class:`GlobalTokenCount`; this waits for it at once.
    """
    return GlobalTokenCount(microbatches, infra, device).value()


def local_output_sums(outputs: list[MicrobatchOutput], infra: MimoModelInfra,
                      device: torch.device) -> torch.Tensor:
    """This rank's ``[loss, tokens, correct, samples]`` addends (zeros off the leaders).

    Float64 on ``device``, no host sync; their world sums are :func:`named_sums`'s input.
    Under context parallelism every CP rank adds its partial loss sum; the counts (of
    whole sequences) come from the replica's loss leader (cp 0) only.
    """
    vec = torch.zeros(4, dtype=torch.float64, device=device)
    if infra.is_loss_partial:
        for out in outputs:
            vec[0] += out.loss_sum.double()
    if infra.is_loss_leader:
        for out in outputs:
            vec[1] += out.num_tokens.double()
            vec[2] += out.metrics.get("correct", torch.tensor(0)).double()
            vec[3] += out.metrics.get("samples", torch.tensor(0)).double()
    return vec


def named_sums(sums: list[float]) -> dict[str, float]:
    """World sums of :func:`local_output_sums`, by name."""
    loss_sum, tokens, correct, samples = sums
    return {"loss_sum": loss_sum, "tokens": tokens, "correct": correct, "samples": samples}


def train_step_mimo(
    forward_step_func: ForwardStepFunc | LanguageStep,
    data_iterator: Iterator[list[Microbatch]],
    model: nn.Module,
    optimizer: MimoOptimizer,
    schedulers: dict[str, OptimizerParamScheduler],
    global_state: GlobalState,
    multimodule_communicator: Transport,
    multimodule_pg_collection: MultiModuleProcessGroupCollection | None = None,
    infra: MimoModelInfra | None = None,
    module_to_grid_tuple: Sequence[tuple[Any, HyperCommGrid]] | None = None,
    num_microbatches: int | None = None,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
) -> tuple[dict[str, float], bool, float | None, int | None]:
    """Run one training iteration on this rank (Megatron-Bridge's signature).

    Args:
        forward_step_func: the language step function (see ``default_forward_step``)
            or a ``LanguageStep`` around one (the loop passes one, to read its
            auxiliary metrics).
        data_iterator: yields the step's micro-batches for this rank.
        model: the ``MimoModel`` holding this rank's modules.
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module ``OptimizerParamScheduler`` (active modules).
        global_state: config, timers, train state.
        multimodule_communicator: the run's transport (``build_transport``: the
            pipeline communicator, or the colocated transport).
        multimodule_pg_collection: this rank's groups (``None``: ``infra``'s); its data
            parallel groups reduce the gradients. Must match ``infra``'s.
        infra: grids and process groups (required, although Bridge's order puts it after
            an optional argument).
        module_to_grid_tuple: ``(module part or name, grid)`` for each module on this
            rank (``None``: from ``model`` and ``infra``); the parts whose gradients are
            zeroed and reduced. Must match ``model`` and ``infra``.
        num_microbatches: must equal the config's (``None``: from the config).
        seq_length: must equal ``data.seq_length`` (``None``: from the config).
        micro_batch_size: must equal ``train.micro_batch_size`` (``None``: from the config).

    Returns:
        ``(loss_dict, skipped_iter, grad_norm, num_zeros_in_grad)``; identical on all ranks.
        ``loss_dict`` holds floats: ``loss`` (per token), ``num_tokens``, ``accuracy``
        and ``num_samples``.

    Raises:
        ValueError: ``infra`` is missing, or an optional argument contradicts ``infra``
            or the config (the message names it), or a custom ``forward_step_func`` with
            a context-parallel language model.
    """
    infra = require_infra(infra, multimodule_pg_collection)
    check_forward_step(forward_step_func, infra.layout.modules[LANGUAGE].parallel.context)
    pgs = resolve_pg_collection(multimodule_pg_collection, infra)
    check_batch_geometry(global_state.cfg, num_microbatches, seq_length, micro_batch_size)
    parts = resolve_module_parts(module_to_grid_tuple, module_parts(model), infra)
    cfg, timers = global_state.cfg, global_state.timers
    device = global_state.runtime.device
    timers("data").start()
    # Host batches go to the device here (a no-op on the CPU), so any iterator works.
    microbatches = microbatches_to_device(next(data_iterator), device)
    timers("data").stop()
    zero_grad_buffer_for_multimodule(parts)
    token_count = GlobalTokenCount(microbatches, infra, device)  # waited for on first use
    # A frozen tower (freeze = "encoder") is left out by requires_grad, not by name.
    frozen = {n for n, m in cfg.modules.items() if m.fully_frozen}
    sharded = {n for n, info in optimizer.module_infos.items() if info.zero is not None}
    bucket_bytes = int(cfg.train.grad_bucket_mb * 2**20)
    pg_dict = dict(pgs.items())
    zero = {n: info.zero for n, info in optimizer.module_infos.items()
            if info.zero is not None and info.is_active and n in parts}
    for shards in zero.values():  # forget reduce-scatters of a step that raised
        shards.zero_model_grads()
    # Plain, overlapped or ZeRO-1: one finalisation (mimotron.parallel.grad_sync).
    # FSDP2 modules reduce-scatter their gradients in their own backward hooks.
    fsdp = fsdp_modules(cfg)
    grad_sync = GradSync({n: p for n, p in parts.items() if n not in fsdp}, pg_dict, frozen,
                         bucket_bytes, zero,
                         overlap=cfg.train.overlap_grad_reduce, sharded=sharded)
    timers("forward-backward").start()
    ctx = StepContext(
        model=model, layout=infra.layout, rank=infra.rank, microbatches=microbatches,
        language=LanguageStep.of(forward_step_func), transport=multimodule_communicator,
        token_count=token_count.value, loss_scale=float(optimizer.get_loss_scale()),
        autocast=autocast_factory(cfg.train.precision, device), grad_sync=grad_sync,
        encoder_batching=cfg.train.encoder_batching)
    schedule = (forward_backward_pipelining_without_interleaving
                if cfg.train.schedule == "1f1b" else forward_backward_no_pipelining)
    try:
        # One 16-bit copy of each weight for the step's micro-batches, freed before the
        # optimizer changes the weights (mimotron.training.precision).
        with step_cast_scope(cfg.train.precision, device):
            outputs = schedule(ctx)
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
        local_output_sums(outputs, infra, device))
    if success:
        for scheduler in schedulers.values():
            scheduler.step()
    timers("optimizer").stop(sync=True)
    sums = named_sums(reduced)
    loss = sums["loss_sum"] / max(num_tokens, 1.0)
    loss_dict = {"loss": loss, "num_tokens": num_tokens,
                 "accuracy": sums["correct"] / max(sums["samples"], 1.0),
                 "num_samples": sums["samples"]}
    return loss_dict, not success, grad_norm, num_zeros
