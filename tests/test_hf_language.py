"""Hugging Face Llama / Qwen2 / Qwen3 decoders as mimotron language models.

Each case builds a small randomly initialised ``transformers`` model, saves it with
``save_pretrained``, loads the folder into our ``LanguageModel`` and compares logits on
the same token ids (fp32, eval mode). Weights are perturbed after ``transformers``' init
so that biases and norm scales are not their constant init values (a swapped or dropped
bias would otherwise go unnoticed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mimotron.config.hf_folder import tensor_files
from mimotron.forked_ranks import run_ranks
from mimotron.models.hf.llama import (
    LLAMA_WEIGHTS,
    LlamaFamilySpec,
    build_hf_language_model,
    load_llama_weights,
)
from mimotron.models.language import LanguageModel
from tests.hf_decoders import (
    SMALL,
    TOKENS,
    assert_close_relative,
    hf_logits,
    hf_model,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
CASES = {
    "llama": ("llama", {}),
    "llama_gqa_biases": ("llama", {"num_key_value_heads": 2, "attention_bias": True,
                                   "mlp_bias": True, "rms_norm_eps": 1e-5}),
    "llama3_rope": ("llama", {"num_key_value_heads": 2, "rope_theta": 500000.0,
                              "rope_scaling": LLAMA3_ROPE}),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2_bias_gqa": ("qwen2", {"num_key_value_heads": 2, "rope_theta": 1e6}),
    "qwen3_qk_norm_head_dim": ("qwen3", {"num_key_value_heads": 2, "head_dim": 12}),
    "tied": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
}


def _ours(module: LanguageModel, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return module(module.embed_tokens(tokens))


# ---- one process ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    model_type, overrides = CASES[case]
    hf = hf_model(tmp_path, model_type, **overrides)
    ours = build_hf_language_model(tmp_path).eval()
    assert_close_relative(_ours(ours), hf_logits(hf))


def test_spec_reads_each_family(tmp_path: Path) -> None:
    hf_model(tmp_path / "q3", "qwen3", num_key_value_heads=2, head_dim=12)
    spec = LlamaFamilySpec.from_hf_config(json.loads((tmp_path / "q3/config.json").read_text()))
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 12)
    assert spec.qk_norm and not spec.qkv_bias and not spec.tie_word_embeddings
    hf_model(tmp_path / "q2", "qwen2", tie_word_embeddings=True)
    spec = LlamaFamilySpec.from_hf_config(json.loads((tmp_path / "q2/config.json").read_text()))
    assert spec.qkv_bias and not spec.out_bias and not spec.qk_norm and spec.tie_word_embeddings
    # The pre-transformers-5 format: top-level rope_theta, rope_scaling with "type".
    legacy = {**SMALL, "model_type": "llama", "rope_theta": 5e5,
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    spec = LlamaFamilySpec.from_hf_config(legacy)
    assert spec.rope_theta == 5e5 and spec.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert spec.num_kv_heads == 4 and spec.head_dim == 8


def test_weight_names_map_both_ways(tmp_path: Path) -> None:
    hf = hf_model(tmp_path, "qwen3", num_key_value_heads=2, attention_bias=True)
    ours = build_hf_language_model(tmp_path)
    hf_names = set(hf.state_dict())
    our_names = dict(ours.named_parameters())
    names = LLAMA_WEIGHTS
    assert {names.to_hf(n) for n in our_names} == hf_names
    assert {names.from_hf(n) for n in hf_names} == set(our_names)
    assert names.to_hf("layers.1.attn.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert names.from_hf("model.layers.1.mlp.gate_proj.bias") == "layers.1.mlp.w1.bias"
    with pytest.raises(ValueError, match="no Hugging Face name"):
        names.to_hf("layers.1.attn.wx.weight")
    assert names.from_hf("model.lm_head.weight") is None


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    hf = hf_model(tmp_path / "one", "llama", num_key_value_heads=2)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded/model.safetensors.index.json").is_file()
    assert len(set(tensor_files(tmp_path / "sharded").values())) > 1
    ours = build_hf_language_model(tmp_path / "sharded").eval()
    assert_close_relative(_ours(ours), hf_logits(hf))


def test_pipeline_stages_loaded_separately_match(tmp_path: Path) -> None:
    hf = hf_model(tmp_path, "qwen2", num_key_value_heads=2, num_hidden_layers=3)
    first = build_hf_language_model(tmp_path, layer_ids=[0], post_process=False).eval()
    last = build_hf_language_model(tmp_path, layer_ids=[1, 2], pre_process=False).eval()
    assert sorted(first.layers) == ["0"] and first.output is None
    assert sorted(last.layers) == ["1", "2"] and last.embed is None
    with torch.no_grad():
        logits = last(first(first.embed_tokens(TOKENS)))
    assert_close_relative(logits, hf_logits(hf))


def test_tied_embeddings_need_one_stage(tmp_path: Path) -> None:
    hf_model(tmp_path, "llama", tie_word_embeddings=True)
    whole = build_hf_language_model(tmp_path)
    assert whole.output.weight is whole.embed.weight
    with pytest.raises(ValueError, match="tie_word_embeddings.*pipeline=1"):
        build_hf_language_model(tmp_path, layer_ids=[0], post_process=False)


# ---- tensor parallel --------------------------------------------------------------------

_SHARDED = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")


def _tp_rank(rank: int, world_size: int, path: str, reference: torch.Tensor,
             reference_grads: dict[str, torch.Tensor]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = build_hf_language_model(path, tp_mesh=mesh).eval()
    logits = model(model.embed_tokens(TOKENS))  # this rank's vocabulary shard
    shard = logits.shape[-1]
    expected = reference[..., rank * shard:(rank + 1) * shard]
    # The shards' losses sum to the full loss; TP's backward collectives do the rest.
    _loss(logits, world_size).backward()
    grad_errors = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        ref = reference_grads[LLAMA_WEIGHTS.to_hf(name)]
        grad_errors[name] = ((grad - ref).abs().max() / ref.abs().max()).item()
    matrices = [model.embed.weight] + [
        layer.get_submodule(n).weight for layer in model.layers.values() for n in _SHARDED
    ]
    if not model.tie_word_embeddings:
        matrices.append(model.output.weight)
    assert all(isinstance(m, DTensor) for m in matrices)
    local = {id(t.to_local().untyped_storage()): t.to_local().untyped_storage().nbytes()
             for t in matrices}
    full = sum(m.numel() * m.element_size() for m in matrices)
    return {"error": (logits - expected).abs().max().item(), "scale": expected.abs().max().item(),
            "grad_errors": grad_errors, "local_bytes": sum(local.values()), "full_bytes": full,
            "tied": model.output.weight is model.embed.weight}


def _loss(logits: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """Mean square of the full logits, from one of ``parts`` vocabulary shards."""
    return (logits.float() ** 2).sum() / (logits.numel() * parts)


@pytest.mark.parametrize("case", ["llama_gqa_biases", "tied"])
def test_tensor_parallel_loads_only_its_slice_and_matches(tmp_path: Path, case: str) -> None:
    model_type, overrides = CASES[case]
    hf = hf_model(tmp_path, model_type, **overrides)
    logits = hf(TOKENS).logits
    _loss(logits).backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    results = run_ranks(2, _tp_rank, str(tmp_path), logits.detach(), grads, timeout_s=120)
    for res in results:
        assert res["error"] <= 1e-5 * res["scale"]
        assert max(res["grad_errors"].values()) <= 1e-5, res["grad_errors"]
        assert 2 * res["local_bytes"] == res["full_bytes"]
        assert res["tied"] == (case == "tied")


def _tp_bad_heads_rank(rank: int, world_size: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        build_hf_language_model(path, tp_mesh=init_device_mesh("cpu", (world_size,)))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_tensor_parallel_must_divide_kv_heads(tmp_path: Path) -> None:
    hf_model(tmp_path, "llama", num_key_value_heads=1)
    messages = run_ranks(2, _tp_bad_heads_rank, str(tmp_path), timeout_s=120)
    assert all("tensor=2 does not divide num_kv_heads=1" in m for m in messages)


# ---- bad inputs -------------------------------------------------------------------------


def _rewrite_weights(path: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Drop (None) or replace/add tensors in a single-file checkpoint."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name, value in change.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors_named_together(tmp_path: Path) -> None:
    hf_model(tmp_path, "llama", num_key_value_heads=2)
    _rewrite_weights(tmp_path, {
        "model.layers.1.mlp.up_proj.weight": None,
        "model.layers.0.self_attn.extra.weight": torch.zeros(3),
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32),
    })
    with pytest.raises(ValueError) as info:
        build_hf_language_model(tmp_path)
    message = str(info.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected tensors: model.layers.0.self_attn.extra.weight" in message
    assert "model.layers.0.self_attn.k_proj.weight [32, 32] (expected [16, 32])" in message
    assert "\n" not in message


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape"])
def test_each_bad_tensor_is_an_error(tmp_path: Path, kind: str) -> None:
    hf_model(tmp_path, "qwen2")
    name = "model.layers.0.self_attn.q_proj.bias"
    change = {"missing": {name: None}, "unexpected": {"model.extra": torch.zeros(1)},
              "shape": {name: torch.zeros(7)}}[kind]
    _rewrite_weights(tmp_path, change)
    model = LanguageModel(**LlamaFamilySpec.from_hf_config(
        json.loads((tmp_path / "config.json").read_text())).model_kwargs())
    words = {"missing": "missing tensors: " + name, "unexpected": "unexpected tensors: model.extra",
             "shape": name + " [7] (expected [32])"}
    with pytest.raises(ValueError, match=re.escape(words[kind])):
        load_llama_weights(model, tmp_path)


def test_missing_folder_is_an_error_not_a_download(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an existing directory.*never downloads"):
        build_hf_language_model(tmp_path / "Qwen" / "Qwen2-0.5B")
    with pytest.raises(ValueError, match="no config.json"):
        build_hf_language_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "model_type": "llama"}))
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        build_hf_language_model(tmp_path)


def test_index_naming_absent_shard_is_an_error(tmp_path: Path) -> None:
    hf = hf_model(tmp_path / "one", "llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ValueError, match="shard files that are not in the folder"):
        build_hf_language_model(tmp_path / "sharded")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model_type='gpt2' is not a supported decoder"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}},
         "rope_parameters.rope_type='yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, r"lacks \['factor'\]"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"num_attention_heads": None}, "lacks .'num_attention_heads'."),
    ],
)
def test_unsupported_config_is_an_error_naming_the_key(
    tmp_path: Path, change: dict, words: str
) -> None:
    hf_model(tmp_path, "qwen2")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=words):
        build_hf_language_model(tmp_path)


def test_model_not_built_from_the_config_is_an_error(tmp_path: Path) -> None:
    hf_model(tmp_path, "llama", num_key_value_heads=2)
    spec = LlamaFamilySpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    model = LanguageModel(**{**spec.model_kwargs(), "num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"does not match the model: wrong shapes: "
                       r"model\.layers\.0\.self_attn\.k_proj\.weight \[16, 32\] "
                       r"\(expected \[32, 32\]\)"):
        load_llama_weights(model, tmp_path)
