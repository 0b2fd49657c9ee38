"""Start a new run from another run's weights: ``checkpoint.pretrained`` (fine-tuning).

A resume (``checkpoint.load``) continues a run: its iteration, optimizer, schedules,
data position and RNG. A fine-tune is a *new* run that starts from a checkpoint's
weights, Megatron's ``--finetune``: iteration 0, a fresh optimizer and fresh schedules,
the data from the start, in its own log.dir. LLaVA's stage 2 is one: it loads stage
1's weights (the trained projectors) and trains projector and language model with its
own schedule. It is read only when the run starts fresh, so a preempted fine-tune that
saved resumes its own checkpoints (:mod:`mimotron.run_dir`).

Two sources:

* a **mimotron checkpoint** (any layout, any precision): the weights travel through
  DCP like a resume's, re-cut to this run's TP / PP / DP / ZeRO / FSDP layout, and
  nothing else is asked for unless ``checkpoint.pretrained_optimizer`` (the Adam
  moments and loss scales; a module without state there, frozen when saved, starts
  fresh) or ``checkpoint.pretrained_schedule`` (the iteration, the schedules and the
  data position: the run continues the count where the checkpoint stopped, its RNG
  re-derived as on a new layout) says so. The optimizer is not even materialised
  otherwise: its first step is a fresh AdamW's;
* a **``mimotron export`` folder** (``config.json`` and ``<module>.safetensors``):
  weights only. Every rank reads the full tensors of the parameters it holds, one at a
  time, and copies out its own shard (``distribute_tensor`` with local slicing, no
  communication).

Either way every model tensor this rank holds must be found at its full shape, of a
dtype that loads into it, and finite (:mod:`mimotron.models.weight_checks`); a damaged
file is named. Any rank that finds a problem makes every rank raise the same error
before any weight is used.

What a run starts from is chosen here as well (:func:`maybe_load_checkpoint`): the
checkpoint ``checkpoint.load`` resolves to (a resume, :mod:`mimotron.checkpoint.load`),
else ``checkpoint.pretrained``, else nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from mimotron.checkpoint.files import CheckpointError, read_manifest, resolve_load
from mimotron.checkpoint.load import (
    agree_on_problems,
    checked_iteration,
    load_checkpoint,
    log,
    read_checkpoint,
    read_metadata,
    restore_fresh_scalers,
    say_fresh,
)
from mimotron.checkpoint.state import (
    MODEL,
    VOCAB_SIZE_UNPADDED,
    apply_loaded,
    build_load_request,
    model_state,
    rederive_rng,
)
from mimotron.config.hf_files import open_safetensors
from mimotron.models.lora import is_lora_parameter
from mimotron.models.weight_checks import capped, dtype_problem, nonfinite_problem
from mimotron.names import ENCODER_PREFIX, LANGUAGE, LANGUAGE_MODEL_PREFIX
from mimotron.run_dir import MODULE_FILE, describe_pretrained, pretrained_source

if TYPE_CHECKING:
    from torch import nn

    from mimotron.optim.mimo_optimizer import MimoOptimizer
    from mimotron.optim.scheduler import OptimizerParamScheduler
    from mimotron.training.infra import MimoModelInfra
    from mimotron.training.state import GlobalState

__all__ = ["load_pretrained", "maybe_load_checkpoint"]


def maybe_load_checkpoint(
    model: nn.Module, optimizer: MimoOptimizer, schedulers: dict[str, OptimizerParamScheduler],
    global_state: GlobalState, infra: MimoModelInfra,
) -> int | None:
    """Apply ``checkpoint.load`` (``auto`` / ``none`` / a path) to a freshly set-up run.

    A run that starts fresh with ``checkpoint.pretrained`` loads that checkpoint's (or
    export's) weights instead (:func:`load_pretrained`).
    Call before the data iterator is created: the restored ``consumed_samples`` is the
    data position. Collective when a checkpoint is loaded (every rank resolves the same
    path, so every rank takes the same branch).

    Returns:
        The iteration resumed from (or continued from ``pretrained`` with
        ``pretrained_schedule``), or None when starting at iteration 0.

    Raises:
        ValueError: an invalid ``checkpoint.load`` or ``checkpoint.pretrained`` (before
            any collective).
        CheckpointError: see :func:`~mimotron.checkpoint.load.load_checkpoint`.
    """
    cfg = global_state.cfg
    path = resolve_load(cfg.checkpoint.load, cfg.checkpoint_dir)
    if path is not None:
        return load_checkpoint(path, model, optimizer, schedulers, global_state, infra)
    source = pretrained_source(cfg)
    if source is not None:
        return load_pretrained(source, model, optimizer, schedulers, global_state, infra)
    if cfg.checkpoint.load == "auto":
        log(global_state.runtime.rank, f"no checkpoint in {cfg.checkpoint_dir}; starting fresh")
    return None


def load_pretrained(source: tuple[Path, bool], model: nn.Module, optimizer: MimoOptimizer,
                    schedulers: dict[str, OptimizerParamScheduler], global_state: GlobalState,
                    infra: MimoModelInfra, process_group: Any = None) -> int | None:
    """Load ``checkpoint.pretrained`` into a freshly set-up run (collective over the world).

    Args:
        source: ``(path, is_export)`` from :func:`mimotron.run_dir.pretrained_source`.
        model: this rank's ``MimoModel`` (loaded in place).
        optimizer: the ``MimoOptimizer`` (loaded only with ``pretrained_optimizer``; its
            ZeRO-1 fp32 masters take the weights in any case).
        schedulers: per-module schedulers (loaded only with ``pretrained_schedule``).
        global_state: config, runtime; its train state is set only with
            ``pretrained_schedule``.
        infra: the run's ``MimoModelInfra``.
        process_group: group over all ranks; None = the default group.

    Returns:
        The iteration the run continues from with ``pretrained_schedule``, else None
        (the run starts at iteration 0).

    Raises:
        CheckpointError: a tensor missing, of another shape, of a dtype that does not
            load or holding NaN or infinities, a vocabulary that differs, or a damaged
            checkpoint or file; raised on every rank alike.
    """
    path, is_export = source
    optimizer.finish_param_gather()  # a late all-gather would overwrite the loaded rows
    if is_export:
        _load_export(path, model, optimizer, global_state, process_group)
        iteration = None
    else:
        iteration = _load_checkpoint(path, model, optimizer, schedulers, global_state,
                                     infra, process_group)
    cfg, ts, ck = global_state.cfg, global_state.train_state, global_state.cfg.checkpoint
    start = (f"continuing at iteration {ts.iteration} ({ts.consumed_samples} samples "
             "consumed)" if iteration is not None else "starting at iteration 0")
    fresh = [what for what, on in (("a fresh optimizer", not ck.pretrained_optimizer),
                                   ("fresh schedules", not ck.pretrained_schedule)) if on]
    rest = f" with {' and '.join(fresh)}" if fresh else ""
    log(global_state.runtime.rank,
        f"a new run from {describe_pretrained(cfg, source)}: {start}{rest}")
    return iteration


def _load_checkpoint(path: Path, model: nn.Module, optimizer: MimoOptimizer,
                     schedulers: dict[str, OptimizerParamScheduler], global_state: GlobalState,
                     infra: MimoModelInfra, process_group: Any) -> int | None:
    """The checkpoint source: weights (and what the config keeps) through DCP."""
    ck, runtime = global_state.cfg.checkpoint, global_state.runtime
    manifest = read_manifest(path)
    metadata = read_metadata(path, manifest)
    fresh_scalers = {n: i.loss_scaler.state_dict() for n, i in optimizer.module_infos.items()}
    req = build_load_request(model, optimizer, schedulers, global_state, metadata, False,
                             optimizer_state=ck.pretrained_optimizer,
                             schedule=ck.pretrained_schedule, fresh_adapters=True)
    read_checkpoint(path, manifest, req, runtime.rank, process_group, metadata)
    meta, fresh = apply_loaded(req, optimizer, schedulers, global_state)
    _check_vocabulary(path, meta, global_state)
    if ck.pretrained_optimizer:
        restore_fresh_scalers(meta, fresh_scalers, optimizer, global_state)
    if not ck.pretrained_schedule:
        return None
    say_fresh(fresh, path, infra)
    iteration = checked_iteration(path, meta, manifest)
    rederive_rng(global_state.cfg.train.seed, iteration, runtime.rank)
    return iteration


def _check_vocabulary(path: Path, meta: dict[str, Any], global_state: GlobalState) -> None:
    """The same tokenizer: a padded embedding can fit while its rows mean other tokens."""
    saved, here = meta.get(VOCAB_SIZE_UNPADDED), global_state.vocab_size_unpadded
    if saved is not None and here is not None and int(saved) != int(here):
        raise CheckpointError(
            f"checkpoint.pretrained={str(path)!r} was trained with a vocabulary of {saved} "
            f"tokens, this run's tokenizer has {here}: use the tokenizer it was trained with")


def _load_export(path: Path, model: nn.Module, optimizer: MimoOptimizer,
                 global_state: GlobalState, process_group: Any) -> None:
    """The export source: each rank copies its shards out of the full tensors."""
    targets = model_state(model, optimizer)  # ZeRO-1 16-bit modules: their fp32 masters
    # LoRA adapters a model trained without them lacks keep their initial values.
    targets = {k: v for k, v in targets.items()
               if not (is_lora_parameter(k) and not _exported(path, k))}
    rank = global_state.runtime.rank
    problems = _check_export_tensors(path, targets)
    agree_on_problems([f"rank {rank}: {p}" for p in problems], str(path), process_group)
    nonfinite: list[str] = []
    with torch.no_grad():
        for module, names in _by_module(targets).items():
            file = path / MODULE_FILE.format(module)
            with open_safetensors(file) as f:
                for key, inner in names:
                    full = f.get_tensor(inner)
                    bad = nonfinite_problem(str(file), inner, full)
                    nonfinite += [bad] if bad else []
                    _copy_full(targets[key], full)
    # Every rank read the full tensors it holds, but not every rank holds each tensor.
    agree_on_problems(capped(nonfinite), str(path), process_group)
    optimizer.load_master_weights()  # casts the masters into 16-bit weights (collective)


def _exported(path: Path, key: str) -> bool:
    """Whether the export holds the ``model.<name>`` entry ``key`` (from a header)."""
    ((module, names),) = _by_module({key: torch.empty(0)}).items()
    file = path / MODULE_FILE.format(module)
    if not file.is_file():
        return False
    with open_safetensors(file) as f:
        return names[0][1] in set(f.keys())


def _by_module(targets: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, str]]]:
    """``model.<name>`` keys grouped by module: ``{module: [(key, name in module)]}``."""
    out: dict[str, list[tuple[str, str]]] = {}
    for key in targets:
        name = key[len(MODEL):]
        if name.startswith(LANGUAGE_MODEL_PREFIX):
            module, inner = LANGUAGE, name[len(LANGUAGE_MODEL_PREFIX):]
        else:
            assert name.startswith(ENCODER_PREFIX), name
            module, _, inner = name[len(ENCODER_PREFIX):].partition(".")
        out.setdefault(module, []).append((key, inner))
    return out


def _check_export_tensors(path: Path, targets: dict[str, torch.Tensor]) -> list[str]:
    """Tensors this rank needs that the export lacks or holds at another shape or a
    dtype that does not load, and damaged files: from the headers, nothing read."""
    problems = []
    for module, names in _by_module(targets).items():
        file = path / MODULE_FILE.format(module)
        try:
            with open_safetensors(file) as f:
                problems += _check_file(file, f, [(inner, targets[key]) for key, inner in names])
        except ValueError as exc:  # a damaged file, named
            problems.append(str(exc))
    return problems


def _check_file(file: Path, handle: Any, names: list[tuple[str, torch.Tensor]]) -> list[str]:
    """One open export file against the tensors this rank loads from it."""
    problems = []
    held = set(handle.keys())
    for inner, target in names:
        if inner not in held:
            problems.append(f"{file.name} has no {inner}")
            continue
        header = handle.get_slice(inner)
        shape = tuple(header.get_shape())
        if shape != tuple(target.shape):
            problems.append(f"{file.name}: {inner} {shape} vs {tuple(target.shape)} here")
        bad = dtype_problem(str(file), inner, header.get_dtype(), target.dtype)
        problems += [bad] if bad else []
    return problems


def _copy_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` (the whole tensor) into ``target`` in place."""
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank slices its own shard, nothing is communicated.
        full = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements,
                                 src_data_rank=None).to_local()
        target = target.to_local()
    target.copy_(full)

