"""Build the part of the ``MimoModel`` one rank holds: its modules, stages and TP shards.

Every module part is built with its pipeline stage's *global* layer indices (under
interleaving the union of the rank's model chunks, :mod:`mimotron.parallel.
virtual_pipeline`) and initialised from ``(seed, full parameter name)`` on the full
shape, then sharded by its
TP plan — so every layout starts from exactly the weights of the one-process model.
MoE experts of a module with ``parallel.expert > 1`` (or ``expert_tensor > 1``) are
then sharded over its ``ep`` (and ``expt_tp``) axes
(:func:`mimotron.parallel.expert_parallel.shard_experts`), which also installs the
expert-parallel dispatcher on every MoE block.
Frozen modules and towers (``modules.<m>.freeze``) are frozen here, before any optimizer
exists (after TP and FSDP, which re-create parameters).
Activation recompute (``modules.<m>.recompute``) is applied to each part's layers
(:func:`mimotron.models.recompute.apply_recompute`); it changes no parameter.
A module with ``hf_path`` is built on the meta device, sharded, allocated and then
filled from its folder (:func:`build_hf_part`): only its projector is drawn from
``(seed, name)``, and no rank ever allocates or reads more than it holds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mimotron.checkpoint.lora_base import adapters_only_prefixes
from mimotron.config.lora import base_in_folder
from mimotron.config.native_vision import deepstack_source
from mimotron.config.schema import MimoConfig
from mimotron.models.build import build_module, load_hf_module, module_prefix
from mimotron.models.freeze import freeze_part
from mimotron.models.init import init_parameters_
from mimotron.models.lora import attach_lora, freeze_for_lora, hold_base_in
from mimotron.models.mimo import MimoModel, module_part
from mimotron.models.recompute import apply_recompute
from mimotron.names import LANGUAGE
from mimotron.parallel.expert_parallel import shard_experts
from mimotron.parallel.fsdp import apply_fsdp
from mimotron.parallel.groups import EXPERT_VIEW
from mimotron.parallel.lora_tp import shard_lora
from mimotron.parallel.tensor_parallel import apply_tensor_parallel, mark_tensor_partial_params
from mimotron.parallel.virtual_pipeline import rank_layers, set_layer_chunks
from mimotron.runtime import compute_dtype
from mimotron.training.infra import MimoModelInfra

__all__ = ["build_rank_model", "freeze_modules"]


def build_rank_model(cfg: MimoConfig, infra: MimoModelInfra, vocab_size: int,
                     placeholder_ids: dict[str, int], device: torch.device) -> MimoModel:
    """The ``MimoModel`` slice of this rank (modules, stage layers, TP shards).

    Args:
        cfg: run config.
        infra: grids and roles of this rank.
        vocab_size: the (padded) vocabulary size.
        placeholder_ids: encoder module -> placeholder token id.
        device: where parameters live.

    Raises:
        ValueError: an ``hf_path`` folder any rank refused (damaged, mis-shaped, of a
            dtype that does not load, non-finite), the same on every rank: with an
            ``hf_path`` module this is collective over the world.
    """
    parts: dict[str, nn.Module] = {}
    refused: list[str] = []  # hf_path folders this rank's reads refused
    for name, role in infra.roles.items():
        mod = cfg.modules[name]
        layers, chunks = rank_layers(mod.num_layers, mod.parallel, role.pp)
        mesh, fsdp_mesh = _part_meshes(cfg, infra, name, device)
        stage = {"layer_ids": layers, "pre_process": role.is_first_stage,
                 "post_process": role.is_last_stage}
        if mod.hf_path:
            try:
                parts[name] = build_hf_part(cfg, name, vocab_size, stage, mesh, device)
            except ValueError as exc:
                refused.append(f"modules.{name}: {exc}")
                continue
        else:
            parts[name] = build_module(cfg, name, vocab_size, **stage).to(device)
        if chunks is not None:
            set_layer_chunks(parts[name], chunks)
        apply_recompute(parts[name], mod.recompute, mod.recompute_num_layers)
        if mesh is not None and not mod.hf_path:  # build_hf_part applied TP already
            apply_tensor_parallel(parts[name], mesh, name == LANGUAGE,
                                  mod.parallel.sequence_parallel)
        if mod.lora.rank:  # after the TP plan, which must not see the adapters
            _adapt(parts[name], cfg, name, mesh)
        if mod.parallel.expert > 1 or mod.parallel.expert_tensor > 1:  # never with hf_path
            apply_expert_parallel(parts[name], infra, name, device,
                                  mod.parallel.expert_tensor > 1)
        if fsdp_mesh is not None:
            apply_fsdp(parts[name], fsdp_mesh, cfg.train.precision)
    if any(m.hf_path for m in cfg.modules.values()):  # the same branch on every rank
        _agree_on_folders(refused)
    language = parts.pop(LANGUAGE, None)
    if language is not None and cfg.modules[LANGUAGE].parallel.context > 1:
        language.set_context_parallel(infra.pg_collections[LANGUAGE].cp)
    modality_of = {n: str(cfg.modules[n].modality) for n in cfg.encoder_names}
    tp_group = None
    if language is not None and cfg.modules[LANGUAGE].parallel.tensor > 1:
        tp_group = infra.pg_collections[LANGUAGE].tp
    model = MimoModel(parts, language, dict(placeholder_ids), modality_of, tp_group)
    model.deepstack = deepstack_source(cfg)
    model.adapters_only = adapters_only_prefixes(cfg)
    freeze_modules(model, cfg)
    return model


def _adapt(part: nn.Module, cfg: MimoConfig, name: str, mesh: DeviceMesh | None) -> None:
    """LoRA adapters on a module part: attached, sharded with its TP layers, the rest of
    the part frozen and, under bf16 / fp16 with the base in its folder, held once in the
    compute dtype (before FSDP2 takes the parameters over)."""
    mod = cfg.modules[name]
    attach_lora(part, mod.lora, cfg.train.seed, module_prefix(cfg, name))
    if mesh is not None:
        shard_lora(part, mesh, name == LANGUAGE and mod.parallel.sequence_parallel)
    freeze_for_lora(part)
    # Only a base that no checkpoint holds: one that is saved stays fp32, as every saved
    # weight is.
    if cfg.train.precision != "fp32" and base_in_folder(cfg, name):
        hold_base_in(part, compute_dtype(cfg.train.precision),
                     embedding=not cfg.train.fp32_residual_connection)


def _agree_on_folders(refused: list[str]) -> None:
    """Collective over the world: raise the same ``ValueError`` on every rank if any
    rank's ``hf_path`` reads were refused.

    Each rank checks only what it reads (its stage's tensors, its TP slices), so one
    rank can find NaN where the others find none; without this, they would go on into
    the next collective and wait there for it.
    """
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, refused)
    found = sorted({line for lines in gathered for line in lines})
    if found:
        raise ValueError("\n".join(found))


def _part_meshes(cfg: MimoConfig, infra: MimoModelInfra, name: str, device: torch.device
                 ) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(tp mesh, fsdp mesh)`` of a module part; ``None`` where it has no such axis.

    FSDP composed with TP needs both on one ``(dp, tp)`` mesh (FSDP shards the TP shards
    and must know their mesh); without FSDP the TP mesh is 1-D as before.
    """
    par = cfg.modules[name].parallel
    grid = infra.grids[name]
    if par.fsdp and par.data > 1:
        if par.tensor > 1:
            mesh2d = grid.to_device_mesh(device.type, dims=["tp", "dp"])
            return mesh2d["tp"], mesh2d["dp"]
        return None, grid.to_device_mesh(device.type, dims=["dp"])
    tp = grid.to_device_mesh(device.type, dims=["tp"]) if par.tensor > 1 else None
    return tp, None


def apply_expert_parallel(part: nn.Module, infra: MimoModelInfra, name: str,
                          device: torch.device, expert_tensor: bool = False) -> None:
    """Shard a module part's experts over its ``ep`` (and ``expt_tp``) axes; set dispatchers.

    The part was initialised on the full shape, so every EP degree starts from the
    one-process weights. The mesh reuses the groups the grid already created.
    """
    dims = ["expt_tp", "ep"] if expert_tensor else ["ep"]
    mesh = infra.grids[name].to_device_mesh(device.type, dims=dims, view=EXPERT_VIEW)
    shard_experts(part, mesh, infra.pg_collections[name].tp)


def build_hf_part(cfg: MimoConfig, name: str, vocab_size: int, stage: dict[str, Any],
                  mesh: DeviceMesh | None, device: torch.device) -> nn.Module:
    """One rank's part of an ``hf_path`` module, never allocating more than it holds.

    Build on the meta device -> apply the TP plan (still meta) -> allocate this rank's
    shards on ``device`` -> initialise the projector from ``(seed, name)`` as every
    module is -> read this stage's tensors and TP slices from the folder. It does no
    collective: :func:`build_rank_model` makes the ranks agree on a refused folder.
    """
    with torch.device("meta"):
        part = build_module(cfg, name, vocab_size, **stage, init=False)
    sequence_parallel = cfg.modules[name].parallel.sequence_parallel
    if mesh is not None:
        apply_tensor_parallel(part, mesh, name == LANGUAGE, sequence_parallel)
    part.to_empty(device=device)
    if mesh is not None:
        mark_tensor_partial_params(part, sequence_parallel)  # to_empty dropped the marks
    if getattr(part, "tie_word_embeddings", False):
        part.tie_weights()  # to_empty allocates each reference separately
    projector = getattr(part, "projector", None)
    if projector is not None:
        init_parameters_(projector, cfg.train.seed, prefix=f"{module_prefix(cfg, name)}projector.")
    return load_hf_module(cfg, name, part)


def freeze_modules(mimo_model: MimoModel, cfg: MimoConfig) -> list[str]:
    """Stop gradients for what ``modules.<m>.freeze`` freezes on this rank.

    ``freeze = true`` freezes the whole module, ``freeze = "encoder"`` an encoder's tower
    (its projector trains): ``requires_grad = False`` (:func:`~mimotron.models.freeze.
    freeze_part`). Autograd then neither computes nor stores anything for those
    parameters (a frozen encoder's or tower's output carries no graph, the same as
    running it under ``no_grad``, since its only input is data), the data-parallel sync
    skips them, and the optimizer factory leaves them out. Parameters are never switched
    back on here (a user may have frozen pieces).

    Args:
        mimo_model: has ``modality_submodules`` (encoders) and ``language_model``;
            either may be missing or hold only some modules on this rank.
        cfg: the run config (``modules.<m>.freeze``).

    Returns:
        The modules this rank holds of which something is frozen.
    """
    frozen = []
    for name, mcfg in cfg.modules.items():
        module = module_part(mimo_model, name)
        if module is not None and freeze_part(module, mcfg):
            frozen.append(name)
    return frozen
