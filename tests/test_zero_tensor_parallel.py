"""ZeRO-1 with tensor parallelism: checkpoints resume bit for bit and reshard; bytes held.

One chain of runs through the real training loop (``run_training``), every module's
optimizer sharded (``shard_optimizer``) except in the plain runs, 12 fp32 iterations
of warm-up then cosine decay, checkpoints every 3 iterations:

* ``ref``: the plain loop, one rank, no ZeRO (it also saves the plain checkpoints);
* ``tp``: language TP 2 x DP 2 and encoders DP 4 on 4 colocated ranks (ZeRO state over
  a ``(tp, dp)`` mesh), resumed from the plain checkpoint at 3 and run to 9;
* ``tp-again``: ``tp``'s layout resumed from its own checkpoint at 6, with both overlaps
  on (``overlap_grad_reduce``, ``overlap_param_gather``): iterations 7-9 and the saved
  weights must equal ``tp``'s bit for bit;
* ``dp4``: every module DP 4 with ZeRO, resumed from ``tp``'s checkpoint at 6;
* ``tp-from-dp4``: the TP layout resumed from ``dp4``'s checkpoint at 9;
* ``plain-from-tp``: the one-rank plain loop resumed from ``tp``'s checkpoint at 9.

Every run follows ``ref`` within 1e-4 relative (loss, grad norm) from its first resumed
iteration on, which needs the optimizer state: a wrongly resharded Adam moment shows at
once. ``tp`` also measures what each rank holds: parameters, their gradients and the
inner optimizers' Adam moments, summed from the tensors themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mimotron.checkpoint import read_full_model
from mimotron.config import MimoConfig, load_config
from mimotron.estimate.memory import estimate_memory
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.layout import check_layout
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, DIGITS, coloc, colocated_plain, par, train_step
from tests.moe import MOE
from tests.parity import assert_records_follow, records_by_iteration, training_records
from tests.resume_chain import COMMON, PLAIN, ckpt, launch, optimizer_holdings

ZERO = [f"modules.{m}.parallel.shard_optimizer=true" for m in ("vision", "audio", "language")]
TP_ZERO = coloc({"data": 4, "tensor": 1}, {"data": 4, "tensor": 1},
                {"tensor": 2, "data": 2}) + ZERO
DP4_ZERO = colocated_plain(4) + ZERO
OVERLAP = ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true",
           "train.grad_bucket_mb=0.05"]
REL = 1e-4


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> dict[str, Any]:
    """Every run of the chain (module docstring); returns the root and ``tp``'s holdings."""
    root = tmp_path_factory.mktemp("zero_tp")
    launch(root, "ref", 1, PLAIN, None, 12)
    held = launch(root, "tp", 4, TP_ZERO, ckpt(root, "ref", 3), 9)
    launch(root, "tp-again", 4, TP_ZERO + OVERLAP, ckpt(root, "tp", 6), 9)
    launch(root, "dp4", 4, DP4_ZERO, ckpt(root, "tp", 6), 9)
    launch(root, "tp-from-dp4", 4, TP_ZERO, ckpt(root, "dp4", 9), 12)
    launch(root, "plain-from-tp", 1, PLAIN, ckpt(root, "tp", 9), 12)
    return {"root": root, "held": held}


@pytest.mark.parametrize("name,first,last", [
    ("tp", 4, 9), ("dp4", 7, 9), ("tp-from-dp4", 10, 12), ("plain-from-tp", 10, 12)])
def test_resharded_runs_follow_the_plain_loop(chain, name, first, last):
    root = chain["root"]
    got = training_records(root / name)
    assert [r["iteration"] for r in got] == list(range(first, last + 1))
    assert_records_follow(got, training_records(root / "ref"), REL, lr_rel=None, same=())


def test_resume_in_the_same_layout_is_bitwise(chain):
    """Same layout (overlaps on this time): the same losses, norms and weights, bit for bit."""
    root = chain["root"]
    straight = records_by_iteration(root / "tp")
    resumed = training_records(root / "tp-again")
    assert [r["iteration"] for r in resumed] == [7, 8, 9]
    for r in resumed:
        assert (r["loss"], r["grad_norm"]) == (straight[r["iteration"]]["loss"],
                                               straight[r["iteration"]]["grad_norm"])
    a, _ = read_full_model(ckpt(root, "tp", 9))
    b, _ = read_full_model(ckpt(root, "tp-again", 9))
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_bytes_per_parameter_per_rank(chain):
    """fp32 weights 4 B + gradients 4 B + Adam moments 8 B / d per local element.

    d is the module's DP degree: language 2 (its TP shards split over dp), encoders 4.
    The moments are exactly two fp32 values per fragment element; the fragments of one
    TP shard's DP ranks tile it (their sum is the shard), each within one row per
    parameter of an even share.
    """
    held = chain["held"]
    for rank, modules in enumerate(held):
        assert set(modules) == {"vision", "audio", "language"}
        for name, h in modules.items():
            n, d = h["numel"], h["dp"]
            assert d == (2 if name == "language" else 4), (rank, name)
            assert h["weights"] == 4 * n and h["grads"] == 4 * n, (rank, name)
            assert abs(h["moments"] - 8 * n / d) <= 8 * h["one_row"], (rank, name, h)
            per_param = (h["weights"] + h["grads"] + h["moments"]) / n
            assert per_param == pytest.approx(4 + 4 + 8 / d, abs=8 * h["one_row"] / n)
    # language TP 2 x DP 2 (ranks 0-1 and 2-3 are TP pairs; 0 and 2 hold one TP shard).
    for tp_rank in (0, 1):
        pair = [held[r]["language"] for r in (tp_rank, tp_rank + 2)]
        assert pair[0]["numel"] == pair[1]["numel"]
        assert sum(h["moments"] for h in pair) == 8 * pair[0]["numel"]
    for name in ("vision", "audio"):
        assert sum(h[name]["moments"] for h in held) == 8 * held[0][name]["numel"]


def _estimate_matches(cfg: MimoConfig, rank: int, held: dict[str, dict[str, int]]) -> None:
    """``estimate_memory``'s weights, grads and optimizer state against what was measured.

    The estimate divides every dense parameter by TP (norms are whole on each TP rank,
    a few hundred elements here), hence the 1% tolerance; ZeRO's split is the part
    under test.
    """
    estimates = {e.module: e for e in estimate_memory(cfg, check_layout(cfg), 64, [rank])[rank]}
    for name, h in held.items():
        e = estimates[name]
        for key, got in (("weights", e.weights), ("grads", e.grads), ("optimizer", e.optimizer)):
            want = h["moments"] if key == "optimizer" else h[key]
            assert got == pytest.approx(want, rel=0.01), (rank, name, key, got, want)


def test_memory_estimate_counts_the_zero_split(chain):
    cfg = load_config(DIGITS, COMMON + TP_ZERO)
    for rank, held in enumerate(chain["held"]):
        _estimate_matches(cfg, rank, held)


def _one_step(rank: int, world: int, overrides: list[str]) -> dict[str, dict[str, int]]:
    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    train_step(run)
    return optimizer_holdings(run.optimizer)


def test_expert_tensor_zero_holds_expert_rows_over_expt_dp():
    """MoE on 4 colocated DP ranks, expert TP 2 (the expert-TP peers are DP ranks): dense
    rows over dp 4, each expert-TP shard's rows over expt_dp 2; ``mimotron plan``'s
    estimate says the same."""
    overrides = MOE + colocated_plain(4) + ZERO + par("language", expert_tensor=2)
    held = run_ranks(4, _one_step, overrides, timeout_s=300)
    cfg = load_config(DIGITS, BASE + overrides)
    for rank, modules in enumerate(held):
        h = modules["language"]
        experts = h["expert_numel"]
        assert experts > 0 and h["weights"] == h["grads"] == 4 * h["numel"]
        want = 8 * ((h["numel"] - experts) / 4 + experts / 2)
        assert h["moments"] == pytest.approx(want, abs=8 * h["one_row"]), (rank, h)
        _estimate_matches(cfg, rank, modules)
