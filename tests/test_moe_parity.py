"""Expert-parallel MoE language models train like a one-process plain PyTorch loop.

The reference (``tests.reference.reference_run``) is the whole MoE model in one process
with every expert local, plus the auxiliary objective written out here from the router
logits (hooks on every ``router``), independently of the engine's injection mechanism:

    ``(CE_sum + Σ_b n_b · Σ_layers (aux_coeff · aux_b + z_coeff · z_b)) / loss_tokens``

with ``aux_b = E · Σ_e f_e · P_e`` (``f_e`` the share of sample ``b``'s ``S·k`` choices
that picked expert ``e``, ``P_e`` its mean softmax score) and ``z_b`` the mean squared
logsumexp of the logits. Per layout, one forked run of 10 iterations checks: losses,
global grad norms (a double-counted expert shard would show here), per-module grad
norms as stepped, final weights (1e-4 relative), and that expert gradients are
identical on the ``expt_dp`` replicas after the reduction, and the zero-gradient count
(``count_zeros``) equals the reference's exactly.

Layouts (tiny model: hidden 32, 2 layers, 4 experts, top-2):

* ``ep2``: every module on 2 ranks (DP 2), language EP 2 (expt_dp 1);
* ``ep2-pp2-noncolocated``: vision | audio | language PP 2 x DP 2 with EP 2 per stage
  (EP 2, EP with PP, EP fed by encoders through the non-colocated bridge);
* ``ep2-dp2-colocated``: every module on 4 ranks, language EP 2 x expt_dp 2;
* ``ep2-tp2``: vision | audio | language TP 2 with EP 2 over the TP peers;
* ``ep2-etp2``: every module on 4 ranks, language EP 2 x expert TP 2 (the expert TP
  peers are DP replicas with different tokens);
* ``ep2-etp2-tp2``: colocated, language TP 2 x DP 2 with EP 2 x expert TP 2 (the
  expert TP peers are the dense TP peers);
* ``ep2-dp2-colocated-zero``: as ``ep2-dp2-colocated`` with ZeRO-1 (dense rows over
  DP 4, expert rows over expt_dp 2).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import DTensor

from mimotron.config import load_config
from mimotron.parallel.layout import plan_layout
from mimotron.testing import run_ranks
from tests.common import BASE, DIGITS, coloc, colocated, engine_run, module_of, noncolocated, par
from tests.reference import ReferenceRun, reference_run
from tests.test_parity import LOSS_REL, assert_steps_match, assert_weights_match

NUM_ITERS = 10
AUX, Z = 0.01, 0.001
MOE = [
    "train.iters=10", "modules.language.hidden_size=32", "modules.language.num_layers=2",
    "modules.language.num_experts=4", "modules.language.top_k=2",
    f"modules.language.moe_aux_loss_coeff={AUX}", f"modules.language.moe_z_loss_coeff={Z}",
]
CASES: dict[str, list[str]] = {
    "ep2": colocated(2) + par("language", expert=2),
    "ep2-pp2-noncolocated": noncolocated({}, {}, {"pipeline": 2, "data": 2})
    + par("language", expert=2),
    "ep2-dp2-colocated": colocated(4) + par("language", expert=2),
    "ep2-tp2": noncolocated({}, {}, {"tensor": 2}) + par("language", expert=2),
    # Expert TP 2: expt_tp peers are DP ranks (different tokens), then dense TP peers.
    "ep2-etp2": colocated(4) + par("language", expert=2, expert_tensor=2),
    "ep2-etp2-tp2": coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2})
    + par("language", expert=2, expert_tensor=2),
    # ZeRO-1: dense rows over dp (4), expert rows over expt_dp (2).
    "ep2-dp2-colocated-zero": colocated(4) + par("language", expert=2, shard_optimizer="true"),
    # ZeRO-1 with TP 2 x DP 2 and expert TP 2 (the dense TP peers): dense rows of each
    # TP shard over dp (2), expert rows of each expert-TP shard over expt_dp (2).
    "tp2-etp2-dp2-colocated-zero": coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2})
    + par("language", expert_tensor=2, shard_optimizer="true"),
}


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


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    return reference_run(tuple(MOE), NUM_ITERS, aux_objective)


def _expert_grads(rank: int, world: int, overrides: list[str]) -> dict:
    """``engine_run`` plus this rank's local expert gradients after the last reduction."""
    import tests.common as common

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

    common._grad_square_norms = capture  # this forked rank only
    common.train_step = counting_step
    out = engine_run(rank, world, overrides, NUM_ITERS)
    return {**out, "expert_grads": captured, "num_zeros": zeros}


def _assert_module_norms(results: list[dict], ref: ReferenceRun, modules: set[str]) -> None:
    """Per-module grad norms as stepped (full gradients; every copy agrees).

    ZeRO-sharded modules step fragments and are left out (global norm and weights cover
    them).
    """
    for it in range(NUM_ITERS):
        merged: dict[str, float] = {}
        for res in results:
            for pname, sq in res["grad_sq"][it].items():
                assert merged.setdefault(pname, sq) == sq, f"iteration {it}: {pname} differs"
        norms: dict[str, float] = {}
        for pname, sq in merged.items():
            norms[module_of(pname)] = norms.get(module_of(pname), 0.0) + sq
        assert set(norms) == modules
        for module, sq in norms.items():
            want = ref.module_norms[it][module]
            assert abs(sq**0.5 - want) <= LOSS_REL * want, f"iteration {it}: {module}"


def _run(name: str) -> list[dict]:
    overrides = MOE + CASES[name]
    world = plan_layout(load_config(DIGITS, BASE + overrides)).world_size
    return run_ranks(world, _expert_grads, overrides, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_layout_matches_plain_loop(name, reference):
    results = _run(name)
    assert_steps_match(results, reference)
    zero = "language" if "zero" in name else None
    _assert_module_norms(results, reference, {"vision", "audio", "language"} - {zero})
    assert_weights_match(results, reference)
    assert any(r["expert_grads"] for r in results), "no expert-parallel shard found"
    # count_zeros counts every expert shard once, like the norm (exact integers).
    for r in results:
        assert r["num_zeros"] == reference.num_zeros
    if name == "ep2-dp2-colocated":
        # expert view [expt_tp 1, ep 2, expt_dp 2]: ranks r and r + 2 hold the same experts.
        for rank in (0, 1):
            a, b = results[rank]["expert_grads"], results[rank + 2]["expert_grads"]
            assert a.keys() == b.keys() and a
            for pname in a:
                assert torch.equal(a[pname], b[pname]), pname


def test_reference_moves_every_expert(reference):
    moved = [n for n in reference.weights if ".experts." in n
             and not torch.equal(reference.weights[n], reference.initial[n])]
    assert len(moved) == 6  # w1, w2, w3 of both layers


def test_interleaved_moe_with_expert_parallelism_matches_plain_loop():
    """Interleaved 1F1B (PP 2 x VP 2, one MoE layer per chunk) with DP 2 and EP 2 per
    stage, fed by the encoders: losses, grad norms, weights and zero counts as above."""
    moe = [o for o in MOE if "num_layers" not in o] + ["modules.language.num_layers=4",
                                                          "train.micro_batch_size=4"]
    overrides = moe + noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2, "data": 2}) \
        + par("language", expert=2)
    world = plan_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, _expert_grads, overrides, timeout_s=300)
    ref = reference_run(tuple(moe), NUM_ITERS, aux_objective)
    assert_steps_match(results, ref)
    _assert_module_norms(results, ref, {"vision", "audio", "language"})
    assert_weights_match(results, ref)
    assert any(r["expert_grads"] for r in results), "no expert-parallel shard found"
    for r in results:
        assert r["num_zeros"] == ref.num_zeros
