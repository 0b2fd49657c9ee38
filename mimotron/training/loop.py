"""The training loop: ``setup_mimo`` builds a run, ``train_mimo`` drives it.

``train_mimo`` keeps Megatron-Bridge's shape: it takes the forward step, the model, the
optimizer, per-module schedulers, data, ``GlobalState`` and the infra, and runs until an
exit condition; everything it needs is passed in, so it serves library users with their
own model or forward step as well as ``mimotron train``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mimotron.config import MimoConfig
from mimotron.data import build_datasets
from mimotron.data.tokenizer import CharTokenizer
from mimotron.models.build import build_mimo_model
from mimotron.optim import build_schedulers, get_mimo_optimizer
from mimotron.pipeline.communicator import MultiModulePipelineCommunicator, build_edges
from mimotron.runtime import Runtime, compute_dtype, peak_memory_bytes, seed_everything
from mimotron.training.data_provider import (
    MicrobatchProvider,
    make_pad_sample,
    padded_reader,
    train_iterator,
)
from mimotron.training.evaluate import evaluate
from mimotron.training.infra import MimoModelInfra, build_infra
from mimotron.training.metrics import MetricsWriter, StepClock
from mimotron.training.state import GlobalState
from mimotron.training.step import default_forward_step, train_step_mimo


@dataclass
class MimoRun:
    """Everything ``train_mimo`` needs, as built by ``setup_mimo``."""

    model: nn.Module
    optimizer: Any
    schedulers: dict[str, Any]
    train_data_iterator: Iterator
    valid_data_iterator: Callable[[], Iterator] | None
    global_state: GlobalState
    infra: MimoModelInfra
    communicator: MultiModulePipelineCommunicator
    tokenizer: CharTokenizer


def setup_mimo(cfg: MimoConfig, runtime: Runtime) -> MimoRun:
    """Build grids, groups, the model slice of this rank, optimizer, schedulers and data.

    Collective: every rank of the world must call it.
    """
    seed_everything(cfg.train.seed)
    infra = build_infra(cfg, runtime.rank, runtime.world_size)
    tokenizer = CharTokenizer()
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    model = build_mimo_model(cfg, tokenizer.vocab_size, placeholders,
                             modules=set(infra.module_names)).to(runtime.device)
    optimizer = get_mimo_optimizer(model, cfg, grids=infra.grids,
                                   pg_collections=infra.pg_collections,
                                   precision=cfg.train.precision)
    schedulers = build_schedulers(cfg, optimizer)
    communicator = MultiModulePipelineCommunicator(
        infra.layout, runtime.rank, cfg.train.micro_batch_size, build_edges(cfg, infra.layout),
        compute_dtype(cfg.train.precision), runtime.device)
    train_task, valid_task = build_datasets(cfg, tokenizer)
    state = GlobalState(cfg, runtime)
    provider = MicrobatchProvider(infra.layout, runtime.rank, cfg.train.micro_batch_size,
                                  cfg.data.seq_length, train_task.stream(cfg.train.seed).samples,
                                  _collate_kwargs(train_task))
    train_iter = train_iterator(provider, state.train_state.consumed_samples,
                                cfg.train.global_batch_size)
    valid_iter = _valid_factory(cfg, infra, runtime, valid_task)
    return MimoRun(model, optimizer, schedulers, train_iter, valid_iter, state, infra,
                   communicator, tokenizer)


def _collate_kwargs(task: Any) -> dict[str, Any]:
    return {"pad_id": task.pad_id, "image_shape": task.image_shape,
            "audio_shape": task.audio_shape}


def _valid_factory(cfg: MimoConfig, infra: MimoModelInfra, runtime: Runtime, task: Any
                   ) -> Callable[[], Iterator]:
    provider = MicrobatchProvider(infra.layout, runtime.rank, cfg.train.micro_batch_size,
                                  cfg.data.seq_length, padded_reader(task, make_pad_sample(task)),
                                  _collate_kwargs(task))
    gbs = cfg.train.global_batch_size
    num_steps = math.ceil(len(task) / gbs)
    if cfg.eval.iters:
        num_steps = min(num_steps, cfg.eval.iters)

    def steps() -> Iterator:
        for k in range(num_steps):
            yield provider.step(k * gbs, cfg.num_microbatches)

    return steps


def _module_lrs(optimizer: Any, cfg: MimoConfig, device: torch.device) -> dict[str, float]:
    """Each module's current lr, known to every rank (world MAX over module slots)."""
    names = sorted(cfg.modules)
    vec = torch.zeros(len(names), dtype=torch.float64, device=device)
    for group in optimizer.param_groups:
        vec[names.index(group["module"])] = max(vec[names.index(group["module"])], group["lr"])
    dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return {n: float(vec[i]) for i, n in enumerate(names) if not cfg.modules[n].freeze}


def train_mimo(
    forward_step_func: Callable[..., Any],
    model: nn.Module,
    optimizer: Any,
    schedulers: dict[str, Any],
    train_data_iterator: Iterator,
    valid_data_iterator: Callable[[], Iterator] | None,
    global_state: GlobalState,
    mimo_infra: MimoModelInfra,
    multimodule_communicator: MultiModulePipelineCommunicator,
) -> dict[str, Any]:
    """Train until ``train.iters`` (or another exit condition); evaluate and log.

    Returns:
        A summary (final iteration, last loss, last eval metrics, wall time) — the same
        on every rank.
    """
    cfg, ts, runtime = global_state.cfg, global_state.train_state, global_state.runtime
    writer = None
    if mimo_infra.is_logging_rank:
        writer = MetricsWriter(cfg.log_dir, cfg.train.iters, cfg.log.tensorboard,
                               cfg.log.progress, append=ts.iteration > 0)
    model.train()
    clock, start = StepClock(), time.monotonic()
    summary: dict[str, Any] = {"eval": {}}
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_length
    run_eval = lambda: _evaluate_and_log(  # noqa: E731
        forward_step_func, valid_data_iterator, model, multimodule_communicator, mimo_infra,
        global_state, writer)
    try:
        while ts.iteration < cfg.train.iters:
            loss_dict, skipped, grad_norm, num_zeros = train_step_mimo(
                forward_step_func, train_data_iterator, model, optimizer, schedulers,
                global_state, multimodule_communicator, mimo_infra)
            ts.iteration += 1
            ts.consumed_samples += cfg.train.global_batch_size
            ts.skipped_iters += int(skipped)
            ts.consecutive_skips = ts.consecutive_skips + 1 if skipped else 0
            if not math.isfinite(loss_dict["loss"]):
                ts.nan_iters += 1
            summary["loss"] = loss_dict["loss"]
            if ts.iteration % cfg.log.interval == 0 or ts.iteration == cfg.train.iters:
                step_time = clock.lap() / (cfg.log.interval if ts.iteration % cfg.log.interval
                                           == 0 else (ts.iteration % cfg.log.interval))
                record = {
                    "iteration": ts.iteration, "loss": loss_dict["loss"], "grad_norm": grad_norm,
                    "lr": _module_lrs(optimizer, cfg, runtime.device),
                    "loss_scale": float(optimizer.get_loss_scale()), "skipped": bool(skipped),
                    "num_zeros": num_zeros, "consumed_samples": ts.consumed_samples,
                    "tokens_per_second": tokens_per_step / step_time,
                    "samples_per_second": cfg.train.global_batch_size / step_time,
                    "step_time_s": step_time, "train_accuracy": loss_dict["accuracy"],
                    "peak_memory_bytes": peak_memory_bytes(runtime.device),
                }
                if writer is not None:
                    writer.write(record)
                    writer.console(record, time.monotonic() - start)
            if ts.consecutive_skips >= cfg.train.max_skipped:
                raise RuntimeError(
                    f"{ts.consecutive_skips} consecutive iterations were skipped (non-finite "
                    f"gradients, last loss {loss_dict['loss']}); stopping. Lower the learning "
                    "rate or check the data (train.max_skipped sets the limit)")
            if valid_data_iterator is not None and ts.iteration % cfg.eval.interval == 0 \
                    and ts.iteration < cfg.train.iters:
                summary["eval"] = run_eval()
                clock.lap()  # Evaluation time is not step time.
        if valid_data_iterator is not None:
            summary["eval"] = run_eval()
    finally:
        if writer is not None:
            writer.close()
    summary.update(iteration=ts.iteration, wall_time_s=time.monotonic() - start,
                   skipped_iters=ts.skipped_iters)
    return summary


def _evaluate_and_log(forward_step_func, valid_data_iterator, model, communicator, infra,
                      global_state, writer) -> dict[str, float]:  # noqa: ANN001
    cfg, runtime = global_state.cfg, global_state.runtime
    metrics = evaluate(forward_step_func, valid_data_iterator(), model, communicator, infra,
                       cfg.train.precision, runtime.device)
    record = {"iteration": global_state.train_state.iteration, **metrics}
    if writer is not None:
        writer.write(record)
        writer.eval_line(record)
    return metrics


def run_training(cfg: MimoConfig, runtime: Runtime,
                 forward_step_func: Callable[..., Any] = default_forward_step) -> dict[str, Any]:
    """Set up and train one run on this rank (what ``mimotron train`` runs per rank)."""
    run = setup_mimo(cfg, runtime)
    return train_mimo(forward_step_func, run.model, run.optimizer, run.schedulers,
                      run.train_data_iterator, run.valid_data_iterator, run.global_state,
                      run.infra, run.communicator)
