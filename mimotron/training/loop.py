"""The training loop: ``setup_mimo`` builds a run, :func:`train` drives it.

:func:`train` takes the step's fixed inputs (a :class:`~mimotron.training.step.StepRun`)
and the data, and runs until an exit condition, calling
:func:`~mimotron.training.step.train_step` once per iteration. Everything it needs is
passed in, so it serves library users with their own model or forward step as well as
``mimotron train``; Megatron-Bridge's ``train_mimo`` is a thin layer over it
(:mod:`mimotron.training.megatron_compat`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from mimotron.checkpoint import CheckpointManager, maybe_load_checkpoint
from mimotron.config.schema import MimoConfig
from mimotron.config.vocab_size import padded_vocab_size, unpadded_vocab_size
from mimotron.data import build_datasets
from mimotron.data.data_summary import summarize_data
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.prefetch import PrefetchingReader
from mimotron.data.run_data import build_tokenizer, restrict_to_rank
from mimotron.data.tokenizer import CharTokenizer
from mimotron.optim import build_schedulers, get_mimo_optimizer
from mimotron.optim.scheduler import OptimizerParamScheduler
from mimotron.parallel.layout import Layout
from mimotron.pipeline.deepstack_link import model_link_extras
from mimotron.pipeline.edges import build_edges
from mimotron.pipeline.schedules import Transport, build_transport
from mimotron.pipeline.shapes import bridge_row_shapes, residual_dtype
from mimotron.run_dir import guard_fresh_start
from mimotron.runtime import Runtime, seed_everything
from mimotron.training.balanced_batches import Balance
from mimotron.training.data_provider import (
    Microbatch,
    MicrobatchProvider,
    PackedMicrobatchProvider,
    PackedTrainIterator,
    StepPrefetcher,
    make_pad_sample,
    media_reader,
    padded_reader,
    stream_lengths,
    train_iterator,
)
from mimotron.training.evaluate import evaluate
from mimotron.training.infra import MimoModelInfra, build_infra
from mimotron.training.language_step import ForwardStepFunc, LanguageStep, default_forward_step
from mimotron.training.metrics import LoopMonitor, check_divergence
from mimotron.training.model_setup import build_rank_model
from mimotron.training.profiling import StepProfiler, inject_fault
from mimotron.training.state import GlobalState, TrainState
from mimotron.training.step import StepRun, build_step_run, train_step

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer


@dataclass
class MimoRun:
    """Everything ``train_mimo`` needs, as built by ``setup_mimo``."""

    model: nn.Module
    optimizer: MimoOptimizer
    schedulers: dict[str, OptimizerParamScheduler]
    train_data_iterator: Iterator
    valid_data_iterator: Callable[[], Iterator] | None
    global_state: GlobalState
    infra: MimoModelInfra
    communicator: Transport
    tokenizer: CharTokenizer | HFTokenizer
    data_reader: PrefetchingReader | None = None
    """The training data's background loader (``data.num_workers > 0``); close it after."""


def setup_mimo(cfg: MimoConfig, runtime: Runtime) -> MimoRun:
    """Build grids, groups, the model slice of this rank, optimizer, schedulers and data.

    Collective: every rank of the world must call it.
    """
    # Data first: every bad sample is found before the first collective (build_infra),
    # the same way on every rank; building it draws nothing from the seeded generators.
    tokenizer = build_tokenizer(cfg)
    train_task, valid_task = build_datasets(cfg, tokenizer)
    seed_everything(cfg.train.seed)
    infra = build_infra(cfg, runtime.rank, runtime.world_size)
    for task in (train_task, valid_task):  # one dataset for both, or one each (valid_path)
        restrict_to_rank(task, cfg, infra.layout, runtime.rank)
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    model = build_rank_model(cfg, infra, padded_vocab_size(tokenizer.vocab_size), placeholders,
                             runtime.device)
    optimizer = get_mimo_optimizer(model, cfg, grids=infra.grids,
                                   pg_collections=infra.pg_collections,
                                   precision=cfg.train.precision)
    schedulers = build_schedulers(cfg, optimizer)
    communicator = build_transport(
        infra.layout, runtime.rank, cfg.train.micro_batch_size,
        build_edges(infra.layout, model.modality_of, cfg.data.balance_encoders),
        {n: pg.tp for n, pg in infra.pg_collections.items()}, runtime.device,
        cfg.data.seq_length, getattr(model.language_model, "hidden_size", None),
        bridge_row_shapes(cfg, infra.layout),
        link_timeout=timedelta(seconds=cfg.train.pg_timeout_s),
        stage_dtype=residual_dtype(cfg, runtime.device), deepstack=model_link_extras(model))
    state = GlobalState(cfg, runtime)
    state.skipped_samples = getattr(train_task, "num_skipped", None)
    if infra.is_logging_rank and cfg.log.progress:  # what the banner shows; nothing is read
        state.data_summary = summarize_data(cfg, train_task, valid_task)
    state.vocab_size_unpadded = unpadded_vocab_size(cfg, tokenizer.vocab_size)
    # Before the data iterator: the restored consumed_samples is the data position.
    maybe_load_checkpoint(model, optimizer, schedulers, state, infra)
    stream = train_task.stream(cfg.train.seed)
    # 0 workers: the stream itself, exactly today's synchronous path.
    reader = PrefetchingReader(stream, cfg.data.num_workers) if cfg.data.num_workers else None
    train_iter = train_steps(cfg, infra.layout, runtime.rank, train_task, stream,
                             state.train_state.consumed_samples, reader)
    if cfg.data.num_workers:  # the next step is collated (and pinned) during this one
        train_iter = StepPrefetcher(train_iter, runtime.device)
    valid_iter = valid_steps(cfg, infra.layout, runtime.rank, valid_task)
    return MimoRun(model, optimizer, schedulers, train_iter, valid_iter, state, infra,
                   communicator, tokenizer, reader)


def train_steps(cfg: MimoConfig, layout: Layout, rank: int, task: Any, stream: Any,
                start: int, reader: PrefetchingReader | None = None
                ) -> Iterator[list[Microbatch]]:
    """``rank``'s micro-batches of each training step from stream position ``start``
    (read through ``reader`` where there is one); host tensors."""
    provider_args = (layout, rank, cfg.train.micro_batch_size, cfg.data.seq_length,
                     reader.samples if reader is not None else stream.samples,
                     _collate_kwargs(task))
    balance = Balance.from_config(cfg)
    # Packing decides rows from lengths known on every rank where the task has them (llava).
    media = media_reader(cfg, layout, rank, task, (reader or stream).load)
    provider = (PackedMicrobatchProvider(*provider_args, lengths_at=stream_lengths(stream),
                                         balance=balance)
                if cfg.data.packing else MicrobatchProvider(*provider_args, balance=balance,
                                                            media=media))
    iterator_type = PackedTrainIterator if cfg.data.packing else train_iterator
    return iterator_type(provider, start, cfg.train.global_batch_size)


def _reader_of(task: Any) -> Any:
    """``f(positions, parts)`` over a finite split in order (its positions are indices)."""
    return lambda positions, parts: task.get_many([(p, 0) for p in positions], parts)


def _collate_kwargs(task: Any) -> dict[str, Any]:
    return {"pad_id": task.pad_id, "image_shape": task.image_shape,
            "audio_shape": task.audio_shape}


def valid_steps(cfg: MimoConfig, layout: Layout, rank: int, task: Any
                ) -> Callable[[], Iterator]:
    """A callable giving a fresh iterator over ``rank``'s evaluation steps."""
    provider = MicrobatchProvider(layout, rank, cfg.train.micro_batch_size,
                                  cfg.data.seq_length, padded_reader(task, make_pad_sample(task)),
                                  _collate_kwargs(task),
                                  # the bridges expect dealt items (data.balance_encoders)
                                  Balance(encoders=Balance.from_config(cfg).encoders),
                                  media_reader(cfg, layout, rank, task, _reader_of(task)))
    gbs = cfg.train.global_batch_size
    num_steps = math.ceil(len(task) / gbs)
    if cfg.eval.iters:
        num_steps = min(num_steps, cfg.eval.iters)

    def steps() -> Iterator:
        for k in range(num_steps):
            yield provider.step(k * gbs, cfg.num_microbatches)

    return steps


def train(run: StepRun, train_data_iterator: Iterator,
          valid_data_iterator: Callable[[], Iterator] | None) -> dict[str, Any]:
    """Train until ``train.iters`` (or another exit condition); evaluate and log.

    Args:
        run: the step's fixed inputs (:func:`~mimotron.training.step.build_step_run`).
        train_data_iterator: yields each step's micro-batches for this rank.
        valid_data_iterator: ``None`` (no evaluation), or a callable returning a fresh
            iterator over the validation steps, called at each evaluation.

    Returns:
        A summary (final iteration, last loss, last eval metrics, wall time) — the same
        on every rank.
    """
    model, optimizer, schedulers = run.model, run.optimizer, run.schedulers
    global_state, mimo_infra, multimodule_communicator = run.state, run.infra, run.transport
    cfg, ts, runtime = global_state.cfg, global_state.train_state, global_state.runtime
    guard_fresh_start(cfg, ts.iteration, runtime.world_size)  # Before anything is written.
    language = run.language  # Also collects the auxiliary metrics.
    profiler = StepProfiler(cfg.profile, cfg.log_dir, runtime.rank, runtime.world_size)
    monitor = LoopMonitor(global_state, mimo_infra, model, optimizer)
    model.train()
    checkpoints = CheckpointManager(model, optimizer, schedulers, global_state, mimo_infra)
    summary: dict[str, Any] = {"eval": {}}
    run_eval = lambda: _evaluate_and_log(  # noqa: E731
        language, valid_data_iterator, model, multimodule_communicator, mimo_infra,
        global_state, monitor)
    try:
        monitor.banner()
        multimodule_communicator.set_timing(True)  # Training steps report transfer time.
        # A stop signal during set-up: stop before the first step (nothing to save).
        started = not checkpoints.stop_before_start()
        while started and ts.iteration < cfg.train.iters:
            profiler.before_step(ts.iteration + 1)
            # The loop fetches the step's data: the sample count and the fault hook need it.
            global_state.timers("data").start()
            microbatches = next(train_data_iterator)
            global_state.timers("data").stop()
            inject_fault(ts.iteration + 1, runtime.rank)  # Test hook: MIMOTRON_FAIL_*.
            monitor.count_samples(microbatches)
            loss_dict, skipped, grad_norm, num_zeros = train_step(run, microbatches)
            # Packed steps consume a varying number of stream samples (data.packing).
            _advance(ts, loss_dict["loss"], skipped,
                     getattr(train_data_iterator, "step_samples", cfg.train.global_batch_size))
            summary["loss"] = loss_dict["loss"]
            monitor.after_step(loss_dict, skipped, grad_norm, num_zeros,
                               aux=language.pop_aux(),
                               transfer_s=multimodule_communicator.pop_transfer_seconds())
            with monitor.excluded():  # Writing a trace is not step time.
                profiler.after_step(ts.iteration)
            check_divergence(ts, loss_dict["loss"], cfg.train.max_skipped, cfg.train.precision)
            if valid_data_iterator is not None and ts.iteration % cfg.eval.interval == 0 \
                    and ts.iteration < cfg.train.iters:
                summary["eval"] = run_eval()
            with monitor.excluded():  # Saves, exit conditions, SIGTERM (world-agreed).
                if checkpoints.after_step():
                    break
        optimizer.finish_param_gather()  # the caller gets complete weights
        with monitor.excluded():
            checkpoints.finish()
        if valid_data_iterator is not None and not checkpoints.stopped:
            summary["eval"] = run_eval()
    except Exception as exc:
        _land_param_gather(optimizer, exc)
        raise
    finally:
        checkpoints.close()
        profiler.close()
        monitor.close()
    return monitor.finish(summary)


def _land_param_gather(optimizer: MimoOptimizer, exc: Exception) -> None:
    """On an error, land a pending parameter all-gather so the caller's weights are whole.

    Skipped when the error is a collective failure (a peer died: the wait would fail
    too); otherwise the process-group timeout bounds the wait. A failure of the wait
    itself is dropped: the original error is the one to report.
    """
    if isinstance(exc, dist.DistError):
        return
    with contextlib.suppress(Exception):  # the original error propagates instead
        optimizer.finish_param_gather()


def _advance(ts: TrainState, loss: float, skipped: bool, num_samples: int) -> None:
    """Count the finished iteration in the train state (identical on every rank)."""
    ts.iteration += 1
    ts.consumed_samples += num_samples
    ts.skipped_iters += int(skipped)
    ts.consecutive_skips = ts.consecutive_skips + 1 if skipped else 0
    if not math.isfinite(loss):
        ts.nan_iters += 1


def _evaluate_and_log(language: LanguageStep, valid_data_iterator: Callable[[], Iterator],
                      model: nn.Module, communicator: Transport, infra: MimoModelInfra,
                      global_state: GlobalState, monitor: LoopMonitor) -> dict[str, float]:
    cfg, runtime = global_state.cfg, global_state.runtime
    communicator.set_timing(False)  # Evaluation's transfers are not training's.
    with monitor.excluded():  # Evaluation time is not step time.
        metrics = evaluate(language, valid_data_iterator(), model, communicator,
                           infra, cfg.train.precision, runtime.device,
                           encoder_batching=cfg.train.encoder_batching)
    communicator.set_timing(True)
    writer = monitor.writer
    record = {"iteration": global_state.train_state.iteration, **metrics}
    if writer is not None:
        writer.write(record)
        writer.eval_line(record)
    return metrics


def run_training(cfg: MimoConfig, runtime: Runtime,
                 forward_step_func: ForwardStepFunc = default_forward_step) -> dict[str, Any]:
    """Set up and train one run on this rank (what ``mimotron train`` runs per rank)."""
    built = setup_mimo(cfg, runtime)
    try:
        run = build_step_run(built.model, built.optimizer, built.schedulers,
                             built.global_state, built.infra, built.communicator,
                             LanguageStep(forward_step_func))
        return train(run, built.train_data_iterator, built.valid_data_iterator)
    finally:
        if isinstance(built.train_data_iterator, StepPrefetcher):
            built.train_data_iterator.close()  # before the reader its thread reads from
        if built.data_reader is not None:
            built.data_reader.close()
