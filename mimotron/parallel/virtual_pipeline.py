"""Virtual pipeline stages: which layer chunks a rank holds, and what the layout allows.

With ``modules.<m>.parallel.virtual_pipeline = v > 1`` a module of ``pipeline = p``
stages is cut into ``p * v`` contiguous, balanced layer chunks (virtual stages); stage
rank ``r`` holds chunks ``r, r + p, ..., r + (v - 1) p``. The rank builds one module
part holding the union of its chunks' layers (keyed by global index, so checkpoints
are the same whatever ``v``), with the input embedding when it holds virtual stage 0
and the final norm / output head when it holds the last one; a forward runs one chunk
(``chunk=j``). The schedule is :mod:`mimotron.pipeline.interleaved_actions`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, ModuleConfig, ParallelConfig

if TYPE_CHECKING:  # layout imports this file's checks
    from mimotron.parallel.layout import RankRole


def chunk_layers(num_layers: int, pipeline: int, virtual: int, stage: int) -> list[list[int]]:
    """Global layer indices of each model chunk of pipeline rank ``stage``.

    A balanced split of ``num_layers`` into ``pipeline * virtual`` contiguous virtual
    stages (the first ``num_layers % (p v)`` get one extra layer); chunk ``j`` of rank
    ``r`` is virtual stage ``j * pipeline + r``.
    """
    num_virtual = pipeline * virtual
    base, extra = divmod(num_layers, num_virtual)
    bounds = [0]
    for s in range(num_virtual):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [list(range(bounds[j * pipeline + stage], bounds[j * pipeline + stage + 1]))
            for j in range(virtual)]


def rank_layers(num_layers: int, par: ParallelConfig, stage: int
                ) -> tuple[list[int], list[list[int]] | None]:
    """``(global layers a pipeline rank holds, its chunks or None without interleaving)``."""
    if par.virtual_pipeline == 1:
        return stage_layers(num_layers, par.pipeline, par.layers_per_stage)[stage], None
    chunks = chunk_layers(num_layers, par.pipeline, par.virtual_pipeline, stage)
    return [i for c in chunks for i in c], chunks


def chunk_holder(part: nn.Module) -> nn.Module:
    """The module of a part that holds its ``layers`` and ``layer_chunks``: a language
    model itself, an encoder part's ``encoder``."""
    target = part if hasattr(part, "layer_chunks") else part.encoder
    assert hasattr(target, "layer_chunks"), f"{type(part).__name__} cannot hold chunks"
    return target


def set_layer_chunks(part: nn.Module, chunks: list[list[int]] | None) -> None:
    """Tell a built module part (language model or encoder) which chunks it holds."""
    chunk_holder(part).layer_chunks = chunks


def is_first_virtual_stage(role: RankRole, chunk: int) -> bool:
    """Whether ``chunk`` of the rank with ``role`` is its module's first virtual stage."""
    return role.is_first_stage and chunk == 0


def is_last_virtual_stage(role: RankRole, chunk: int, num_chunks: int) -> bool:
    """Whether ``chunk`` (of ``num_chunks``) of the rank with ``role`` is its module's
    last virtual stage."""
    return role.is_last_stage and chunk == num_chunks - 1


def check_virtual_pipeline(cfg: MimoConfig, name: str, colocated: bool) -> None:
    """Raise one ``ValueError`` line unless module ``name`` can run its ``virtual_pipeline``.

    Accepted: a non-colocated module with ``pipeline > 1``, ``num_layers >= pipeline x
    virtual_pipeline``, the step's micro-batches a multiple of ``pipeline`` (Megatron's
    rule), with any tensor, data, context and expert parallel degree, MoE, sequence
    parallelism, ZeRO-1 and ``train.overlap_grad_reduce``. Refused (not implemented):
    explicit ``layers_per_stage``, ``hf_path`` MoE models (untested; Hugging Face
    encoders and dense decoders are accepted) and
    ``train.schedule = "no_pipelining"``.
    """
    mod = cfg.modules[name]
    par, v = mod.parallel, mod.parallel.virtual_pipeline
    field = f"modules.{name}.parallel.virtual_pipeline={v}"
    if v == 1:
        return
    if par.pipeline < 2:
        raise ValueError(f"{field} is invalid: interleaving needs modules.{name}.parallel."
                         f"pipeline > 1 (got {par.pipeline}); use 1")
    if colocated:
        raise ValueError(f"{field} is invalid: interleaving needs a non-colocated layout "
                         "(disjoint rank blocks); use 1")
    if mod.num_layers < par.pipeline * v:
        raise ValueError(f"{field} is invalid: modules.{name}.num_layers={mod.num_layers} "
                         f"cannot fill pipeline x virtual_pipeline = {par.pipeline * v} chunks")
    num_mb = cfg.num_microbatches
    if num_mb % par.pipeline:
        raise ValueError(
            f"{field} is invalid: the step's micro-batches (train.global_batch_size / "
            f"train.micro_batch_size = {num_mb}) must be a multiple of modules.{name}."
            f"parallel.pipeline={par.pipeline} for interleaving")
    unsupported = [
        (bool(par.layers_per_stage), f"modules.{name}.parallel.layers_per_stage"),
        (bool(mod.hf_path) and not mod.is_encoder and _hf_moe(mod),
         f"modules.{name}.hf_path (a Hugging Face MoE model)"),
        (cfg.train.schedule != "1f1b", f"train.schedule={cfg.train.schedule!r}"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{field} is invalid with {what}: interleaved 1F1B does not "
                             "support it yet; use virtual_pipeline=1")


def _hf_moe(mod: ModuleConfig) -> bool:
    """Whether an ``hf_path`` language model is a mixture of experts (its config.json)."""
    return moe_options(mod) is not None


def stage_layers(
    num_layers: int, pipeline: int, layers_per_stage: list[int] | None = None
) -> list[list[int]]:
    """Global layer indices of each pipeline stage: contiguous, balanced unless given.

    A balanced split gives the first ``num_layers % pipeline`` stages one extra layer.
    """
    counts = list(layers_per_stage or [])
    if not counts:
        base, extra = divmod(num_layers, pipeline)
        counts = [base + (1 if s < extra else 0) for s in range(pipeline)]
    assert sum(counts) == num_layers and len(counts) == pipeline
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out
