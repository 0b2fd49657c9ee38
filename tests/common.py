"""Shared test configuration: a small model, layout helpers, and a multi-step runner.

Every engine test trains this small version of the demo model so that a multi-rank case
takes seconds; layouts are written as ``key=value`` overrides of ``configs/digits.toml``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from mimotron.checkpoint.export import split_module
from mimotron.config import (
    MimoConfig,
    ModuleConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    load_config,
)
from mimotron.config.lora import LoraConfig
from mimotron.pipeline import communicator as communicator_module
from mimotron.pipeline.p2p import exchange
from mimotron.runtime import init_runtime
from mimotron.training.loop import MimoRun, setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.step import default_forward_step

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
MODULES = ("vision", "audio", "language")

# The demo model, shrunk; warm-up short enough for runs of a few iterations.
SMALL_MODEL = [
    "modules.vision.hidden_size=32", "modules.vision.num_layers=1",
    "modules.audio.hidden_size=32", "modules.language.hidden_size=64",
    "train.global_batch_size=16", "train.micro_batch_size=8", "scheduler.warmup_iters=2",
]
# For training-math tests: clipping at 0.5 so clipping is exercised; no evaluation.
BASE = [*SMALL_MODEL, "optimizer.lr=3e-3", "optimizer.clip_grad=0.5", "eval.interval=1000"]
NUM_ITERS = 5
# A run through run_training that logs every iteration and resumes from its own
# checkpoints (the resume and reshard tests).
RESUMING = [*BASE, "train.iters=20", "eval.iters=1", "log.interval=1", "log.progress=false",
            "checkpoint.load=auto", "modules.vision.optimizer.lr=1e-3"]


def par(module: str, **kw: int) -> list[str]:
    """Overrides of one module's ``parallel`` table."""
    return [f"modules.{module}.parallel.{k}={v}" for k, v in kw.items()]


def colocated(dp: int) -> list[str]:
    """Every module on ranks ``[0, dp)`` with data parallelism ``dp``."""
    return [item for m in MODULES for item in par(m, data=dp, rank_offset=0)]


def colocated_plain(dp: int) -> list[str]:
    """Every module on ranks ``[0, dp)`` with DP ``dp`` and TP = PP = 1, whatever the config
    file says."""
    return [f"modules.{m}.parallel.{key}={value}" for m in MODULES
            for key, value in (("data", dp), ("tensor", 1), ("pipeline", 1), ("rank_offset", 0))]


def noncolocated(vision: dict, audio: dict, language: dict) -> list[str]:
    """Blocks in order vision | audio | language, each with its own degrees."""
    out, offset = [], 0
    for name, degrees in (("vision", vision), ("audio", audio), ("language", language)):
        degrees = {"data": 1, **degrees}
        out += par(name, rank_offset=offset, **degrees)
        offset += (degrees["data"] * degrees.get("tensor", 1) * degrees.get("pipeline", 1)
                   * degrees.get("context", 1))
    return out


def coloc(vision: dict, audio: dict, language: dict) -> list[str]:
    """Every module on the same ranks, each with its own degrees."""
    return [*par("vision", rank_offset=0, **vision), *par("audio", rank_offset=0, **audio),
            *par("language", rank_offset=0, **language)]


ONE_RANK = colocated(1)


def config_keys() -> set[str]:
    """Every accepted key, from the dataclasses (``<m>`` = any module)."""
    keys = set()
    for f in dataclasses.fields(MimoConfig):
        if f.name == "modules":
            continue
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(f.default_factory)}
        else:
            keys.add(f.name)
    for f in dataclasses.fields(ModuleConfig):
        if f.name not in ("parallel", "optimizer", "lora"):
            keys.add(f"modules.<m>.{f.name}")
    keys |= {f"modules.<m>.parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)}
    keys |= {f"modules.<m>.lora.{f.name}" for f in dataclasses.fields(LoraConfig)}
    per_module = {f.name for f in dataclasses.fields(OptimizerConfig)}
    per_module |= {f.name for f in dataclasses.fields(SchedulerConfig)} - {"min_lr"}
    keys |= {f"modules.<m>.optimizer.{k}" for k in per_module}
    return keys


def train_step(run: MimoRun) -> tuple[dict, bool, float | None, int | None]:
    """One ``train_step_mimo`` of a ``setup_mimo`` run with the default forward step."""
    return train_step_mimo(default_forward_step, run.train_data_iterator, run.model,
                           run.optimizer, run.schedulers, run.global_state, run.communicator,
                           infra=run.infra)


def train_steps(rank: int, world: int, overrides: list[str], num_iters: int) -> list[tuple]:
    """Train ``num_iters`` iterations through the real engine on this rank.

    Returns:
        Per iteration ``(loss, grad_norm, skipped, num_loss_tokens)``.
    """
    cfg = load_config(DIGITS, BASE + overrides)
    run = setup_mimo(cfg, init_runtime())
    out = []
    for _ in range(num_iters):
        loss, skipped, grad_norm, _ = train_step(run)
        out.append((loss["loss"], grad_norm, skipped, loss["num_tokens"]))
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly TP-sharded) tensor; collective over its TP mesh."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def module_of(param_name: str) -> str:
    """``language_model.x`` -> ``language``; ``modality_submodules.vision.x`` -> ``vision``."""
    return split_module(param_name)[0]


def _grad_square_norms(model: torch.nn.Module, skip_modules: set[str]) -> dict[str, float]:
    """Per parameter, the squared L2 norm of its full gradient (same order on all ranks)."""
    return {name: float(_full(p.grad).double().pow(2).sum())
            for name, p in model.named_parameters()
            if p.grad is not None and module_of(name) not in skip_modules}


def engine_run(rank: int, world: int, overrides: list[str], num_iters: int,
               config: Path | None = None) -> dict:
    """Train ``num_iters`` iterations through the real engine and report what it did.

    The run is ``configs/digits.toml`` with ``BASE + overrides``, or ``config`` (a TOML
    file of a test's own) with ``overrides`` alone.

    Returns:
        ``steps``: per iteration ``(loss, grad_norm, skipped, num_loss_tokens)``;
        ``grad_sq``: per iteration, parameter name -> squared norm of its full gradient as
        the optimizer steps it (after the DP reduce and clipping; modules with a sharded
        optimizer reduce inside the optimizer and are left out);
        ``weights``: parameter name -> full final value, for the parameters on this rank;
        ``empty_encoder_outputs``: encoder calls that had no sample of their modality;
        ``header_only_sends``: transfers that carried a shape header and no payload.
    """
    cfg = load_config(DIGITS, BASE + overrides) if config is None else load_config(
        config, overrides)
    run = setup_mimo(cfg, init_runtime())
    sharded = {n for n, m in cfg.modules.items() if m.parallel.shard_optimizer}
    counts = {"empty_encoder_outputs": 0, "header_only_sends": 0}
    grad_sq: list[dict[str, float]] = []
    encode, step_ready = run.model.encode, run.optimizer.step_with_ready_grads

    def counting_encode(name: str, batch: dict, **kw: int) -> torch.Tensor:
        rows = encode(name, batch, **kw)
        counts["empty_encoder_outputs"] += int(rows.shape[0] == 0)
        return rows

    def capturing_step() -> bool:
        grad_sq.append(_grad_square_norms(run.model, sharded))
        return step_ready()

    def counting_exchange(sends: list, *args: object) -> list:
        counts["header_only_sends"] += sum(1 for _, t in sends if t.numel() == 0)
        return exchange(sends, *args)

    run.model.encode = counting_encode
    run.optimizer.step_with_ready_grads = capturing_step
    communicator_module.exchange = counting_exchange  # this forked rank only
    steps = []
    for _ in range(num_iters):
        loss, skipped, grad_norm, _ = train_step(run)
        steps.append((loss["loss"], grad_norm, skipped, loss["num_tokens"]))
    run.optimizer.finish_param_gather()  # train.overlap_param_gather
    weights = {n: _full(p.detach()).clone() for n, p in run.model.named_parameters()}
    return {"steps": steps, "grad_sq": grad_sq, "weights": weights, **counts}
