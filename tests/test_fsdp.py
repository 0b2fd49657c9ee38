"""FSDP2 per module trains like the plain PyTorch loop, saves, resumes and reshards.

Each parity case trains ``NUM_ITERS`` fp32 iterations through the engine with
``modules.<m>.parallel.fsdp = true`` and compares with the independent reference
(``tests/reference.py``): losses, grad norms (global and per module, from the full
gradients) and final weights, as ``tests/test_parity.py`` does for every other layout.
The cases cover what FSDP composes with: colocated (every module sharded over DP 2),
split (the vision encoder and the language model each on their own ranks), TP x FSDP on
a 2-D ``(dp, tp)`` mesh, and a pipeline stage (PP 2 x DP 2), with overlapped DP
reduction on for the modules that are not sharded, and activation recompute (selective,
full) on three of them. Vision has two layers in three cases (one unit's backward
prefetches another's gather), and several micro-batches per step in two (a split encoder
stage then sees micro-batches without images on one DP rank).

Checkpoints: a chain of runs resumes and reshards plain -> FSDP -> FSDP (same layout:
bit for bit) -> ZeRO-1 -> FSDP -> plain, every run following the plain loop.

Also: what a rank holds is ``1 / dp`` of the module (measured on the parameters'
local shards), and the validator refuses what FSDP cannot do with one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from mimotron.checkpoint import read_full_model
from mimotron.config import load_config
from mimotron.estimate.memory import estimate_memory
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, coloc, colocated, engine_run, noncolocated, train_step
from tests.parity import SMALL_MB, reference, run_against_plain_loop, training_records
from tests.resume_chain import PLAIN, ckpt, launch


def fsdp(*modules: str) -> list[str]:
    return [f"modules.{m}.parallel.fsdp=true" for m in modules]


ALL = ("vision", "audio", "language")
TWO_VISION_LAYERS = ["modules.vision.num_layers=2"]  # tests.common's model gives it one
CASES: dict[str, tuple[list[str], list[str]]] = {
    # Two vision layers: implicit backward prefetch walks from one block to another.
    "coloc-dp2-fsdp-all": (colocated(2) + fsdp(*ALL), TWO_VISION_LAYERS + SMALL_MB),
    "split-vision-language-dp2-fsdp-overlap-full": (
        noncolocated({"data": 2}, {}, {"data": 2}) + fsdp("vision", "language")
        + ["train.overlap_grad_reduce=true", "modules.vision.recompute='full'"],
        TWO_VISION_LAYERS + SMALL_MB),
    "coloc-language-tp2dp2-fsdp-selective": (
        coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2}) + fsdp("language", "vision")
        + ["modules.language.recompute='selective'", "modules.vision.recompute='full'"],
        TWO_VISION_LAYERS),
    "language-pp2dp2-fsdp-full-recompute": (
        noncolocated({}, {}, {"pipeline": 2, "data": 2}) + fsdp("language")
        + ["modules.language.recompute='full'"], []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_matches_plain_loop(name):
    run_against_plain_loop(*CASES[name])


# Short process-group timeouts: a rank that skips its FSDP collectives stops its peer
# within 20 s, and the harness names the collective where they diverge (not a silent
# 300-second hang).
SHORT_TIMEOUT_S = 20


def test_a_dp_rank_without_images_keeps_its_fsdp_peer_going():
    """Vision FSDP over DP 2, four micro-batches a step: in the third step one vision
    rank's slice of a micro-batch has no image. Its empty backward still gathers and
    reduce-scatters every unit, as its peer's backward does."""
    overrides = (noncolocated({"data": 2}, {}, {"data": 2}) + fsdp("vision", "language")
                 + TWO_VISION_LAYERS + SMALL_MB + [f"train.pg_timeout_s={SHORT_TIMEOUT_S}"])
    results = run_ranks(5, engine_run, overrides, 3, timeout_s=120,
                        pg_timeout_s=SHORT_TIMEOUT_S)
    assert [r["empty_encoder_outputs"] for r in results[:2]] == [0, 1]  # the path ran
    for r in results[1:]:
        assert r["steps"] == results[0]["steps"]
    for name, w in results[0]["weights"].items():  # the two vision ranks agree
        assert torch.equal(results[1]["weights"][name], w), name


def _held_fraction(rank: int, world: int, overrides: list[str]) -> dict[str, float]:
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo

    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    local, full = {}, {}
    for name, p in run.model.named_parameters():
        module = name.split(".")[0]
        value = p.to_local() if isinstance(p, DTensor) else p
        local[module] = local.get(module, 0) + value.numel()
        full[module] = full.get(module, 0) + p.numel()
    return {m: local[m] / full[m] for m in local}


def _held_after_a_step(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo

    run = setup_mimo(load_config(DIGITS, BASE + overrides), init_runtime())
    train_step(run)
    info = run.optimizer.module_infos["language"]
    local = [p.to_local() if isinstance(p, DTensor) else p for _, p in info.params]
    grads = [g.to_local() if isinstance(g, DTensor) else g
             for g in (p.grad for _, p in info.params) if g is not None]
    moments = [v.to_local() if isinstance(v, DTensor) else v
               for st in info.optimizer.state.values() for v in st.values()
               if torch.is_tensor(v) and v.dim() > 0]
    return {"vocab": run.model.language_model.embed.num_embeddings,
            "weights": sum(t.numel() * t.element_size() for t in local),
            "grads": sum(t.numel() * t.element_size() for t in grads),
            "optimizer": sum(t.numel() * t.element_size() for t in moments)}


def test_fsdp_rank_holds_what_the_estimate_says():
    """Weights, gradients and Adam moments of an FSDP module: 4 + 4 + 8 bytes per parameter
    over dp, measured on the tensors (summed over the DP ranks: dim-0 shards may be uneven)."""
    overrides = colocated(2) + fsdp("language")
    held = run_ranks(2, _held_after_a_step, overrides, timeout_s=120)
    cfg = load_config(DIGITS, BASE + overrides)
    vocab = held[0]["vocab"]
    est = next(e for e in estimate_memory(cfg, check_layout(cfg), vocab, [0])[0]
               if e.module == "language")
    for key in ("weights", "grads", "optimizer"):
        measured = sum(h[key] for h in held) / 2
        assert measured == pytest.approx(getattr(est, key), rel=0.01), key
    assert sum(h["weights"] for h in held) == 4 * est.num_params


def test_a_rank_holds_its_share_of_an_fsdp_module():
    overrides = colocated(2) + fsdp("language")
    for fractions in run_ranks(2, _held_fraction, overrides, timeout_s=120):
        top = [m for m in fractions if m.startswith("language")]
        assert top and all(abs(fractions[m] - 0.5) < 0.01 for m in top), fractions
        others = [m for m in fractions if m not in top]
        assert others and all(fractions[m] == 1.0 for m in others), fractions


@pytest.mark.parametrize(("extra", "needle"), [
    (["modules.language.parallel.shard_optimizer=true"], "shard_optimizer=true"),
    (["modules.language.freeze=true"], "freeze=true"),
    (["modules.language.num_experts=4"], "num_experts=4"),
])
def test_fsdp_refusals_name_the_field(extra, needle):
    cfg = load_config(DIGITS, BASE + colocated(2) + fsdp("language") + extra)
    with pytest.raises(ValueError, match=needle):
        check_layout(cfg)


def test_reference_weights_are_full_tensors():
    # The reference never shards: guard against a DTensor leaking into it.
    ref = reference([])
    assert all(isinstance(v, torch.Tensor) and not isinstance(v, DTensor)
               for v in ref.weights.values())


# ---- resume and reshard: plain -> FSDP -> (FSDP, bitwise) -> ZeRO-1 -> FSDP -> plain
# On 2 ranks (TP x FSDP is covered by the parity cases above): every module FSDP over DP 2,
# or every module ZeRO-1 over DP 2.
FSDP_DP2 = colocated(2) + fsdp(*ALL)
ZERO_DP2 = colocated(2) + [f"modules.{m}.parallel.shard_optimizer=true" for m in ALL]


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """Every run of the chain (12 iterations, a checkpoint every 3); returns their root."""
    root = tmp_path_factory.mktemp("fsdp_chain")
    launch(root, "ref", 1, PLAIN, None, 12)
    launch(root, "fsdp", 2, FSDP_DP2, ckpt(root, "ref", 3), 9)
    launch(root, "fsdp-again", 2, FSDP_DP2, ckpt(root, "fsdp", 6), 9)
    launch(root, "zero-from-fsdp", 2, ZERO_DP2, ckpt(root, "fsdp", 6), 9)
    launch(root, "fsdp-from-zero", 2, FSDP_DP2, ckpt(root, "zero-from-fsdp", 9), 12)
    launch(root, "plain-from-fsdp", 1, PLAIN, ckpt(root, "fsdp", 9), 12)
    return root


@pytest.mark.parametrize("name,first,last", [
    ("fsdp", 4, 9), ("zero-from-fsdp", 7, 9), ("fsdp-from-zero", 10, 12),
    ("plain-from-fsdp", 10, 12)])
def test_resharded_fsdp_runs_follow_the_plain_loop(chain, name, first, last):
    got = training_records(chain / name)
    want = {r["iteration"]: r for r in training_records(chain / "ref")}
    assert [r["iteration"] for r in got] == list(range(first, last + 1))
    for r in got:
        w = want[r["iteration"]]
        assert r["loss"] == pytest.approx(w["loss"], rel=1e-4), (name, r["iteration"])
        assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (name, r["iteration"])


def test_fsdp_resume_in_the_same_layout_is_bitwise(chain):
    straight = {r["iteration"]: r for r in training_records(chain / "fsdp")}
    resumed = training_records(chain / "fsdp-again")
    assert [r["iteration"] for r in resumed] == [7, 8, 9]
    for r in resumed:
        want = straight[r["iteration"]]
        assert (r["loss"], r["grad_norm"]) == (want["loss"], want["grad_norm"])
    a, _ = read_full_model(ckpt(chain, "fsdp", 9))
    b, _ = read_full_model(ckpt(chain, "fsdp-again", 9))
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
