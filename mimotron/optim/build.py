"""Build the optimizer and the LR schedulers of a model from the run config.

Kept apart from :mod:`~mimotron.optim.mimo_optimizer` (global consensus over per-module
optimizers) and :mod:`~mimotron.optim.scheduler` (the schedule itself): this file is the
one that knows the config and the model's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from mimotron.config.schema import PRECISIONS, MimoConfig, ModuleConfig, OptimizerConfig
from mimotron.config.setup_rules import check_trainable
from mimotron.models.freeze import is_frozen_parameter
from mimotron.models.mimo import MimoModel, module_part
from mimotron.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from mimotron.optim.mimo_optimizer import MimoOptimizer, ModuleOptimizerInfo
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.parallel.data_parallel import replica_group
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.zero import ExpertSplitShards, ZeroShards, remove_gather_hooks
from mimotron.runtime import compute_dtype


def _check_groups(name: str, grid: Any, pg: ProcessGroupCollection | None) -> None:
    """Without groups a multi-rank module's norm would silently miss its other shards."""
    if grid is None or pg is not None:
        return
    if getattr(grid, "size", 1) > 1 and grid.is_current_rank_in_grid():
        raise ValueError(
            f"module {name!r} spans {grid.size} ranks including this one, but "
            "pg_collections has no entry for it (build it with ProcessGroupCollection.from_grid)"
        )


def _shards(name: str, mcfg: ModuleConfig, named: list[tuple[str, nn.Parameter]],
            pg: ProcessGroupCollection | None, bucket_bytes: int,
            precision: str) -> ZeroShards | ExpertSplitShards | None:
    """Row shards for ``shard_optimizer`` modules with a DP group larger than one.

    Expert-parallel shards split their local rows over ``expt_dp`` instead
    (:class:`~mimotron.parallel.zero.ExpertSplitShards`). Buckets of ``bucket_bytes``
    (``train.grad_bucket_mb``): the overlapped reduce-scatter launches them one by one.
    Under bf16 / fp16 the module's parameters become 16-bit with fp32 masters
    (``param_dtype``, Megatron-Core's distributed optimizer).
    """
    if not (named and mcfg.parallel.shard_optimizer and pg is not None):
        return None
    # dp, or dp x cp for a context-parallel module (its gradients' replica group).
    group = replica_group(pg)
    if group is None or dist.get_world_size(group) < 2:
        return None  # one replica: sharding would change nothing
    experts = [(n, p) for n, p in named if is_expert_param(p)]
    dense = [(n, p) for n, p in named if not is_expert_param(p)]
    dtype = compute_dtype(precision)
    try:
        if experts:
            return ExpertSplitShards(ZeroShards(dense, group, bucket_bytes, param_dtype=dtype),
                                     ZeroShards(experts, pg.expt_dp, bucket_bytes,
                                                expert=True, param_dtype=dtype))
        return ZeroShards(named, group, bucket_bytes, param_dtype=dtype)
    except ValueError as exc:
        raise ValueError(f"modules.{name}.parallel.shard_optimizer=true: {exc}") from None


def _check_frozen(name: str, mcfg: ModuleConfig, module: nn.Module | None) -> None:
    """What ``freeze`` freezes must no longer require gradients (model setup's job)."""
    if module is None or not mcfg.freeze:
        return
    live = [n for n, p in module.named_parameters()
            if p.requires_grad and is_frozen_parameter(mcfg, n)]
    if live:
        raise ValueError(
            f"modules.{name}.freeze={mcfg.freeze!r} but {live[0]} still requires gradients: "
            "call mimotron.training.model_setup.freeze_modules(model, cfg) when building "
            "the model (build_rank_model does)")


def _check_config(config: MimoConfig, precision: str) -> None:
    """Reject, from the config alone, what no rank can build.

    Every rank raises alike, so none is left waiting in a collective.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid: expected one of {PRECISIONS}")
    check_trainable(config)  # The validator's rule (check_layout), for direct callers.


def _loss_scaler(oc: OptimizerConfig, precision: str) -> LossScaler:
    if precision != "fp16":
        return ConstantLossScaler(1.0)
    return DynamicLossScaler(
        oc.initial_loss_scale, oc.min_loss_scale, oc.loss_scale_window, oc.hysteresis
    )


def build_torch_optimizer(
    named_params: list[tuple[str, nn.Parameter]], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """AdamW / Adam / SGD over two groups: decayed, and ``no_decay`` (weight decay 0).

    Groups carry ``wd_mult`` (1 or 0) so a weight-decay schedule skips no-decay groups.
    With ``expert_lr`` or ``expert_weight_decay`` set, the routed experts get two groups
    of their own, with ``lr_mult = expert_lr / lr`` (the scheduler scales their lr).

    Raises:
        ValueError: an unknown optimizer name or no parameters.
    """
    if not named_params:
        raise ValueError("cannot build an optimizer over no parameters")
    groups = _decay_groups([(n, p) for n, p in named_params if not is_routed_expert(n)], cfg)
    experts = [(n, p) for n, p in named_params if is_routed_expert(n)]
    if experts and (cfg.expert_lr is not None or cfg.expert_weight_decay is not None):
        lr_mult = 1.0 if cfg.expert_lr is None else cfg.expert_lr / cfg.lr
        wd = cfg.weight_decay if cfg.expert_weight_decay is None else cfg.expert_weight_decay
        groups += [{**g, "lr_mult": lr_mult} for g in _decay_groups(experts, cfg, wd)]
    else:
        groups = _decay_groups(named_params, cfg)
    if cfg.name in ("adamw", "adam"):
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    raise ValueError(f"optimizer.name={cfg.name!r} is invalid: expected adamw, adam or sgd")


def is_routed_expert(name: str) -> bool:
    """A routed expert's stacked weights (``...mlp.experts.w1``), whatever the layout."""
    return ".experts." in f".{name}"


def _decay_groups(named: list[tuple[str, nn.Parameter]], cfg: OptimizerConfig,
                  weight_decay: float | None = None) -> list[dict[str, Any]]:
    """Decayed and ``no_decay`` groups; ``wd_mult`` (1 or 0) for a weight-decay schedule."""
    wd = cfg.weight_decay if weight_decay is None else weight_decay
    decay = [p for n, p in named if not any(s in n for s in cfg.no_decay)]
    no_decay = [p for n, p in named if any(s in n for s in cfg.no_decay)]
    return [{"params": ps, "weight_decay": w, "wd_mult": mult}
            for ps, w, mult in ((decay, wd, 1.0), (no_decay, 0.0, 0.0)) if ps]


def get_mimo_optimizer(
    mimo_model: MimoModel,
    config: MimoConfig,
    grids: Mapping[str, Any] | None = None,
    pg_collections: Mapping[str, ProcessGroupCollection] | Any | None = None,
    precision: str | None = None,
    world_group: dist.ProcessGroup | None = None,
) -> MimoOptimizer:
    """Build one optimizer per module present on this rank, wrapped in a MimoOptimizer.

    Every module of ``config.modules`` gets an info (inactive where the rank holds none
    of it, the module is frozen, or it has no trainable parameters here), so slots line
    up on all ranks. Each module's clipping threshold and fp16 loss-scaler settings come
    from its effective optimizer config (``[optimizer]`` with its overrides); see
    :mod:`mimotron.optim.mimo_optimizer` for the per-module clipping and loss-scale rules.

    Frozen modules (``modules.<m>.freeze = true``) get no optimizer, a frozen tower
    (``freeze = "encoder"``) is left out of its module's (the projector's parameters
    alone are stepped); freezing parameters (``requires_grad=False``) is model setup's
    job (:func:`mimotron.training.model_setup.freeze_modules`), this factory only reads
    the config and ``requires_grad``. Modules with ``parallel.shard_optimizer``
    and a DP degree above one get a ZeRO-1 optimizer over their DP group
    (:class:`~mimotron.parallel.zero.ZeroShards`): the inner optimizer holds only this
    rank's rows of every parameter; under bf16 / fp16 those rows are fp32 masters and
    the module's parameters are cast to 16 bits here (build the optimizer after the
    model's weights are initialised or loaded: the masters copy them). With
    ``train.overlap_param_gather`` their parameter all-gather after the step is only
    launched, and forward pre-hooks on the
    module's submodules wait for it (:meth:`MimoOptimizer.finish_param_gather`); the
    optimizer keeps those hooks (removed by :meth:`MimoOptimizer.close`, or when another
    optimizer is built on the same model).

    Args:
        mimo_model: has ``modality_submodules[name]`` (encoders) and ``language_model``;
            either may be missing on this rank.
        config: the run config (per-module optimizer overrides apply).
        grids: module name -> HyperCommGrid (only used to catch missing groups).
        pg_collections: module name -> groups, for modules this rank belongs to (a
            dict or a ``MultiModuleProcessGroupCollection``). Required for every module
            that spans more than one rank: its norm needs the module's ``mp``/``dp``.
        precision: ``fp32``/``bf16``/``fp16`` (dynamic loss scaling); ``None`` =
            ``config.train.precision``.
        world_group: group over all ranks; ``None`` = the default group.

    Returns:
        The multi-module optimizer.

    Raises:
        ValueError: an unknown precision or optimizer name, every module frozen, a
            frozen module whose parameters still require gradients, a
            multi-rank grid that contains this rank but has no process-group collection,
            or a sharded module whose parameters cannot be row-sharded.
    """
    precision = config.train.precision if precision is None else precision
    _check_config(config, precision)
    infos: dict[str, ModuleOptimizerInfo] = {}
    hooks: list[RemovableHandle] = []
    for name, mcfg in config.modules.items():
        module = module_part(mimo_model, name)
        if module is not None:  # a previous optimizer's gather hooks go with it
            remove_gather_hooks(module)
        _check_frozen(name, mcfg, module)
        named = [] if module is None or mcfg.fully_frozen else [
            (n, p) for n, p in module.named_parameters() if p.requires_grad
        ]
        grid = grids.get(name) if grids is not None else None
        pg = pg_collections[name] if pg_collections is not None and name in pg_collections else None
        _check_groups(name, grid, pg)
        zero = _shards(name, mcfg, named, pg, int(config.train.grad_bucket_mb * 2**20),
                       precision)
        if zero is not None and config.train.overlap_param_gather:
            hooks += zero.wait_before_forward(module)
        stepped = zero.fragments if zero is not None else named
        oc = config.effective_optimizer(name)
        opt = build_torch_optimizer(stepped, oc) if named else None
        infos[name] = ModuleOptimizerInfo(
            optimizer=opt,
            grid=grid,
            pg_collection=pg,
            is_active=bool(named),
            params=stepped,
            loss_scaler=_loss_scaler(oc, precision),
            frozen=mcfg.fully_frozen,
            zero=zero,
            clip_grad=oc.clip_grad,
        )
    return MimoOptimizer(infos, config.optimizer, world_group,
                         overlap_param_gather=config.train.overlap_param_gather, hooks=hooks)


def build_schedulers(
    cfg: MimoConfig, optimizer: MimoOptimizer
) -> dict[str, OptimizerParamScheduler]:
    """One scheduler per module that has an optimizer on this rank.

    Values come from ``cfg.effective_optimizer(name)`` (lr, min_lr, weight_decay) and
    ``cfg.effective_scheduler(name)``: ``decay_iters = 0`` means ``train.iters``,
    ``min_lr = None`` means the optimizer's ``min_lr``, and unset start/end weight decay
    mean a constant weight decay (the groups keep the value they were built with).

    Args:
        cfg: the run config.
        optimizer: the multi-module optimizer whose active modules get schedules.

    Returns:
        Module name -> scheduler, for active modules only (sorted by name).
    """
    schedulers: dict[str, OptimizerParamScheduler] = {}
    for name, info in optimizer.module_infos.items():
        if not info.is_active or info.optimizer is None:
            continue
        opt = cfg.effective_optimizer(name)
        sched = cfg.effective_scheduler(name)
        start_wd, end_wd = sched.start_weight_decay, sched.end_weight_decay
        if start_wd is None and end_wd is None:
            wd_style = "constant"
        else:
            # Only one end given: the other stays at the optimizer's weight decay.
            start_wd = opt.weight_decay if start_wd is None else start_wd
            end_wd = opt.weight_decay if end_wd is None else end_wd
            wd_style = sched.weight_decay_style
        schedulers[name] = OptimizerParamScheduler(
            info.optimizer,
            max_lr=opt.lr,
            min_lr=opt.min_lr if sched.min_lr is None else sched.min_lr,
            warmup_iters=sched.warmup_iters,
            decay_iters=sched.decay_iters or cfg.train.iters,
            decay_style=sched.decay_style,
            start_wd=start_wd,
            end_wd=end_wd,
            wd_incr_style=wd_style,
        )
    return schedulers
