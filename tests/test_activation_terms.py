"""MoE layers and packed rows in the activation estimate, against autograd's tensors.

As ``tests/test_memory_estimate.py`` does for dense layers: the real language model runs
forward (and its loss) for 3 and 2 samples, and the distinct storages autograd saves are
counted; their difference is one sample's. The estimate
(``activation_bytes(in_flight=1)`` per sample) must account for it within 1%, from
below (small per-token terms are left out), with routed experts of several ``top_k``,
expert and shared-expert widths, fp32 and bf16. Packed rows: no mask, from the difference
between packed and unpacked runs of 2 and 4 layers.
"""

from __future__ import annotations

import pytest
import torch

from mimotron.config import load_config
from mimotron.estimate.memory import activation_bytes
from mimotron.models.attention import Documents
from mimotron.models.build import build_module
from tests.common import DIGITS
from tests.saved_bytes import SEQ, VOCAB, language_bytes_per_sample, saved_bytes

MOE_CASES = {
    "E4-top1": ["modules.language.num_experts=4", "modules.language.top_k=1"],
    "E4-top3": ["modules.language.num_experts=4", "modules.language.top_k=3"],
    "E16-top2-narrow": ["modules.language.num_experts=16", "modules.language.top_k=2",
                        "modules.language.moe_ffn_hidden_size=64"],
    "shared-gated-every-2nd": ["modules.language.num_experts=4", "modules.language.top_k=2",
                               "modules.language.num_shared_experts=1",
                               "modules.language.moe_shared_expert_gate=true",
                               "modules.language.num_layers=4",
                               "modules.language.moe_layer_freq=2"],
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_language_activations_match_saved_tensors(case: str, precision: str) -> None:
    cfg = load_config(DIGITS, [f"train.precision={precision}", *MOE_CASES[case]])
    measured, estimate = language_bytes_per_sample(cfg, precision)
    assert estimate <= measured <= estimate * 1.01, (measured, estimate)


def test_top_k_moves_the_estimate_with_the_routed_rows() -> None:
    def estimate(k: int) -> int:
        cfg = load_config(DIGITS, ["modules.language.num_experts=4",
                                   f"modules.language.top_k={k}"])
        return activation_bytes(cfg, "language", VOCAB, in_flight=1)

    assert estimate(1) < estimate(2) < estimate(3)
    assert estimate(3) - estimate(2) == estimate(2) - estimate(1)  # linear in top_k


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_packed_rows_keep_no_mask(precision: str) -> None:
    """Packed rows (two documents a row) keep no mask and nothing of ``S x S``: per layer
    and sample, beyond the unpacked layer, only the CPU kernel's concatenated output
    (one ``c x hidden`` row per token: each document's SDPA keeps its own output and
    ``wo`` reads their concatenation; the GPU's one variable-length call keeps one)."""
    def measured(layers: int, packed: bool) -> int:
        cfg = load_config(DIGITS, [f"train.precision={precision}",
                                   f"modules.language.num_layers={layers}"])
        torch.manual_seed(0)
        lm = build_module(cfg, "language", VOCAB)
        ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
               else torch.autocast("cpu", enabled=False))

        def run(n: int) -> torch.Tensor:
            docs = (torch.arange(SEQ) >= SEQ // 2).long().expand(n, SEQ)  # two documents
            args = {"documents": Documents.from_doc_ids(docs)} if packed else {}
            with ctx:
                return lm(torch.randn(n, SEQ, 128, requires_grad=True), **args)

        return saved_bytes(lambda: run(3)) - saved_bytes(lambda: run(2))

    c = 4 if precision == "fp32" else 2
    extra = {n: measured(n, True) - measured(n, False) for n in (2, 4)}
    assert extra[4] - extra[2] == 2 * c * 128 * SEQ, extra  # per layer: the output copy
    # Once per forward: the per-document RoPE rows (cos and sin, fp32, head_dim / 2 each).
    head_dim = 128 // load_config(DIGITS).modules["language"].num_heads
    assert extra[2] == 2 * c * 128 * SEQ + 2 * 4 * SEQ * head_dim // 2, extra
    cfg = load_config(DIGITS, [f"train.precision={precision}", "data.packing=true"])
    unpacked = load_config(DIGITS, [f"train.precision={precision}"])
    assert activation_bytes(cfg, "language", VOCAB, in_flight=1) == activation_bytes(
        unpacked, "language", VOCAB, in_flight=1)
