"""Megatron-Bridge's API over mimotron's core step and loop.

Bridge's ``train_step_mimo`` and ``train_mimo`` take, on every call, what a mimotron run
fixes once: a ``MultiModuleProcessGroupCollection`` for the schedule, ``(module, grid)``
pairs for the gradient operations and the batch geometry (``num_microbatches``,
``seq_length``, ``micro_batch_size``). In mimotron all of them follow from
``MimoModelInfra`` and the config, so the functions here accept them, check that they
agree with the infra and config (a ``ValueError`` naming the argument when they
contradict it), build the run's :class:`~mimotron.training.step.StepRun` and call the
core (:func:`~mimotron.training.step.train_step`, :func:`~mimotron.training.loop.train`).
Megatron's schedule entry points and ``zero_grad_buffer_for_multimodule`` live here too.
Nothing in the library calls this module; it is the seed API users may call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import MultiModuleProcessGroupCollection, ProcessGroupCollection
from mimotron.pipeline.schedules import (
    MicrobatchOutput,
    StepContext,
    Transport,
    rank_actions,
    run_schedule,
)
from mimotron.training.data_provider import Microbatch
from mimotron.training.infra import MimoModelInfra
from mimotron.training.language_step import ForwardStepFunc, LanguageStep, check_forward_step
from mimotron.training.loop import train
from mimotron.training.state import GlobalState
from mimotron.training.step import build_step_run, clear_grads, module_parts, train_step

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer


def require_infra(infra: MimoModelInfra | None, multimodule_pg_collection: Any) -> MimoModelInfra:
    """The step's ``infra``, with a clear error for the pre-Bridge argument order.

    Raises:
        ValueError: ``infra`` is missing, or a ``MimoModelInfra`` was passed where
            Bridge's order puts ``multimodule_pg_collection``.
    """
    if isinstance(multimodule_pg_collection, MimoModelInfra):
        raise ValueError(
            "multimodule_pg_collection is a MimoModelInfra: train_step_mimo takes "
            "Megatron-Bridge's order (..., multimodule_communicator, "
            "multimodule_pg_collection, infra, module_to_grid_tuple, ...); pass infra=...")
    if not isinstance(infra, MimoModelInfra):
        raise ValueError(f"infra must be a MimoModelInfra (from setup_mimo or build_infra); "
                         f"got {type(infra).__name__}")
    return infra


def _ranks(group: Any) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def resolve_pg_collection(given: MultiModuleProcessGroupCollection | None,
                          infra: MimoModelInfra) -> MultiModuleProcessGroupCollection:
    """This rank's multi-module process groups: ``given`` if it matches the infra's.

    Args:
        given: Bridge's ``multimodule_pg_collection`` (``None``: built from the infra).
        infra: the run's infra.

    Returns:
        The collection to use (``given``, or the infra's when ``given`` is ``None``).

    Raises:
        ValueError: ``given`` holds other modules, or a group with other ranks, than the
            infra's collection.
    """
    mine = infra.multimodule_pg_collection
    if given is None or given is mine:
        return mine
    if not isinstance(given, MultiModuleProcessGroupCollection):
        raise ValueError("multimodule_pg_collection must be a MultiModuleProcessGroupCollection"
                         f" or None; got {type(given).__name__}")
    if given.modules != mine.modules or (given.language_model_module_name
                                         != mine.language_model_module_name):
        raise ValueError(
            f"multimodule_pg_collection holds modules {given.modules} (language "
            f"{given.language_model_module_name!r}) but infra places modules {mine.modules} "
            f"(language {mine.language_model_module_name!r}) on rank {infra.rank}")
    for name in mine.modules:
        for f in fields(ProcessGroupCollection):
            ours, theirs = _ranks(getattr(mine[name], f.name)), _ranks(getattr(given[name], f.name))
            if ours != theirs:
                raise ValueError(
                    f"multimodule_pg_collection[{name!r}].{f.name} has ranks {theirs} but "
                    f"infra's has {ours} (rank {infra.rank})")
    return given


def _same_grid(a: Any, b: HyperCommGrid) -> bool:
    if a is b:
        return True
    return isinstance(a, HyperCommGrid) and (a.rank_offset, a.shape, a.dim_names) == (
        b.rank_offset, b.shape, b.dim_names)


def resolve_module_parts(given: Sequence[tuple[Any, Any]] | None, parts: dict[str, nn.Module],
                         infra: MimoModelInfra) -> dict[str, nn.Module]:
    """The module parts whose gradients the step handles: ``given``'s, checked.

    Args:
        given: Bridge's ``module_to_grid_tuple``: ``(module, grid)`` for each module this
            rank holds; ``module`` is the module part (as in Bridge) or its name.
            ``None``: built from the model and the infra.
        parts: this rank's module parts by name (from the model).
        infra: the run's infra (the grids).

    Returns:
        Module name -> part, in ``parts``' order.

    Raises:
        ValueError: a pair is not one of this rank's parts with the infra's grid, or the
            pairs do not cover exactly this rank's parts.
    """
    if given is None:
        return parts
    chosen: set[str] = set()
    for item in given:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise ValueError(f"module_to_grid_tuple items must be (module, grid) pairs; "
                             f"got {item!r}")
        module, grid = item
        name = module if isinstance(module, str) else next(
            (n for n, p in parts.items() if p is module), None)
        if name not in parts:
            what = repr(name) if name is not None else f"a {type(module).__name__}"
            raise ValueError(f"module_to_grid_tuple names {what}, which is not one of this "
                             f"rank's module parts {list(parts)}")
        if not _same_grid(grid, infra.grids[name]):
            raise ValueError(f"module_to_grid_tuple gives module {name!r} the grid {grid!r}, "
                             f"but infra's is {infra.grids[name]!r}")
        chosen.add(name)
    if chosen != set(parts):
        raise ValueError(f"module_to_grid_tuple covers modules {sorted(chosen)} but this rank "
                         f"(rank {infra.rank}) holds {sorted(parts)}")
    return parts


def check_batch_geometry(cfg: MimoConfig, num_microbatches: int | None,
                         seq_length: int | None, micro_batch_size: int | None) -> None:
    """Bridge's batch-geometry arguments must match the config (``None``: from the config).

    Raises:
        ValueError: one of them differs from the config's value.
    """
    for name, given, want, source in (
            ("num_microbatches", num_microbatches, cfg.num_microbatches,
             "train.global_batch_size / train.micro_batch_size"),
            ("seq_length", seq_length, cfg.data.seq_length, "data.seq_length"),
            ("micro_batch_size", micro_batch_size, cfg.train.micro_batch_size,
             "train.micro_batch_size")):
        if given is not None and given != want:
            raise ValueError(f"{name}={given} contradicts the config: {source} gives {want}")


def zero_grad_buffer_for_multimodule(modules: dict[str, nn.Module]) -> None:
    """Clear every module part's gradients before a new step (set to None)."""
    clear_grads(modules)


def forward_backward_pipelining_without_interleaving(ctx: StepContext) -> list[MicrobatchOutput]:
    """1F1B over the module DAG (warm-up / steady / cool-down per rank)."""
    return run_schedule(ctx, rank_actions(ctx.layout, ctx.rank, len(ctx.microbatches),
                                       pipelined=True, forward_only=ctx.forward_only))


def forward_backward_no_pipelining(ctx: StepContext) -> list[MicrobatchOutput]:
    """Micro-batch after micro-batch: each backward finishes before the next forward."""
    return run_schedule(ctx, rank_actions(ctx.layout, ctx.rank, len(ctx.microbatches),
                                       pipelined=False, forward_only=ctx.forward_only))


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
            or a ``LanguageStep`` around one.
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
    resolve_module_parts(module_to_grid_tuple, module_parts(model), infra)
    run = build_step_run(model, optimizer, schedulers, global_state, infra,
                         multimodule_communicator, forward_step_func, pgs)
    timers = global_state.timers
    timers("data").start()  # the step times its device copy under "data" too
    microbatches = next(data_iterator)
    timers("data").stop()
    return tuple(train_step(run, microbatches))


def train_mimo(
    forward_step_func: ForwardStepFunc,
    model: nn.Module,
    optimizer: MimoOptimizer,
    schedulers: dict[str, OptimizerParamScheduler],
    train_data_iterator: Iterator,
    valid_data_iterator: Callable[[], Iterator] | None,
    global_state: GlobalState,
    mimo_infra: MimoModelInfra,
    multimodule_communicator: Transport,
    multimodule_pg_collection: MultiModuleProcessGroupCollection | None = None,
    module_to_grid_tuple: Sequence[tuple[Any, HyperCommGrid]] | None = None,
) -> dict[str, Any]:
    """Train until ``train.iters`` (or another exit condition); evaluate and log.

    Megatron-Bridge's signature (parameter names and order); see docs/operations.md, "Library
    use", for what differs.

    Args:
        forward_step_func: ``(model, batch, embeddings) -> (loss_sum, num_tokens,
            metrics)``, see ``default_forward_step``.
        model: the ``MimoModel`` (this rank's modules).
        optimizer: the ``MimoOptimizer``.
        schedulers: per-module schedulers ``{module: OptimizerParamScheduler}``.
        train_data_iterator: yields each step's micro-batches for this rank.
        valid_data_iterator: ``None`` (no evaluation), or a callable returning a fresh
            iterator over the validation steps, called at each evaluation.
        global_state: config, runtime, timers, train state.
        mimo_infra: grids, process groups and roles of this rank.
        multimodule_communicator: the run's transport (``build_transport``).
        multimodule_pg_collection: this rank's process groups for the step (``None``:
            ``mimo_infra``'s); must match ``mimo_infra``'s.
        module_to_grid_tuple: ``(module part or name, grid)`` for each module on this
            rank, for the gradient operations (``None``: from ``model`` and
            ``mimo_infra``); must match them.

    Returns:
        A summary (final iteration, last loss, last eval metrics, wall time) — the same
        on every rank.

    Raises:
        ValueError: ``multimodule_pg_collection`` or ``module_to_grid_tuple``
            contradicts ``mimo_infra`` or ``model`` (the message names the argument), or
            a custom ``forward_step_func`` with a context-parallel language model.
    """
    check_forward_step(forward_step_func, mimo_infra.layout.modules[LANGUAGE].parallel.context)
    pgs = resolve_pg_collection(multimodule_pg_collection, mimo_infra)
    resolve_module_parts(module_to_grid_tuple, module_parts(model), mimo_infra)
    run = build_step_run(model, optimizer, schedulers, global_state, mimo_infra,
                         multimodule_communicator, LanguageStep(forward_step_func), pgs)
    return train(run, train_data_iterator, valid_data_iterator)
