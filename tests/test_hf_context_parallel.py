"""Context and sequence parallelism for a Hugging Face decoder (``modules.language.hf_path``).

A tiny randomly initialised Qwen3 checkpoint is saved into a temporary folder: grouped-
query attention (4 query heads, 2 key/value heads), an explicit ``head_dim`` (32, so the
query width 128 is not the hidden size 64), q/k/v and output biases
(``attention_bias``), per-head q/k RMSNorm before RoPE, llama3-scaled RoPE (its tables
are indexed at the global positions of each CP rank) and tied embeddings (one matrix
whose gradient comes from the embedding on every CP rank and from the vocabulary-parallel
head). The engine trains it for 10 iterations with language CP 2, and with CP 2 x TP 2
plus sequence parallelism (q/k norms after the all-gather, the row-parallel ``wo`` bias
added once after the reduce-scatter), and must match the plain one-process reference
loop (tests/reference.py) in losses, global grad norm, per-module grad norms and final
weights at 1e-4 relative. Each run also checks that attention held ``S / 2`` positions
and gathered the 2 local key/value heads (the kernel reads them grouped). Packed rows
(``data.packing``) train likewise under CP 2 x TP 2 + SP and under CP 4, against the
plain loop fed by an independent packer.

An MoE checkpoint stays refused under CP and SP, with the field named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mimotron.models.blocks as blocks_module
import mimotron.models.language as language_module
from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, engine_run, noncolocated
from tests.parity import (
    assert_matches_reference,
    checked_modules,
    engine_results,
    packed_reference,
    reference,
)

NUM_ITERS = 10
SEQ = 64  # data.seq_length of configs/digits.toml
KV_HEADS, HEAD_DIM = 2, 32
SP = ["modules.language.parallel.sequence_parallel=true"]
# The HF vocabulary (40) is below the padded model vocabulary (64): the tied matrix has
# rows that are not in the checkpoint, and TP rank 1 holds some of both kinds.
HF_VOCAB = 40
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "language-cp2": noncolocated({}, {}, {"context": 2}),
    "language-cp2tp2-sp": noncolocated({}, {}, {"context": 2, "tensor": 2}) + SP,
}


def _save_qwen3(path: Path, **extra: object) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        attention_bias=True, max_position_embeddings=128, rope_scaling=dict(LLAMA3_ROPE),
        tie_word_embeddings=True, **extra)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_qwen3(tmp_path_factory.mktemp("hf") / "qwen3")


def _shared(path: Path) -> list[str]:
    """Overrides of the engine run and the reference (the folder sets the decoder's sizes)."""
    return [f"modules.language.hf_path='{path}'", f"train.iters={NUM_ITERS}"]


def hf_cp_engine_run(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """:func:`engine_run`, also recording the K/V shapes each attention layer gathered and
    the sequence length of each sequence-parallel layer stack."""
    gathered: list[tuple[int, int]] = []
    sharded: list[int] = []
    gather, scatter = blocks_module.gather_kv, language_module.scatter_sequence

    def recording_gather(k, v, group, dim):  # noqa: ANN001, ANN202
        gathered.append((k.shape[2], k.shape[dim]))  # (local kv heads, local positions)
        return gather(k, v, group, dim)

    def recording_scatter(x, group):  # noqa: ANN001, ANN202
        out = scatter(x, group)
        sharded.append(out.shape[1])
        return out

    blocks_module.gather_kv = recording_gather  # this forked rank only
    language_module.scatter_sequence = recording_scatter
    result = engine_run(rank, world, overrides, num_iters)
    return {**result, "gathered": gathered, "sharded": sharded}


@pytest.mark.parametrize("name", list(CASES))
def test_hf_decoder_with_context_parallel_matches_plain_loop(qwen3_dir: Path, name: str
                                                             ) -> None:
    overrides = _shared(qwen3_dir) + CASES[name]
    cfg = load_config(DIGITS, BASE + overrides)
    lm = cfg.modules["language"]
    assert (lm.num_heads, lm.num_layers) == (4, 2)
    results = engine_results(overrides, NUM_ITERS, hf_cp_engine_run)
    ref = reference(_shared(qwen3_dir), NUM_ITERS, schedule=())
    assert ref.losses[-1] < ref.losses[0]  # a real learning rate: the model moved
    assert_matches_reference(results, ref, checked_modules(overrides))
    # Tied: one matrix, no separate head; the qk norms and biases are the checkpoint's.
    assert "language_model.output.weight" not in ref.weights
    assert {"language_model.layers.0.attn.q_norm.weight",
            "language_model.layers.0.attn.wo.bias"} <= set(ref.weights)
    tp = lm.parallel.tensor
    shapes = {s for res in results for s in res["gathered"]}
    assert shapes == {(KV_HEADS // tp, SEQ // 2)}, shapes
    # Under SP the layer stacks ran on (S / cp) / tp positions; without SP not at all.
    sharded = {n for res in results for n in res["sharded"]}
    assert sharded == ({SEQ // 2 // tp} if lm.parallel.sequence_parallel else set()), sharded


@pytest.mark.parametrize("extra", [["modules.language.parallel.context=2"],
                                   ["modules.language.parallel.tensor=2", *SP]],
                         ids=["context", "sequence_parallel"])
def test_moe_checkpoint_stays_refused(tmp_path: Path, extra: list[str]) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
    )).save_pretrained(tmp_path)
    overrides = [f"modules.language.hf_path='{tmp_path}'",
                 *noncolocated({}, {}, {}), *extra]
    cfg = load_config(DIGITS, BASE + overrides)
    field = extra[-1].split("=")[0]
    with pytest.raises(ValueError, match=rf"{field}=\S+ is invalid with modules\.language\."
                                         r"hf_path \(a qwen3_moe checkpoint with 4 experts\)"):
        check_layout(cfg)


PACKED = {
    # Packed rows under CP 2 x TP 2 with sequence parallelism, and under CP 4 (chunks of
    # 8 positions: documents span chunks and ranks).
    "packed-cp2tp2-sp": noncolocated({}, {}, {"context": 2, "tensor": 2}) + SP,
    "packed-cp4": noncolocated({}, {}, {"context": 4}),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_hf_decoder_packed_matches_plain_loop(qwen3_dir: Path, name: str) -> None:
    """Packed rows of the Qwen3 decoder (GQA, q/k norms, llama3 RoPE restarting per
    document) against the plain loop, whose attention and document mask are its own."""
    overrides = _shared(qwen3_dir) + ["data.packing=true"] + PACKED[name]
    results = engine_results(overrides, NUM_ITERS)
    ref = packed_reference(_shared(qwen3_dir) + ["data.packing=true"], NUM_ITERS)
    assert ref.losses[-1] < ref.losses[0]
    assert_matches_reference(results, ref, checked_modules(overrides))
