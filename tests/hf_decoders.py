"""Small random Hugging Face decoders (Llama, Qwen2, Qwen3) and the logit comparison of
the language-model tests against ``transformers``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 128
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
TOKENS = torch.arange(2 * 20).view(2, 20) * 37 % VOCAB


def hf_classes(model_type: str) -> tuple[type, type]:
    """The ``transformers`` config and causal-LM classes of ``llama``, ``qwen2`` or ``qwen3``."""
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[model_type]
    return getattr(transformers, f"{names}Config"), getattr(transformers, f"{names}ForCausalLM")


def hf_model(path: Path, model_type: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random HF model saved to ``path`` (returned in eval mode)."""
    config_cls, model_cls = hf_classes(model_type)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    return model


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """``model``'s logits of ``tokens``, without gradients."""
    with torch.no_grad():
        return model(tokens).logits


def assert_close_relative(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Same shape, and the largest difference within ``rel`` of ``ref``'s largest value."""
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs error {err} vs scale {ref.abs().max()}"
