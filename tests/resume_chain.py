"""A chain of ``run_training`` runs on forked ranks that resume from each other's
checkpoints, and what each rank's optimizer holds (the ZeRO and FSDP resume tests).

Every run of a chain shares :data:`COMMON` (12 fp32 iterations, a checkpoint every 3,
``checkpoint.load=auto``); :func:`launch` runs one under ``root/<name>`` (its checkpoints
in ``root/<name>/ckpt``, :func:`ckpt`), optionally from another run's checkpoint, and
returns per rank what its optimizer holds (:func:`optimizer_holdings`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.optim.mimo_optimizer import MimoOptimizer
from mimotron.parallel.expert_parallel import is_expert_param
from mimotron.parallel.zero import shard_dim
from mimotron.runtime import init_runtime
from mimotron.training import loop
from mimotron.training.loop import run_training
from tests.common import BASE, DIGITS, colocated_plain

PLAIN = colocated_plain(1)  # the one-rank plain loop: no ZeRO, no FSDP
COMMON = BASE + ["train.iters=12", "eval.iters=1", "log.interval=1", "log.progress=false",
                 "checkpoint.interval=3", "checkpoint.keep=4", "checkpoint.load=auto"]


def ckpt(root: Path, run: str, iteration: int) -> Path:
    """The checkpoint of iteration ``iteration`` of the chain's run ``run``."""
    return root / run / "ckpt" / f"iter_{iteration:07d}"


def _train(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """``run_training`` on this rank; then what its first optimizer holds."""
    runs = []
    setup = loop.setup_mimo

    def keep(cfg: Any, runtime: Any) -> Any:
        runs.append(setup(cfg, runtime))
        return runs[-1]

    loop.setup_mimo = keep  # this forked rank only
    run_training(load_config(DIGITS, overrides), init_runtime())
    return optimizer_holdings(runs[0].optimizer)


def optimizer_holdings(optimizer: MimoOptimizer) -> dict[str, dict[str, int]]:
    """Per active module: local parameter elements, their bytes, gradient bytes, moments.

    Fragments are views of the parameters and are not counted again; ``one_row`` is
    the bound on a row split's imbalance (one row of every local tensor).
    """
    out = {}
    for name, info in optimizer.module_infos.items():
        if not info.is_active:
            continue
        params = ([info.zero.model_param(n) for n, _ in info.zero.fragments]
                  if info.zero is not None else [p for _, p in info.params])
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        grads = [g.to_local() if isinstance(g, DTensor) else g
                 for g in (p.grad for p in params) if g is not None]
        moments = [v for st in info.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0]
        out[name] = {
            "numel": sum(t.numel() for t in local),
            "expert_numel": sum(t.numel() for p, t in zip(params, local, strict=True)
                                if is_expert_param(p)),
            "weights": sum(t.numel() * t.element_size() for t in local),
            "grads": sum(g.numel() * g.element_size() for g in grads),
            "moments": sum(v.numel() * v.element_size() for v in moments),
            "one_row": sum(t.numel() // t.shape[shard_dim(t.shape)] for t in local),
            "dp": 1 if info.zero is None else info.zero.group.size(),
        }
    return out


def launch(root: Path, name: str, world: int, layout: list[str], load: Path | None,
           stop: int) -> list[dict[str, Any]]:
    """Run ``name`` of the chain on ``world`` ranks with ``layout``, from the checkpoint
    ``load`` (``None``: from scratch), stopping after iteration ``stop``.

    Returns:
        Per rank, :func:`optimizer_holdings` of its optimizer.
    """
    extra = [f"checkpoint.load={load}"] if load is not None else []
    return run_ranks(world, _train, COMMON + layout + extra + [
        f"log.dir={root / name}", f"checkpoint.dir={root / name / 'ckpt'}",
        f"train.exit_interval={stop}"], timeout_s=300)


def straight_and_resumed(root: Path, world: int, layout: list[str], stop: int, total: int
                         ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run straight to iteration ``total``, and one stopped after ``stop`` and resumed
    from its checkpoint to ``total``: each one's training records
    (:data:`~tests.parity.RECORD_FIELDS`)."""
    from tests.parity import RECORD_FIELDS, training_records

    launch(root, "straight", world, layout, None, total)
    launch(root, "resumed", world, layout, None, stop)
    launch(root, "resumed", world, layout, None, total)
    return (training_records(root / "straight", RECORD_FIELDS),
            training_records(root / "resumed", RECORD_FIELDS))
