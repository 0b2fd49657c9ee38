"""Activation recompute (``modules.<m>.recompute``): exact training, less kept, estimated.

* Parity: full and selective recompute over the layout classes whose layers hold
  collectives or hooks (DP with ZeRO-1 and both overlaps, TP with sequence parallelism,
  interleaved pipelines, context parallelism colocated and not, expert parallelism over
  TP peers, the Hugging Face families) train like the plain PyTorch loop of
  ``tests/reference.py``, which does not recompute, with ``tests/test_parity.py``'s
  checks and tolerances; every rank's checkpointed regions ran twice (forward and
  recomputation), so recompute was not a no-op. Every run is replayed under NCCL's rules
  (``tests/conftest.py``), recomputed collectives included.
* What a layer keeps for backward, counted as the storages its forward creates that are
  still alive after it (each once): full < selective < none, full = the layer's input;
  selective under context parallelism drops the gathered keys and values; the memory
  estimate (``mimotron.estimate.memory``) says the same.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mimotron.models.recompute as recompute_module
from benchmarks.recompute import fake_group, kept_per_layer
from mimotron import host_sync
from mimotron.config import load_config
from mimotron.dryrun import dry_run
from mimotron.estimate.memory import (
    activation_bytes,
    context_kv_bytes_per_sample,
    estimate_memory,
    layer_bytes_per_sample,
    recompute_dropped_bytes,
)
from mimotron.forked_ranks import run_ranks
from mimotron.models.build import build_module
from mimotron.models.moe import pop_moe_stats, set_aux_loss_weights
from mimotron.models.recompute import apply_recompute, recompute_mode, recomputed_layer_ids
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, coloc, colocated, engine_run, noncolocated, par
from tests.hf_models import check_against_reference, hf_overrides, save_models
from tests.moe import MOE, expert_grads, moe_reference
from tests.parity import assert_matches_reference, run_against_plain_loop

ZERO = [f"modules.{m}.parallel.shard_optimizer=true" for m in ("vision", "audio", "language")]
FOUR_MB = ["train.micro_batch_size=4"]
LANGUAGE_4 = ["modules.language.num_layers=4"]


def recompute(**modes: str) -> list[str]:
    """``modules.<m>.recompute`` overrides, e.g. ``recompute(language="full")``."""
    return [f"modules.{m}.recompute='{mode}'" for m, mode in modes.items()]


# name: (layout and recompute, overrides shared with the reference)
CASES: dict[str, tuple[list[str], list[str]]] = {
    # ZeRO-1's gather pre-hooks fire again in recomputation; overlap's gradient hooks once.
    "coloc-dp2-zero-overlap": (
        colocated(2) + ZERO
        + ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true",
           "train.grad_bucket_mb=0.05", "modules.language.recompute_num_layers=1"]
        + recompute(vision="full", audio="selective", language="full"), []),
    # DTensor TP plans and the sequence-parallel all-gathers inside the layers.
    "coloc-language-tp2-sp": (
        coloc({"data": 2}, {"data": 2}, {"tensor": 2, "sequence_parallel": "true", "data": 1})
        + recompute(vision="full", audio="full", language="selective"), []),
    # Interleaved 1F1B: micro-batches and chunks in flight, recomputed out of order.
    "language-pp2vp2": (noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2})
                        + recompute(language="full"), LANGUAGE_4 + FOUR_MB),
    # The CP key/value all-gather is re-issued by both modes (colocated CP bridge too).
    "coloc-language-cp2-full": (coloc({"data": 2}, {"data": 2}, {"context": 2, "data": 1})
                                + recompute(language="full"), []),
    "language-cp2-selective": (noncolocated({}, {}, {"context": 2})
                               + recompute(language="selective"), []),
}


def _counting(rank: int, world: int, run: Callable[..., dict], *args: Any) -> dict:
    """``run`` on this rank, counting checkpointed regions and how often each ran.

    Regions on an empty input (an encoder slice without a sample of its modality) are
    left out: their output carries nothing back, so their backward may never run.
    """
    counts = {"regions": 0, "runs": 0}
    checkpointed = recompute_module._checkpoint

    def counting(function: Callable[..., Any], *a: Any, **k: Any) -> Any:
        if isinstance(a[0], torch.Tensor) and a[0].numel() == 0:
            return checkpointed(function, *a, **k)
        counts["regions"] += 1

        def counted(*fa: Any, **fk: Any) -> Any:
            counts["runs"] += 1
            return function(*fa, **fk)

        return checkpointed(counted, *a, **k)

    recompute_module._checkpoint = counting  # this forked rank only
    return {**run(rank, world, *args), **counts}


def _counted_engine_run(rank: int, world: int, *args: Any) -> dict:
    return _counting(rank, world, engine_run, *args)


def _assert_recomputed(results: list[dict]) -> None:
    """Every checkpointed region ran twice: its forward and its recomputation."""
    assert sum(r["regions"] for r in results) > 0, "no layer was checkpointed"
    for rank, r in enumerate(results):
        assert r["runs"] == 2 * r["regions"], f"rank {rank}: {r['runs']} runs, {r['regions']}"


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_matches_plain_loop(name: str) -> None:
    results = run_against_plain_loop(*CASES[name], run=_counted_engine_run)
    _assert_recomputed(results)


def test_recompute_moe_with_expert_parallelism_matches_plain_loop() -> None:
    """Full recompute of MoE layers, EP 2 over TP 2 peers (colocated): the all-to-alls,
    the TP gathers of the routed output and the aux-loss injection all run again."""
    overrides = MOE + coloc({"data": 2}, {"data": 2}, {"tensor": 2, "data": 1}) \
        + par("language", expert=2) + recompute(language="full")
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, _counting, expert_grads, overrides, timeout_s=300)
    ref = moe_reference(MOE, 10)
    assert_matches_reference(results, ref, {"vision", "audio", "language"})
    for r in results:
        assert r["num_zeros"] == ref.num_zeros
    _assert_recomputed(results)


def test_recompute_hf_families_match_plain_loop(tmp_path: Path) -> None:
    """A CLIP tower (selective), a Whisper encoder (full) and a Llama decoder with
    grouped-query attention (full on its first layer) on two colocated DP ranks."""
    paths = save_models(tmp_path)
    shared = hf_overrides(paths)
    overrides = shared + colocated(2) + ["modules.language.recompute_num_layers=1"] \
        + recompute(vision="selective", audio="full", language="full")
    results = check_against_reference(paths, shared, overrides, 2, run=_counted_engine_run)
    _assert_recomputed(results)


# ---- what a layer keeps --------------------------------------------------------------


def _cfg(name: str, mode: str, num_layers: int, precision: str = "fp32") -> Any:
    return load_config(DIGITS, [f"train.precision={precision}", f"modules.{name}.num_layers="
                                f"{num_layers}", *recompute(**{name: mode})])


@pytest.mark.parametrize(("name", "precision"), [("language", "fp32"), ("language", "bf16"),
                                                 ("vision", "fp32")])
def test_full_keeps_the_layer_input_and_selective_less_than_none(name: str, precision: str
                                                                 ) -> None:
    kept = {m: kept_per_layer([f"train.precision={precision}"], name, m)
            for m in ("none", "selective", "full")}
    cfg = {m: _cfg(name, m, 2, precision) for m in kept}
    assert kept["full"] < kept["selective"] < kept["none"], kept
    # full: the layer's input only, [tokens, hidden] in the residual stream's dtype; the
    # estimate keeps exactly that per layer.
    assert kept["full"] == layer_bytes_per_sample(cfg["full"], name) - recompute_dropped_bytes(
        cfg["full"], name), kept
    # selective: the input, the matmuls' and SDPA's outputs; the estimate counts all
    # but SDPA's log-sum-exp (4 bytes per head and token), as it does without recompute.
    mod = cfg["none"].modules[name]
    tokens = cfg["none"].data.seq_length if name == "language" else mod.num_output_tokens
    assert kept["selective"] == layer_bytes_per_sample(cfg["selective"], name) \
        - recompute_dropped_bytes(cfg["selective"], name) + 4 * mod.num_heads * tokens
    assert kept["selective"] < 0.7 * kept["none"], kept


def _cp_kept(rank: int, world: int, mode: str) -> int:
    return kept_per_layer([], "language", mode, fake_group())  # see _tp_selective


def test_selective_drops_the_gathered_keys_and_values_under_context_parallelism() -> None:
    none, selective = (run_ranks(2, _cp_kept, m, timeout_s=120) for m in ("none", "selective"))
    cp = ["modules.language.parallel.context=2"]
    cfg = load_config(DIGITS, cp)
    heads, local = cfg.modules["language"].num_heads, cfg.data.seq_length // 2
    sel = load_config(DIGITS, cp + recompute(language="selective"))
    kept = layer_bytes_per_sample(sel, "language") - recompute_dropped_bytes(sel, "language")
    for rank in range(2):
        # The gathered keys and values are not kept (the gather runs again), SDPA's
        # log-sum-exp is (4 bytes per head and local query, not in the estimate).
        assert selective[rank] == kept + 4 * heads * local
        assert none[rank] - selective[rank] > context_kv_bytes_per_sample(cfg, "language")


class _Collectives(TorchDispatchMode):
    """Counts the collectives (functional and c10d) dispatched while on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func.namespace in ("_c10d_functional", "c10d"):
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tp_selective(rank: int, world: int, sequence_parallel: bool) -> dict[str, Any]:
    """One TP 2 language layer (bf16) per mode: the collectives of its backward, its
    gradients, and what it keeps per sample (two layers minus one, 3 samples minus 2)."""
    from torch.distributed.device_mesh import DeviceMesh

    from benchmarks.recompute import kept_bytes
    from mimotron.parallel.tensor_parallel import apply_tensor_parallel

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    # Bytes are counted over a fake group of the same ranks: a gloo worker thread lets go
    # of a finished collective's buffers a moment after the wait returns, so over gloo a
    # buffer the layer does not keep is sometimes still alive when the count is taken.
    fake_mesh = DeviceMesh.from_group(fake_group(), "cpu")

    def built(mode: str, layers: int, on: DeviceMesh = mesh) -> nn.Module:
        cfg = load_config(DIGITS, ["train.precision=bf16", f"modules.language.num_layers={layers}"])
        torch.manual_seed(0)
        module = apply_tensor_parallel(build_module(cfg, "language", 64), on, True,
                                       sequence_parallel)
        apply_recompute(module, mode)
        return module

    out: dict[str, Any] = {}
    for mode in ("none", "selective"):
        kept = {}
        for layers, samples in ((1, 2), (1, 3), (2, 2), (2, 3)):
            module = built(mode, layers, fake_mesh)
            x = torch.randn(samples, 64, 128, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                kept[layers, samples] = kept_bytes(lambda m=module, x=x: m(x))
            module = built(mode, layers)  # autocast's weight casts are cached per module
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(x)
            comm = _Collectives()
            with comm:
                _full(y).float().square().mean().backward()
        grads = {n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None}
        out[mode] = (dict(comm.calls), None, grads,
                     (kept[2, 3] - kept[1, 3]) - (kept[2, 2] - kept[1, 2]))
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_selective_under_tensor_parallelism_keeps_collectives(sequence_parallel: bool) -> None:
    """TP 2 (and + SP): selective keeps the reductions' outputs, so its backward issues
    no collective that the backward without recompute does not, but the sequence-parallel
    input gathers (two per layer: their outputs are the gathered input SP does not keep);
    gradients are bitwise those without recompute; the layer keeps what the estimate
    says (plus SDPA's log-sum-exp) and, under SP, less than SP alone."""
    results = run_ranks(2, _tp_selective, sequence_parallel, timeout_s=180)
    sp = "true" if sequence_parallel else "false"
    cfg = load_config(DIGITS, ["train.precision=bf16", "modules.language.parallel.tensor=2",
                               f"modules.language.parallel.sequence_parallel={sp}",
                               *recompute(language="selective")])
    estimate = layer_bytes_per_sample(cfg, "language") - recompute_dropped_bytes(cfg, "language")
    lse = 4 * 2 * 64  # 2 local heads x 64 tokens, fp32
    gather = "_c10d_functional.all_gather_into_tensor.default"
    for r in results:
        (none_comm, _, none_grads, none_kept), (comm, _, grads, kept) = \
            r["none"], r["selective"]
        extra = Counter(comm) - Counter(none_comm)
        assert set(extra) <= {gather, "_c10d_functional.wait_tensor.default",
                              "_c10d_functional._wrap_tensor_autograd.default"}, extra
        assert extra[gather] == (2 * 2 if sequence_parallel else 0), extra
        assert all(torch.equal(grads[n], none_grads[n]) for n in none_grads)
        assert kept == estimate + lse and kept < none_kept, (kept, estimate, none_kept)


# ---- recomputation runs, exactly ------------------------------------------------------


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _count_calls(module: nn.Module) -> dict[str, int]:
    """Count the calls of every layer's attention norm and attention core (live dict)."""
    calls = {"norm": 0, "core": 0}

    def norm_called(*_: Any) -> None:
        calls["norm"] += 1

    def counting(core: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def counted_core(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls["core"] += 1
            return core(*args, **kwargs)

        return counted_core

    for layer in module.layers.values():
        layer.attn_norm.register_forward_pre_hook(norm_called)
        layer.attn.core = counting(layer.attn.core)
    return calls


def test_a_checkpointed_layer_runs_its_forward_again_in_backward_and_exactly() -> None:
    cfg = load_config(DIGITS, ["modules.language.num_layers=3"])
    torch.manual_seed(0)
    base = build_module(cfg, "language", 64)
    x = torch.randn(2, 64, 128)
    results = {}
    for mode, num_layers in (("none", 0), ("selective", 0), ("full", 0), ("full", 2)):
        module = copy.deepcopy(base)
        calls = _count_calls(module)  # first: selective then checkpoints the counting core
        chosen = apply_recompute(module, mode, num_layers)
        xi = x.clone().requires_grad_()
        module(xi).square().mean().backward()
        results[mode, num_layers] = (chosen, calls, xi.grad, _grads(module))
    none = results["none", 0]
    assert results["full", 0][0] == [0, 1, 2] and results["full", 2][0] == [0, 1]
    # Per layer: 1 forward, + 1 recomputation where checkpointed (the core inside the
    # layer's forward too).
    assert none[1] == {"norm": 3, "core": 3}
    assert results["selective", 0][1] == {"norm": 6, "core": 6}
    assert results["full", 0][1] == {"norm": 6, "core": 6}
    assert results["full", 2][1] == {"norm": 5, "core": 5}
    for key, (_, _, grad_x, grads) in results.items():
        assert torch.equal(grad_x, none[2]), key
        assert grads.keys() == none[3].keys() and all(
            torch.equal(grads[n], none[3][n]) for n in grads), key
    layers = copy.deepcopy(base)
    apply_recompute(layers, "selective")
    assert {recompute_mode(layer) for layer in layers.layers.values()} == {"selective"}


def test_moe_recomputation_sees_its_own_micro_batchs_aux_weights() -> None:
    """Two micro-batches in flight, a third's weights set when the backwards run (as
    under 1F1B): recomputation uses each forward's weights and records no statistics."""
    cfg = load_config(DIGITS, [o for o in MOE if o != "train.iters=10"])
    torch.manual_seed(0)
    base = build_module(cfg, "language", 64)
    xs = [torch.randn(2, 16, 32) for _ in range(2)]
    weights = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.5])]
    pending = torch.tensor([7.0, 9.0])
    out = {}
    for mode in ("none", "full", "selective"):
        module = copy.deepcopy(base)
        apply_recompute(module, mode)
        losses = []
        for x, w in zip(xs, weights, strict=True):
            set_aux_loss_weights(module, w)
            losses.append(module(x.requires_grad_()).square().mean())
        set_aux_loss_weights(module, pending)
        for loss in losses:
            loss.backward()
        stats = pop_moe_stats(module)
        assert all(layer.aux_weights is pending for layer in
                   (m for m in module.modules() if hasattr(m, "aux_weights")))
        out[mode] = (_grads(module), [x.grad.clone() for x in xs],
                     {n: (s.tokens_per_expert, float(s.aux_sum), s.num_samples)
                      for n, s in stats.items()})
        for x in xs:
            x.grad = None
    for mode in ("full", "selective"):
        grads, x_grads, stats = out[mode]
        assert grads.keys() == out["none"][0].keys()
        assert all(torch.equal(grads[n], out["none"][0][n]) for n in grads), mode
        assert all(torch.equal(a, b) for a, b in zip(x_grads, out["none"][1], strict=True))
        assert {n: (s[0].tolist(), s[1], s[2]) for n, s in stats.items()} == {
            n: (s[0].tolist(), s[1], s[2]) for n, s in out["none"][2].items()}, mode


# ---- configuration and estimate -------------------------------------------------------


def test_recompute_keys_are_validated_at_load() -> None:
    with pytest.raises(ValueError, match=r"modules\.language\.recompute='some' is invalid: "
                                         r"expected one of \('none', 'selective', 'full'\)"):
        load_config(DIGITS, ["modules.language.recompute='some'"])
    with pytest.raises(ValueError, match=r"modules\.vision\.recompute_num_layers=3 is invalid"):
        load_config(DIGITS, ["modules.vision.recompute='full'",
                             "modules.vision.recompute_num_layers=3"])
    with pytest.raises(ValueError, match=r"recompute_num_layers=1 is invalid.*recompute='none'"):
        load_config(DIGITS, ["modules.language.recompute_num_layers=1"])
    with pytest.raises(ValueError, match=r"recompute='partial' is invalid"):
        apply_recompute(nn.Linear(1, 1), "partial")


def test_recompute_num_layers_takes_the_first_of_each_chunk() -> None:
    assert recomputed_layer_ids([[0, 1, 2]], 0) == [0, 1, 2]
    assert recomputed_layer_ids([[0, 1, 2]], 2) == [0, 1]
    # Interleaved: chunks [0, 1] and [4, 5] of a rank of PP 2 x VP 2 over 8 layers.
    assert recomputed_layer_ids([[0, 1], [4, 5]], 1) == [0, 4]
    assert recomputed_layer_ids([[0, 1], [4, 5]], 3) == [0, 1, 4, 5]


def test_estimate_follows_recompute() -> None:
    layout = noncolocated({}, {}, {"pipeline": 2, "virtual_pipeline": 2}) + [
        "modules.language.num_layers=8"]
    by_mode = {}
    for mode, n in (("none", 0), ("selective", 0), ("full", 0), ("full", 1)):
        extra = [f"modules.language.recompute_num_layers={n}"] if n else []
        cfg = load_config(DIGITS, BASE + layout + recompute(language=mode) + extra)
        per_layer = layer_bytes_per_sample(cfg, "language")
        samples = cfg.train.micro_batch_size
        # Stage 0 holds chunks [0, 1] and [4, 5]: with n = 1, layers 0 and 4 recompute.
        recomputed = {"none": 0, "selective": 4, "full": 4 if n == 0 else 2}[mode]
        want = (activation_bytes(load_config(DIGITS, BASE + layout), "language", 64, 1, 0)
                - recomputed * recompute_dropped_bytes(cfg, "language") * samples / 2)
        assert activation_bytes(cfg, "language", 64, 1, 0) == int(want), (mode, n)
        est = {e.module: e for e in estimate_memory(cfg, check_layout(cfg), 64, [2])[2]}
        by_mode[mode, n] = (est["language"].activations, est["language"].workspace, per_layer)
    none, full, selective = by_mode["none", 0], by_mode["full", 0], by_mode["selective", 0]
    assert full[0] < selective[0] < none[0] and full[0] < by_mode["full", 1][0] < none[0]
    # The backward of a recomputed layer holds its recomputed activations once more.
    cfg = load_config(DIGITS, BASE + layout + recompute(language="full"))
    assert full[1] - none[1] == cfg.train.micro_batch_size * recompute_dropped_bytes(
        cfg, "language")


def test_dry_run_with_recompute_routes_again_in_backward() -> None:
    """On the fake device (``mimotron.dryrun``) recompute keeps every tensor there; full
    recompute of an MoE layer routes again in backward, so the routing counts are read
    twice per layer and micro-batch (2 layers x 2 micro-batches x 2)."""
    cfg = load_config(DIGITS, BASE + colocated(2) + par("language", expert=2)
                      + ["modules.language.num_experts=4", "modules.language.top_k=2"]
                      + recompute(vision="selective", language="full"))
    (report,) = dry_run(cfg, [0], steps=1, evaluate=False, checkpoint=False)
    assert report.steps[0].host_reads == {host_sync.TOKEN_COUNT: 1, host_sync.WORLD_SUMS: 1,
                                          host_sync.EXPERT_COUNTS: 8}, report.format()


def _bf16_step(mode: str) -> tuple[float, float, dict[str, torch.Tensor]]:
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo
    from tests.common import ONE_RANK, train_step

    cfg = load_config(DIGITS, [*BASE, *ONE_RANK, "train.precision=bf16",
                               *recompute(vision=mode, audio=mode, language=mode)])
    run = setup_mimo(cfg, init_runtime())
    loss, _, norm, _ = train_step(run)
    weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    dist.destroy_process_group()
    return loss["loss"], norm, weights


def test_bf16_step_is_bitwise_the_same_with_recompute() -> None:
    """Under autocast (one weight cast per step, kept across the backward) the
    recomputation casts nothing anew: loss, grad norm and updated weights are bitwise
    those without recompute."""
    none = _bf16_step("none")
    for mode in ("selective", "full"):
        got = _bf16_step(mode)
        assert got[:2] == none[:2], mode
        assert all(torch.equal(got[2][n], none[2][n]) for n in none[2]), mode
