"""Qwen2-MoE and Qwen3-MoE folders load into mimotron's MoE blocks and match transformers.

A tiny random model of each family is saved with ``save_pretrained`` (per-expert
tensors, as published checkpoints store them); mimotron stacks them into
``experts.w1/w3/w2`` and its logits must equal ``transformers``' within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mimotron.models.hf.llama import LLAMA_WEIGHTS, build_hf_language_model  # noqa: E402
from mimotron.models.hf.weights import to_hf_tensors  # noqa: E402
from mimotron.models.moe import MoEFeedForward  # noqa: E402

COMMON = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "max_position_embeddings": 64}
FAMILIES = {
    # Qwen2-MoE: gated shared expert, raw top-k weights, layer 1 dense (mlp_only_layers).
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  {"shared_expert_intermediate_size": 24, "norm_topk_prob": False,
                   "mlp_only_layers": [1]}),
    # Qwen3-MoE: q/k norms, renormalised top-k, every second layer sparse.
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {"head_dim": 8, "norm_topk_prob": True, "decoder_sparse_step": 2}),
}


def _folder(tmp: Path, family: str) -> tuple[Path, torch.nn.Module]:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # random (not zero) norms and gates, so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp / family)
    return tmp / family, model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family: str, tmp_path: Path) -> None:
    path, reference = _folder(tmp_path, family)
    ours = build_hf_language_model(path, max_seq_len=16).eval()
    kinds = [type(layer.mlp).__name__ for layer in ours.layers.values()]
    want = {"qwen2_moe": ["MoEFeedForward", "SwiGLU", "MoEFeedForward"],
            "qwen3_moe": ["SwiGLU", "MoEFeedForward", "SwiGLU"]}[family]
    assert kinds == want
    moe = next(m for m in ours.modules() if isinstance(m, MoEFeedForward))
    assert (moe.shared_expert_gate is not None) == (family == "qwen2_moe")
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 12), generator=torch.Generator()
                           .manual_seed(1))
    with torch.no_grad():
        got = ours(ours.embed_tokens(tokens))
        expected = reference(input_ids=tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # FLOPs and the plan's memory read the same MoE layout from config.json.
    from mimotron.config import ModuleConfig
    from mimotron.config.moe_config import moe_options

    opts = moe_options(ModuleConfig(kind="language", hf_path=str(path)))
    assert opts is not None and opts.num_experts == 4 and opts.top_k == 2
    assert opts.moe_layer_ids(3) == {"qwen2_moe": [0, 2], "qwen3_moe": [1]}[family]
    # The way back (export) gives the per-expert tensors of the folder.
    from safetensors.torch import load_file

    saved = load_file(str(path / "model.safetensors"))
    exported = to_hf_tensors(ours, LLAMA_WEIGHTS)
    assert set(exported) == set(saved)
    for name, value in exported.items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=name)
