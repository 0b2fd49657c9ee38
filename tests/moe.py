"""The MoE language model of the expert-parallel tests, and what their runs record.

``MOE`` overrides the demo's language model into a small top-2 MoE with both auxiliary
losses; :func:`aux_objective` writes those losses out for the plain loop (from the
routers' logits alone), :func:`moe_reference` is that loop (cached), and
:func:`expert_grads` is ``tests.common.engine_run`` that also keeps this rank's local
expert gradients and zero counts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch.distributed.tensor import DTensor

import tests.common as common
from tests.common import engine_run
from tests.reference import ReferenceRun, reference_run

NUM_ITERS = 10
AUX, Z = 0.01, 0.001
MOE = [
    "train.iters=10", "modules.language.hidden_size=32", "modules.language.num_layers=2",
    "modules.language.num_experts=4", "modules.language.top_k=2",
    f"modules.language.moe_aux_loss_coeff={AUX}", f"modules.language.moe_z_loss_coeff={Z}",
]
# The same MoE without the auxiliary losses or a run length (the overlap tests).
MOE_NO_AUX = ["modules.language.hidden_size=32", "modules.language.num_layers=2",
              "modules.language.num_experts=4", "modules.language.top_k=2"]


def aux_objective(model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    """Hooks on every router; returns ``batch -> Σ_b n_b Σ_layers (aux + z)`` terms."""
    logits: list[torch.Tensor] = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.router"):
            mod.register_forward_hook(lambda _m, _i, out: logits.append(out))

    def extra(batch: dict) -> torch.Tensor:
        n = batch["loss_mask"].float().sum(dim=1)  # [B] loss tokens per sample
        total = torch.zeros(())
        for layer_logits in logits:
            z = layer_logits.float().reshape(n.shape[0], -1, layer_logits.shape[-1])
            num_experts = z.shape[-1]
            scores = z.softmax(dim=-1)
            picked = torch.nn.functional.one_hot(scores.topk(2, dim=-1).indices,
                                                 num_experts).float()
            f = picked.sum(dim=(1, 2)) / (z.shape[1] * 2)
            aux = num_experts * (f * scores.mean(dim=1)).sum(dim=-1)
            zloss = torch.logsumexp(z, dim=-1).square().mean(dim=-1)
            total = total + (n * (AUX * aux + Z * zloss)).sum()
        logits.clear()
        return total

    return extra


def expert_grads(rank: int, world: int, overrides: list[str]) -> dict:
    """``engine_run`` plus this rank's local expert gradients after the last reduction."""
    captured: dict[str, torch.Tensor] = {}
    original = common._grad_square_norms

    def capture(model: torch.nn.Module, skip: set[str]) -> dict[str, float]:
        captured.clear()
        for name, p in model.named_parameters():
            if isinstance(p.grad, DTensor) and ".experts." in name:
                captured[name] = p.grad.to_local().clone()
        return original(model, skip)

    zeros: list[int] = []
    step = common.train_step

    def counting_step(run: object) -> tuple:
        result = step(run)
        zeros.append(result[3])
        return result

    # This forked rank only: engine_run looks both names up in tests.common.
    common._grad_square_norms = capture
    common.train_step = counting_step
    out = engine_run(rank, world, overrides, NUM_ITERS)
    return {**out, "expert_grads": captured, "num_zeros": zeros}


@cache
def _moe_reference(key: tuple[str, ...], num_iters: int) -> ReferenceRun:
    return reference_run(key, num_iters, aux_objective)


def moe_reference(overrides: list[str] = MOE, num_iters: int = NUM_ITERS) -> ReferenceRun:
    """The plain loop of ``overrides`` with the MoE auxiliary losses (cached: every caller
    only reads it)."""
    return _moe_reference(tuple(overrides), num_iters)
