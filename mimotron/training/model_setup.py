"""Build the part of the ``MimoModel`` one rank holds: its modules, stages and TP shards.

Every module part is built with its pipeline stage's *global* layer indices and
initialised from ``(seed, full parameter name)`` on the full shape, then sharded by its
TP plan — so every layout starts from exactly the weights of the one-process model.
Frozen modules (``modules.<m>.freeze``) are frozen here, before any optimizer exists.
"""

from __future__ import annotations

import torch
from torch import nn

from mimotron.config import MimoConfig
from mimotron.models.build import build_module
from mimotron.models.mimo import MimoModel, module_part
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import stage_layers
from mimotron.parallel.tensor_parallel import apply_tensor_parallel
from mimotron.training.infra import MimoModelInfra

# The vocabulary is padded to a multiple of this (Megatron's make-vocab-divisible), the
# same for every layout, so TP can split it and layouts share one model.
VOCAB_MULTIPLE = 64


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Round the tokenizer's vocabulary up to a multiple of ``multiple``."""
    return -(-vocab_size // multiple) * multiple


def build_rank_model(cfg: MimoConfig, infra: MimoModelInfra, vocab_size: int,
                     placeholder_ids: dict[str, int], device: torch.device) -> MimoModel:
    """The ``MimoModel`` slice of this rank (modules, stage layers, TP shards).

    Args:
        cfg: run config.
        infra: grids and roles of this rank.
        vocab_size: the (padded) vocabulary size.
        placeholder_ids: encoder module -> placeholder token id.
        device: where parameters live.
    """
    parts: dict[str, nn.Module] = {}
    for name, role in infra.roles.items():
        mod = cfg.modules[name]
        layers = stage_layers(mod.num_layers, mod.parallel.pipeline,
                              mod.parallel.layers_per_stage)[role.pp]
        parts[name] = build_module(cfg, name, vocab_size, layer_ids=layers,
                                   pre_process=role.is_first_stage,
                                   post_process=role.is_last_stage).to(device)
        if mod.parallel.tensor > 1:
            mesh = infra.grids[name].to_device_mesh(device.type, dims=["tp"])
            apply_tensor_parallel(parts[name], mesh, name == LANGUAGE)
    language = parts.pop(LANGUAGE, None)
    modality_of = {n: str(cfg.modules[n].modality) for n in cfg.encoder_names}
    tp_group = None
    if language is not None and cfg.modules[LANGUAGE].parallel.tensor > 1:
        tp_group = infra.pg_collections[LANGUAGE].tp
    model = MimoModel(parts, language, dict(placeholder_ids), modality_of, tp_group)
    freeze_modules(model, cfg)
    return model


def freeze_modules(mimo_model: MimoModel, cfg: MimoConfig) -> list[str]:
    """Stop gradients for every frozen module held on this rank (``requires_grad=False``).

    Autograd then neither computes nor stores anything for the module: its encoder
    output carries no graph (the same as running it under ``no_grad``, since its only
    input is data), the data-parallel sync skips it, and the optimizer factory builds no
    optimizer for it. Parameters are never switched back on here (a user may have
    frozen pieces).

    Args:
        mimo_model: has ``modality_submodules`` (encoders) and ``language_model``;
            either may be missing or hold only some modules on this rank.
        cfg: the run config (``modules.<m>.freeze``).

    Returns:
        The frozen modules this rank holds.
    """
    frozen = []
    for name, mcfg in cfg.modules.items():
        if not mcfg.freeze:
            continue
        module = module_part(mimo_model, name)
        if module is not None:
            module.requires_grad_(False)
            frozen.append(name)
    return frozen
