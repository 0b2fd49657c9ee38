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


# ---- what the model runs: grouped-query attention, packed documents, MoE, recompute ----


def test_a_grouped_query_decoder_counts_what_transformers_runs(tmp_path):
    """transformers' own Qwen3 decoder (4 query heads of 16 over 2 key/value heads:
    query width 64 beside h 32, key/value width 32) against the count read from its
    folder (equal on torch 2.13 / transformers 5; within 2% is the contract); the count
    without grouped-query widths is 22% low."""
    from mimotron.estimate.widths import module_attention_widths
    from tests.hf_decoders import TOKENS, VOCAB, hf_model

    model = hf_model(tmp_path, "qwen3", num_key_value_heads=2, head_dim=16)
    mod = ModuleConfig(kind="language", hidden_size=32, num_layers=2, num_heads=4,
                       ffn_hidden_size=48, hf_path=str(tmp_path))
    assert module_attention_widths(mod) == (64, 32)
    b, s = TOKENS.shape
    counted = _counted(model, TOKENS)
    assert language_model_flops(mod, VOCAB, b, s) == pytest.approx(counted, rel=0.02)
    plain = ModuleConfig(kind="language", hidden_size=32, num_layers=2, num_heads=4,
                         ffn_hidden_size=48)
    assert abs(language_model_flops(plain, VOCAB, b, s) / counted - 1) > 0.05


def test_packed_documents_count_their_segments():
    """Packed rows attend within each document (one SDPA per segment on the CPU): the
    count reads the documents' squares, padding runs included, not the rows' S²."""
    from mimotron.models.attention.documents import Documents

    lm = LanguageModel(40, hidden_size=64, num_layers=2, num_heads=4, max_seq_len=16)
    mod = ModuleConfig(kind="language", hidden_size=64, num_layers=2, num_heads=4)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1],
                            [0, 0, 0, 0, 0, 0, 1, 1, -1, -1]])
    docs = Documents.from_doc_ids(doc_ids)
    assert docs.attention_pairs == (9 + 16 + 4 + 1) + (36 + 4 + 4)
    x = torch.randn(2, 10, 64, requires_grad=True)
    forward = _counted(lambda t: lm(t, documents=docs), x)
    assert forward == language_model_flops(mod, 40, 2, 10, attention_pairs=74)
    assert forward < language_model_flops(mod, 40, 2, 10)  # 200 pairs unpacked
    assert _counted(lambda t: lm(t, documents=docs).sum().backward(), x) == 3 * forward


def test_an_moe_decoder_counts_the_experts_its_tokens_visit():
    """Router, the top-k experts each token visits (dropless) and a shared expert:
    the count against torch's, forward and backward."""
    from mimotron.config.moe_config import moe_options

    cfg = load_config(DIGITS, ["modules.language.num_experts=4", "modules.language.top_k=2",
                               "modules.language.num_shared_experts=1"])
    mod = cfg.modules["language"]
    lm = LanguageModel(40, hidden_size=mod.hidden_size, num_layers=mod.num_layers,
                       num_heads=mod.num_heads, max_seq_len=16, moe=moe_options(mod))
    x = torch.randn(3, 10, mod.hidden_size, requires_grad=True)
    forward = _counted(lm, x)
    assert language_model_flops(mod, 40, 3, 10) == pytest.approx(forward, rel=0.02)
    assert _counted(lambda t: lm(t).sum().backward(), x) == pytest.approx(3 * forward,
                                                                          rel=0.02)


@pytest.mark.parametrize("layers", [0, 1])
def test_full_recompute_adds_its_layers_forward_to_the_hardware_count(layers):
    """Full recompute runs each recomputed layer's forward again in backward: torch's
    count of a step is the model count plus :func:`recompute_flops_per_iteration`'s
    (hardware FLOPs); selective recompute runs no matmul again."""
    from mimotron.estimate.hardware_flops import recompute_flops_per_iteration
    from mimotron.models.recompute import apply_recompute

    overrides = ["modules.language.recompute=full",
                 f"modules.language.recompute_num_layers={layers}",
                 "train.global_batch_size=3", "train.micro_batch_size=3",
                 "modules.vision.freeze=true", "modules.audio.freeze=true"]
    cfg = load_config(DIGITS, overrides)
    mod, s = cfg.modules["language"], cfg.data.seq_length
    lm = build_module(cfg, "language", 40, init=False)
    apply_recompute(lm, "full", layers)
    x = torch.randn(3, s, mod.hidden_size, requires_grad=True)
    counted = _counted(lambda t: lm(t).sum().backward(), x)
    model = 3 * language_model_flops(mod, 40, 3, s)
    extra = recompute_flops_per_iteration(cfg, 40, {})
    assert extra["vision"] == extra["audio"] == 0
    assert extra["language"] > 0
    assert counted == pytest.approx(model + extra["language"], rel=1e-9)
    selective = load_config(DIGITS, [*overrides[2:], "modules.language.recompute=selective"])
    assert recompute_flops_per_iteration(selective, 40, {})["language"] == 0


def test_llama2_70b_training_count_is_megatrons_and_palms_formula():
    """Llama-2-70B (80 layers, h 8192, 64 heads over 8 key/value groups, SwiGLU 28672,
    vocabulary 32000) at 4096 tokens: the training count (x3) equals Megatron-LM's
    ``num_floating_point_operations`` (Narayanan et al. 2021, appendix, with its
    grouped-query and SwiGLU terms) and PaLM's ``6N + 12·L·H·Q·T`` per token (Chowdhery
    et al. 2022, appendix B; N the matmul parameters)."""
    folder = Path(__file__).resolve().parent / "data" / "hf_configs" / "llama2_70b"
    mod = ModuleConfig(kind="language", hidden_size=8192, num_layers=80, num_heads=64,
                       ffn_hidden_size=28672, hf_path=str(folder))
    b, s, layers, h, f, v, heads, groups = 2, 4096, 80, 8192, 28672, 32000, 64, 8
    ours = 3 * language_model_flops(mod, v, b, s)
    megatron = (12 * b * s * layers * h * h * ((1 + groups / heads + s / h) + f / h * 3 / 2)
                + 6 * b * s * h * v)
    assert ours == pytest.approx(megatron, rel=1e-12)
    head_dim = h // heads
    params = layers * (2 * h * h + 2 * h * groups * head_dim + 3 * h * f) + h * v
    palm = b * s * (6 * params + 12 * layers * heads * head_dim * s)
    assert ours == pytest.approx(palm, rel=1e-12)
