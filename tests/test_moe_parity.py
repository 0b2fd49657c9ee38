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
* ``ep2-colocated-pp2``: every module on 4 ranks, language DP 2 x PP 2 with EP 2 per
  stage (the encoders before the language stages);
* ``ep2-tp2``: vision | audio | language TP 2 with EP 2 over the TP peers;
* ``ep2-etp2``: every module on 4 ranks, language EP 2 x expert TP 2 (the expert TP
  peers are DP replicas with different tokens);
* ``ep2-etp2-tp2``: colocated, language TP 2 x DP 2 with EP 2 x expert TP 2 (the
  expert TP peers are the dense TP peers);
* ``ep2-dp2-colocated-zero``: as ``ep2-dp2-colocated`` with ZeRO-1 (dense rows over
  DP 4, expert rows over expt_dp 2).
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, coloc, colocated, noncolocated, par
from tests.moe import MOE, expert_grads, moe_reference
from tests.parity import assert_matches_reference
from tests.reference import ReferenceRun

CASES: dict[str, list[str]] = {
    "ep2": colocated(2) + par("language", expert=2),
    "ep2-pp2-noncolocated": noncolocated({}, {}, {"pipeline": 2, "data": 2})
    + par("language", expert=2),
    "ep2-dp2-colocated": colocated(4) + par("language", expert=2),
    # Colocated with a pipelined language model: EP 2 over each stage's DP 2.
    "ep2-colocated-pp2": coloc({"data": 4}, {"data": 4}, {"data": 2, "pipeline": 2})
    + par("language", expert=2),
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


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    return moe_reference()


def _run(name: str) -> list[dict]:
    overrides = MOE + CASES[name]
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    return run_ranks(world, expert_grads, overrides, timeout_s=300)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_layout_matches_plain_loop(name, reference):
    results = _run(name)
    zero = "language" if "zero" in name else None
    assert_matches_reference(results, reference, {"vision", "audio", "language"} - {zero})
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
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, expert_grads, overrides, timeout_s=300)
    ref = moe_reference(moe)
    assert_matches_reference(results, ref, {"vision", "audio", "language"})
    assert any(r["expert_grads"] for r in results), "no expert-parallel shard found"
    for r in results:
        assert r["num_zeros"] == ref.num_zeros
