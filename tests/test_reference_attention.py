"""The reference's own attention core (``tests.reference_attention``) is right.

Nothing else uses it, so it is checked here on its own: against attention written out
with Python loops over scalars for a tiny packed batch, against ``transformers``'
``LlamaAttention`` (grouped-query heads, Llama 3.1's scaled RoPE) for unpacked rows and
for each document of a packed row run alone, and, installed in a digits model, for
packing invariance (a document's logits in a packed row are its logits alone).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.reference import reference_setup
from tests.reference_attention import (
    ReferenceAttention,
    document_positions,
    install_reference_attention,
    reference_inv_freq,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}


def _loop_attention(q: list, k: list, v: list, doc_ids: list[int], theta: float) -> list:
    """Attention of one row by scalar loops: ``q[i][h][d]``, ``k``/``v`` ``[j][g][d]``.

    Query head ``h`` reads key/value head ``h // (Hq / Hkv)``; token ``i`` sits at
    position ``#{j < i : doc j == doc i}`` and sees keys ``j <= i`` of its document.
    """
    seq, heads, dim = len(q), len(q[0]), len(q[0][0])
    group = heads // len(k[0])
    pos = [sum(doc_ids[j] == doc_ids[i] for j in range(i)) for i in range(seq)]

    def rope(x: list, p: int) -> list:
        half = dim // 2
        out = [0.0] * dim
        for m in range(half):
            angle = p * theta ** (-2 * m / dim)
            out[m] = x[m] * math.cos(angle) - x[m + half] * math.sin(angle)
            out[m + half] = x[m + half] * math.cos(angle) + x[m] * math.sin(angle)
        return out

    out = []
    for i in range(seq):
        row = []
        for h in range(heads):
            qi = rope(q[i][h], pos[i])
            keys = [j for j in range(i + 1) if doc_ids[j] == doc_ids[i]]
            scores = [sum(a * b for a, b in zip(qi, rope(k[j][h // group], pos[j]), strict=True))
                      / math.sqrt(dim) for j in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            row.append([sum(w * v[j][h // group][d] for w, j in zip(weights, keys, strict=True))
                        / total for d in range(dim)])
        out.append(row)
    return out


def test_two_documents_by_hand():
    """Rows [doc 0 x3, doc 1 x3, pad x2] and [doc 0 x2, doc 1 x5, pad]; 4 query heads over
    2 key/value heads; and the unpacked (all causal) result of the same inputs."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, -1, -1], [0, 0, 1, 1, 1, 1, 1, -1]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 2, 0, 1, 2, 0, 1],
                                                    [0, 1, 0, 1, 2, 3, 4, 0]]
    torch.manual_seed(0)
    q = torch.randn(2, 8, 4, 6, dtype=torch.float64)
    k, v = torch.randn(2, 2, 8, 2, 6, dtype=torch.float64).unbind(1)
    theta = 100.0  # angles of several radians at these positions
    state = ReferenceAttention(reference_inv_freq(6, theta).double())
    for ids in (doc_ids, None):
        state.doc_ids = ids
        got = state.core(q, k, v, "the engine's rope", "and plan are ignored")
        for b in range(2):
            row_ids = [0] * 8 if ids is None else ids[b].tolist()
            want = _loop_attention(q[b].tolist(), k[b].tolist(), v[b].tolist(), row_ids, theta)
            torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-6)
    # Moving document 0 of row 0 changes nothing of document 1 and the padding.
    state.doc_ids = doc_ids
    before = state.core(q, k, v)
    k2 = k.clone()
    k2[0, :3] += 1.0
    after = state.core(q, k2, v)
    assert torch.equal(before[0, 3:], after[0, 3:])
    assert not torch.allclose(before[0, 1:3], after[0, 1:3])


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE])
def test_inv_freq_matches_transformers(scaling: dict | None):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=5e5,
                         rope_scaling=None if scaling is None else dict(scaling))
    want = LlamaRotaryEmbedding(config).inv_freq
    torch.testing.assert_close(reference_inv_freq(32, 5e5, scaling), want, rtol=1e-6, atol=0)


def _llama_attention() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random ``transformers`` LlamaAttention (8 heads over 2, head_dim 8, llama3 RoPE)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                         rope_theta=1e4, rope_scaling=dict(LLAMA3_ROPE),
                         attention_bias=True, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    return LlamaAttention(config, layer_idx=0).eval(), LlamaRotaryEmbedding(config)


def _hf_forward(attn: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor
                ) -> torch.Tensor:
    """``transformers``' causal attention of ``x`` ``[B, S, hidden]``, positions 0..S-1."""
    seq = x.shape[1]
    positions = torch.arange(seq).expand(x.shape[0], seq)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    return attn(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0]


def _ours(attn: torch.nn.Module, state: ReferenceAttention, x: torch.Tensor) -> torch.Tensor:
    """The same projections around the reference core."""
    batch, seq, dim = x.shape[0], x.shape[1], attn.head_dim
    q = attn.q_proj(x).view(batch, seq, -1, dim)
    k, v = (p(x).view(batch, seq, -1, dim) for p in (attn.k_proj, attn.v_proj))
    return attn.o_proj(state.core(q, k, v).reshape(batch, seq, -1))


def test_matches_transformers_llama_attention():
    """Unpacked rows, and a packed row [5, 4, 3 tokens, 4 padding] document by document."""
    attn, rotary = _llama_attention()
    state = ReferenceAttention(reference_inv_freq(8, 1e4, LLAMA3_ROPE))
    torch.manual_seed(2)
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        torch.testing.assert_close(_ours(attn, state, x), _hf_forward(attn, rotary, x),
                                   rtol=1e-5, atol=1e-5)
        lengths = [5, 4, 3, 4]
        state.doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
        state.doc_ids[0, -lengths[-1]:] = -1
        packed = _ours(attn, state, x[:1])
        start = 0
        for n in lengths:
            alone = _hf_forward(attn, rotary, x[:1, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_installed_model_keeps_documents_apart():
    """In a digits model with the core installed in every decoder layer, each document's
    logits in a packed row equal its logits alone at the start of an unpacked row."""
    _, _, build = reference_setup(())
    torch.manual_seed(0)
    model = build().eval()
    lm = model.language_model
    state = install_reference_attention(model)
    torch.manual_seed(3)
    hidden = torch.randn(1, 24, lm.hidden_size)
    lengths = [7, 9, 8]
    state.doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = lm(hidden)  # no engine document arguments: the core reads state.doc_ids
        assert state.calls == len(lm.layers) >= 2
        state.doc_ids, start = None, 0
        for n in lengths:
            alone = lm(hidden[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n
        # Without doc_ids the same row is one causal sequence: later documents differ.
        whole = lm(hidden)
    torch.testing.assert_close(whole[:, :7], packed[:, :7], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(whole[:, 7:], packed[:, 7:], rtol=1e-3, atol=1e-3)
