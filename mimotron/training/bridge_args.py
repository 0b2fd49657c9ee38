"""Megatron-Bridge's extra ``train_mimo`` / ``train_step_mimo`` arguments, checked.

Bridge passes the step a ``MultiModuleProcessGroupCollection`` for the schedule, a list
of ``(module, grid)`` pairs for the gradient operations and the batch geometry
(``num_microbatches``, ``seq_length``, ``micro_batch_size``); ``train_mimo`` builds the
first two from the infra when they are ``None``. In mimotron all of them follow from
``MimoModelInfra`` and the config, so the functions here accept them, check that they
agree with the infra and config (a ``ValueError`` naming the argument when they
contradict it), and return what the step then uses: the process groups of its gradient
reduction and the module parts whose gradients it zeroes and reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import torch.distributed as dist
from torch import nn

from mimotron.config import MimoConfig
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import MultiModuleProcessGroupCollection, ProcessGroupCollection
from mimotron.training.infra import MimoModelInfra


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
