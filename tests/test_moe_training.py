"""An MoE language model trains through the engine exactly like a plain PyTorch loop.

The reference below is independent of the engine and of the MoE block's loss code: the
whole global batch in one forward, router logits captured with forward hooks, the
load-balancing and z losses written out from their definitions (per sample, weighted by
the sample's loss tokens, :mod:`mimotron.models.moe`), ``backward``,
``clip_grad_norm_`` and ``torch.optim.AdamW`` (tests/reference.py's optimizer and
schedule). The engine injects the aux gradient at each MoE layer's output; on a language
pipeline stage before the loss too (the PP 2 case).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mimotron.config import load_config
from mimotron.data import collate
from mimotron.estimate.flops import language_model_flops
from mimotron.forked_ranks import run_ranks
from mimotron.models.build import build_mimo_model, count_parameters
from mimotron.models.moe import MoEFeedForward
from tests.common import BASE, DIGITS, ONE_RANK, coloc, engine_run, module_of, noncolocated
from tests.reference import VOCAB_MULTIPLE, _clip, _data, _optimizer, lr_at

NUM_ITERS = 10
AUX, Z = 0.05, 0.01
MOE = ["train.iters=10", "modules.language.hidden_size=32", "modules.language.num_experts=4",
       "modules.language.top_k=2", "modules.language.moe_ffn_hidden_size=32",
       "modules.language.num_shared_experts=1", f"modules.language.moe_aux_loss_coeff={AUX}",
       f"modules.language.moe_z_loss_coeff={Z}", "modules.language.moe_layer_freq=[1, 1]"]
REL = 1e-4


def hand_aux_terms(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per sample ``AUX · E Σ_e f_e P_e + Z · mean lse²`` of softmax routing; ``[B, S, E]``."""
    num_experts = logits.shape[-1]
    probs = logits.softmax(-1)
    chosen = F.one_hot(probs.topk(top_k, -1).indices, num_experts).sum(2).float()
    frac = chosen.mean(1) / top_k
    aux = num_experts * (frac * probs.mean(1)).sum(-1)
    z = torch.logsumexp(logits, -1).pow(2).mean(1)
    return AUX * aux + Z * z


def reference(overrides: list[str], num_iters: int) -> dict:
    """The plain loop with the MoE objective (see module docstring)."""
    cfg = load_config(DIGITS, BASE + overrides)
    tokenizer, task = _data(tuple(overrides))
    vocab = -(-tokenizer.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                    for n in cfg.encoder_names}
    model = build_mimo_model(cfg, vocab, placeholders)
    captured: list[torch.Tensor] = []
    for layer in model.language_model.layers.values():
        layer.mlp.router.register_forward_hook(lambda _m, _i, out: captured.append(out))
    optimizer, schedules = _optimizer(cfg, model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stream, gbs = task.stream(cfg.train.seed), cfg.train.global_batch_size
    losses, norms = [], []
    for k in range(num_iters):
        batch = collate(stream.samples(k * gbs, gbs), task.seq_length, pad_id=task.pad_id,
                        image_shape=task.image_shape, audio_shape=task.audio_shape)
        optimizer.zero_grad(set_to_none=True)
        captured.clear()
        loss_sum, num_tokens, _ = model(batch)
        n_b = batch["loss_mask"].sum(1)
        shape = (*batch["tokens"].shape, -1)
        aux = sum((n_b * hand_aux_terms(c.view(shape), 2)).sum() for c in captured)
        ((loss_sum + aux) / num_tokens).backward()
        norms.append(_clip(optimizer, params))
        for group, schedule in zip(optimizer.param_groups, schedules, strict=True):
            group["lr"] = lr_at(k, *schedule)
        optimizer.step()
        losses.append(float(loss_sum.detach() / num_tokens))
    return {"losses": losses, "norms": norms,
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


LAYOUTS = {
    "one-rank": ONE_RANK,
    # Both MoE layers on the first language stage, the loss on the second.
    "language-pp2": noncolocated({}, {}, {"pipeline": 2})
    + ["modules.language.parallel.layers_per_stage=[1, 1]"],
    # Colocated; dense part TP 2 (routers and experts whole on both TP ranks) x DP 2.
    "coloc-language-tp2dp2": coloc({"data": 4}, {"data": 4}, {"tensor": 2, "data": 2}),
}


@pytest.fixture(scope="module")
def ref() -> dict:
    return reference(MOE, NUM_ITERS)


def _rel(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_engine_matches_plain_loop(layout: str, ref: dict) -> None:
    overrides = MOE + LAYOUTS[layout]
    world = 1 if layout == "one-rank" else 4
    results = run_ranks(world, engine_run, overrides, NUM_ITERS, timeout_s=300)
    for rank, res in enumerate(results):
        for it, (loss, norm, skipped, _) in enumerate(res["steps"]):
            assert not skipped
            assert _rel(loss, ref["losses"][it]) <= REL, (rank, it, loss, ref["losses"][it])
            assert _rel(norm, ref["norms"][it]) <= REL, (rank, it, norm, ref["norms"][it])
    seen = set()
    for res in results:
        for name, value in res["weights"].items():
            want = ref["weights"][name]
            err = float((value - want).norm() / want.norm().clamp_min(1e-12))
            assert err <= REL, (name, err)
            seen.add(name)
    assert any(".mlp.experts.w1" in n for n in seen)
    assert seen == set(ref["weights"])


def test_expert_lr_and_weight_decay_are_param_groups_of_their_own() -> None:
    """``optimizer.expert_lr`` / ``expert_weight_decay``: the plain loop's expert groups."""
    overrides = MOE + ONE_RANK + ["optimizer.weight_decay=0.1", "optimizer.expert_lr=4e-3",
                                  "optimizer.expert_weight_decay=0.0"]
    want = reference(overrides, NUM_ITERS)
    base = reference(MOE + ONE_RANK + ["optimizer.weight_decay=0.1"], NUM_ITERS)
    res = run_ranks(1, engine_run, overrides, NUM_ITERS, timeout_s=300)[0]
    for it, (loss, norm, _, _) in enumerate(res["steps"]):
        assert _rel(loss, want["losses"][it]) <= REL, (it, loss, want["losses"][it])
        assert _rel(norm, want["norms"][it]) <= REL, (it, norm, want["norms"][it])
    name = "language_model.layers.0.mlp.experts.w1"
    got = res["weights"][name]
    assert float((got - want["weights"][name]).norm() / want["weights"][name].norm()) <= REL
    # Not vacuous: the experts moved differently than with the module's lr and decay.
    assert float((got - base["weights"][name]).norm() / base["weights"][name].norm()) > 1e-3


def test_aux_loss_changes_the_router_gradient() -> None:
    """Without the aux terms the reference's router would train differently (test can fail)."""
    cfg = load_config(DIGITS, BASE + MOE)
    model = build_mimo_model(cfg, 64, {"vision": 1, "audio": 2})
    layer = model.language_model.layers["0"].mlp
    assert isinstance(layer, MoEFeedForward) and layer.aux_loss_coeff == AUX
    x = torch.randn(2, 5, 32)
    layer.aux_weights = torch.ones(2)
    layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()
    layer.zero_grad()
    layer(x).sum().backward()
    assert not torch.allclose(with_aux, layer.router.weight.grad)


def test_dense_default_builds_the_same_model() -> None:
    """num_experts = 0 (default) leaves the language model exactly as before."""
    dense = load_config(DIGITS, BASE)
    assert dense.modules["language"].num_experts == 0
    model = build_mimo_model(dense, 64, {"vision": 1, "audio": 2})
    assert not any(isinstance(m, MoEFeedForward) for m in model.modules())
    assert any(n.endswith("layers.0.mlp.w1.weight") for n, _ in model.named_parameters())


def test_layer_freq_and_parameter_counts() -> None:
    cfg = load_config(DIGITS, BASE + MOE[:-1] + ["modules.language.num_layers=4",
                                                 "modules.language.moe_layer_freq=2"])
    model = build_mimo_model(cfg, 64, {"vision": 1, "audio": 2})
    kinds = {i: type(lay.mlp).__name__ for i, lay in model.language_model.layers.items()}
    assert kinds == {"0": "MoEFeedForward", "1": "SwiGLU", "2": "MoEFeedForward",
                     "3": "SwiGLU"}
    n = sum(p.numel() for name, p in model.named_parameters() if module_of(name) == "language")
    assert count_parameters(cfg, "language", 64) == n


def test_flops_count_only_the_visited_experts() -> None:
    base = load_config(DIGITS, BASE + MOE)
    lm = base.modules["language"]
    more = load_config(DIGITS, BASE + MOE + ["modules.language.num_experts=8"])
    # More experts at the same top_k: the router grows, the expert compute does not.
    tokens = 4 * base.data.seq_length
    router_growth = 2 * 3 * tokens * lm.hidden_size * 4 * lm.num_layers / 3
    diff = (language_model_flops(more.modules["language"], 64, 4, base.data.seq_length)
            - language_model_flops(lm, 64, 4, base.data.seq_length))
    assert diff == pytest.approx(router_growth)
    k1 = load_config(DIGITS, BASE + MOE + ["modules.language.top_k=1"])
    fewer = (language_model_flops(lm, 64, 4, base.data.seq_length)
             - language_model_flops(k1.modules["language"], 64, 4, base.data.seq_length))
    expert = 3 * 2 * tokens * lm.hidden_size * lm.moe_ffn_hidden_size
    assert fewer == pytest.approx(expert * lm.num_layers)
    assert math.isfinite(fewer)


@pytest.mark.parametrize(("override", "field"), [
    ("modules.language.top_k=5", "modules.language.top_k=5"),
    ("modules.language.top_k=0", "modules.language.top_k=0"),
    ("modules.language.moe_router_score='relu'", "modules.language.moe_router_score"),
    ("modules.language.moe_layer_freq=[1, 0, 1]", "modules.language.moe_layer_freq"),
    ("modules.language.moe_layer_freq=0", "modules.language.moe_layer_freq=0"),
    ("modules.language.moe_aux_loss_coeff=-1", "modules.language.moe_aux_loss_coeff"),
    ("modules.language.moe_shared_expert_gate=true", "modules.language.moe_shared_expert_gate"),
    ("modules.vision.num_experts=2", "modules.vision.num_experts=2"),
])
def test_config_validation_names_the_field(override: str, field: str) -> None:
    extra = [o for o in MOE if "num_shared" not in o] if "gate" in override else MOE
    with pytest.raises(ValueError, match=field.replace("[", r"\[")) as err:
        load_config(DIGITS, BASE + extra + [override])
    assert "\n" not in str(err.value)


def _train_records(rank: int, world: int, overrides: list[str]) -> list[dict]:
    import json

    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo
    from mimotron.training.megatron_compat import train_mimo
    from mimotron.training.step import default_forward_step

    cfg = load_config(DIGITS, BASE + overrides)
    run = setup_mimo(cfg, init_runtime())
    train_mimo(default_forward_step, run.model, run.optimizer, run.schedulers,
               run.train_data_iterator, run.valid_data_iterator, run.global_state, run.infra,
               run.communicator)
    lines = (cfg.log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_metrics_log_aux_losses_and_expert_load(tmp_path) -> None:
    over = MOE + ONE_RANK + ["train.iters=2", "log.interval=2", f"log.dir={tmp_path}",
                             "modules.language.moe_layer_freq=2", "eval.iters=1"]
    (rec,) = run_ranks(1, _train_records, over, timeout_s=120)[0]
    assert 0.0 < rec["moe_aux_loss"] < 4.0 and rec["moe_z_loss"] > 0
    assert set(rec["moe_load_min"]) == {"0"} and rec["moe_dropped_tokens"] == 0
    # 2 iterations x 16 samples x 64 positions x top_k 2 choices over 4 experts.
    total = 2 * 16 * load_config(DIGITS, BASE).data.seq_length * 2
    assert rec["moe_load_min"]["0"] * 4 <= total <= rec["moe_load_max"]["0"] * 4
    assert 0 <= rec["moe_load_cv"]["0"] < 2


def test_plan_memory_splits_expert_and_dense_parameters() -> None:
    from mimotron.estimate.memory import estimate_memory
    from mimotron.parallel.layout import check_layout

    cfg = load_config(DIGITS, BASE + MOE + noncolocated({}, {}, {"tensor": 2}))
    model = build_mimo_model(cfg, 64, {"vision": 1, "audio": 2})
    named = [(n, p.numel()) for n, p in model.language_model.named_parameters()]
    experts = sum(c for n, c in named if ".mlp.experts." in n)
    whole = sum(c for n, c in named if ".mlp." in n) - experts
    dense = sum(c for _, c in named) - experts - whole
    lm = [e for items in estimate_memory(cfg, check_layout(cfg), 64).values() for e in items
          if e.module == "language"]
    assert len(lm) == 2 and all(e.num_params == dense // 2 + whole + experts for e in lm)
