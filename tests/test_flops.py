"""The analytic FLOP count against hand formulas and against torch's own FLOP counter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mimotron.config import ModuleConfig, load_config
from mimotron.config.limits import module_parameters
from mimotron.config.schema import default_ffn_hidden_size
from mimotron.estimate.flops import (
    encoder_flops,
    language_model_flops,
    mlp_matrices,
    model_flops_per_iteration,
    transformer_layer_flops,
)
from mimotron.models.build import build_module
from mimotron.models.hf.layers import PreLNEncoderLayer
from mimotron.models.language import LanguageModel

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"


def _counted(fn, *args) -> int:
    """FLOPs torch counts for ``fn(*args)`` (math attention, so the bmm's are visible)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


def test_language_model_matches_hand_formula():
    # h=64, 2 layers, SwiGLU width 176 (8/3·64 rounded up to 8), vocab 40, 3 × 10 tokens.
    mod = ModuleConfig(kind="language", hidden_size=64, num_layers=2, num_heads=4)
    b, s, h, f, v = 3, 10, 64, 176, 40
    n = b * s
    per_layer = 4 * 2 * n * h * h + 2 * 2 * b * s * s * h + 3 * 2 * n * h * f
    expected = 2 * per_layer + 2 * n * h * v
    assert expected == 6_328_320
    assert language_model_flops(mod, v, b, s) == expected
    assert transformer_layer_flops(b, s, h) == per_layer


def test_language_model_matches_torch_flop_counter_forward_and_backward():
    lm = LanguageModel(40, hidden_size=64, num_layers=2, num_heads=4, max_seq_len=16)
    mod = ModuleConfig(kind="language", hidden_size=64, num_layers=2, num_heads=4)
    x = torch.randn(3, 10, 64, requires_grad=True)
    forward = _counted(lm, x)
    assert forward == language_model_flops(mod, 40, 3, 10)
    # Every matmul of the LM computes an input and a weight gradient: exactly ×3.
    assert _counted(lambda t: lm(t).sum().backward(), x) == 3 * forward


def test_hugging_face_encoder_layer_has_a_two_matrix_mlp():
    # CLIP / SigLIP / Whisper layers: fc1 and fc2, no gate. h=32, f=64, 3 x 5 tokens:
    # 4 projections 4·2·15·32·32 = 122 880, scores and context 2·2·3·5·5·32 = 9 600,
    # fc1 + fc2 2·2·15·32·64 = 122 880 (SwiGLU's three would be 184 320).
    layer = PreLNEncoderLayer(32, 4, 64, "gelu", 1e-5)
    expected = 122_880 + 9_600 + 122_880
    assert transformer_layer_flops(3, 5, 32, 64, num_mlp_matrices=2) == expected
    assert _counted(layer, torch.randn(3, 5, 32)) == expected
    cfg = load_config(DIGITS, [])
    assert mlp_matrices(cfg.modules["vision"]) == 3  # the built-in encoder: SwiGLU
    vit = cfg.modules["vision"]
    h, f = vit.hidden_size, vit.ffn_hidden_size or default_ffn_hidden_size(vit.hidden_size)
    # The size bound counts alike: attention 4·h² and the MLP's matrices, per layer.
    assert module_parameters(vit) == (vit.num_layers * (4 * h * h + 3 * h * f), 0)
    vit.hf_path = "/not/read"
    assert mlp_matrices(vit) == 2
    assert module_parameters(vit) == (vit.num_layers * (4 * h * h + 2 * h * f), 0)


@pytest.mark.parametrize("name,shape", [("vision", (5, 1, 8, 8)), ("audio", (5, 129, 16))])
def test_encoders_match_torch_flop_counter(name, shape):
    cfg = load_config(DIGITS, ["modules.vision.projector_hidden_size=48"])
    module = build_module(cfg, name, vocab_size=40, init=False)
    counted = _counted(module, torch.randn(*shape))
    lm_hidden = cfg.modules["language"].hidden_size
    assert encoder_flops(cfg.modules[name], lm_hidden, 5) == counted


def test_iteration_flops_scale_with_present_samples_and_freezing():
    cfg = load_config(DIGITS, ["train.global_batch_size=8", "train.micro_batch_size=8"])
    lm = cfg.modules["language"]
    flops = model_flops_per_iteration(cfg, 40, {"vision": 3, "audio": 0})
    assert flops["language"] == 3 * language_model_flops(lm, 40, 8, cfg.data.seq_length)
    assert flops["vision"] == 3 * encoder_flops(cfg.modules["vision"], lm.hidden_size, 3)
    assert flops["audio"] == 0
    frozen = load_config(DIGITS, ["modules.vision.freeze=true", "modules.language.freeze=true"])
    ff = model_flops_per_iteration(frozen, 40, {"vision": 3, "audio": 2})
    assert ff["vision"] == encoder_flops(frozen.modules["vision"], lm.hidden_size, 3)
    # Audio still trains, so the frozen LM back-propagates to its input: ×2.
    assert ff["language"] == 2 * language_model_flops(lm, 40, 64, frozen.data.seq_length)
