"""The attention backend: segments, kernels, no ``S x S`` tensor, and the plan's terms.

* The plan's segments against a dense mask written here (causal, same document,
  padding a document of its own), for packed rows with and without context
  parallelism and grouped-query heads: outputs and gradients.
* One packed forward and backward of a language model at ``S = 4096`` allocates no
  tensor of ``S x S / 16`` elements or more (every operator's outputs are watched); the
  same watcher flags a dense-mask attention, so the check can fail.
* On the fake accelerator (``meta`` stand-in, bf16) packed and context-parallel rows
  run the variable-length kernel, and what it keeps per layer at the Llama-2-7B shape
  at 32k and 128k tokens is the plan's attention term within 0.85-1.15.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mimotron.config import load_config
from mimotron.dryrun.saved_bytes import saved_bytes
from mimotron.models.attention import Documents, attend, attention_kernel, plan_attention
from mimotron.models.build import build_module
from mimotron.parallel.activation_terms import attention_bytes_per_sample, context_keys_read
from mimotron.parallel.context_parallel import gathered_positions, load_balanced_positions

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ROOT / "configs" / "digits.toml"
LLAVA_7B = ROOT / "configs" / "llava15_7b_8gpu.toml"


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor
           ) -> torch.Tensor:
    """Causal attention within documents over whole rows, the mask written out."""
    seq = q.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _doc_ids(seq: int) -> torch.Tensor:
    lengths = [[5, 9, 3, 11, 4], [16, 10, 6]]  # row 0 ends in 0 padding, row 1 in 0
    rows = []
    for row in lengths:
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(row)])
        rows.append(torch.cat([ids, torch.full((seq - ids.numel(),), -1)]))
    return torch.stack(rows)


@pytest.mark.parametrize("context", [1, 2, 4])
def test_segments_equal_a_dense_document_mask(context: int) -> None:
    """Every CP rank's queries (all of them at CP 1) against the dense reference, with
    4 query heads over 2 key/value heads; gradients of q, k, v too."""
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 32, 4, 2, 8
    doc_ids = _doc_ids(seq)
    q = torch.randn(2, seq, heads, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, seq, kv_heads, dim, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    docs = Documents.from_doc_ids(doc_ids)
    assert docs.bounds[0] == (0, 5, 14, 17, 28, 32) and docs.bounds[1] == (0, 16, 26, 32)
    for rank in range(context):
        pos = load_balanced_positions(seq, context, rank) if context > 1 else torch.arange(seq)
        # Keys as a context-parallel rank holds them: gathered, in rank order.
        order = gathered_positions(seq, context) if context > 1 else torch.arange(seq)
        plan = plan_attention(docs, q.device, context, rank)
        want = _dense(q, k, v, doc_ids)
        got = attend(q[:, pos], k[:, order], v[:, order], plan)
        torch.testing.assert_close(got, want[:, pos])
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        expect = torch.autograd.grad(want[:, pos].square().sum(), (q, k, v))
        for g, e in zip(grads, expect, strict=True):
            torch.testing.assert_close(g, e)


def test_context_parallel_ranks_read_the_keys_the_plan_counts() -> None:
    """Unpacked rows: each rank's segments read S + S / 2c keys (the estimate's count)
    and each chunk's last query sees every earlier key."""
    seq = 64
    for context in (2, 4):
        for rank in range(context):
            plan = plan_attention(Documents.whole(1, seq), torch.device("cpu"), context, rank)
            assert plan.k_bounds[-1] == context_keys_read(seq, context)
            assert plan.num_segments == 2 and plan.max_k == seq - rank * seq // (2 * context)


class _LargestOutputs(TorchDispatchMode):
    """The largest element count of any operator output (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, str] = (0, "")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{func}: {tuple(t.shape)}")
        return out


def test_a_packed_step_at_4096_tokens_allocates_nothing_of_s_by_s() -> None:
    seq = 4096
    cfg = load_config(DIGITS, [f"data.seq_length={seq}", "modules.language.hidden_size=64",
                               "modules.language.num_heads=2", "modules.language.num_layers=2"])
    torch.manual_seed(0)
    lm = build_module(cfg, "language", 64)
    lengths = [700, 1300, 1000, 1096]
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    x = torch.randn(1, seq, 64, requires_grad=True)
    watch = _LargestOutputs()
    with watch:
        logits = lm(x, documents=Documents.from_doc_ids(doc_ids), position_ids=positions)
        logits.float().square().mean().backward()
    limit = seq * seq // 16
    assert watch.largest[0] < limit, watch.largest
    assert attention_kernel(x.device, x.dtype, planned=True) == "segments"
    # The watcher sees a dense mask when there is one.
    dense = _LargestOutputs()
    with dense:
        mask = doc_ids[:, :, None] == doc_ids[:, None, :]
        F.scaled_dot_product_attention(torch.randn(1, 1, seq, 8), torch.randn(1, 1, seq, 8),
                                       torch.randn(1, 1, seq, 8), attn_mask=mask[:, None])
    assert dense.largest[0] >= limit, dense.largest


@pytest.mark.parametrize("seq", [32768, 131072])
@pytest.mark.parametrize("layout", ["packed", "cp8", "cp8-packed"])
def test_plan_attention_term_matches_the_fake_accelerator(seq: int, layout: str) -> None:
    """At the Llama-2-7B shape (32 heads of 128, bf16) the variable-length kernel runs on
    fake tensors; what attention keeps for backward (distinct saved storages) is within
    0.85-1.15 of the plan's term, and at most it with packed documents under CP."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    context = 8 if layout.startswith("cp8") else 1
    cfg = load_config(LLAVA_7B, [f"data.seq_length={seq}", "train.precision=bf16",
                                 "modules.language.parallel.tensor=1",
                                 f"modules.language.parallel.context={context}"])
    lengths = [seq // 4, seq // 8, seq // 2, seq // 8] if "packed" in layout else [seq]
    docs = Documents.from_doc_ids(
        torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None])
    device = torch.device("meta")
    heads, dim, local = 32, 128, seq // context
    with FakeTensorMode():
        plan = plan_attention(docs, device, context, context - 1)
        q = torch.empty(1, local, heads, dim, dtype=torch.bfloat16, device=device,
                        requires_grad=True)
        k, v = (torch.empty(1, seq, heads, dim, dtype=torch.bfloat16, device=device,
                            requires_grad=True) for _ in range(2))
        # q (after RoPE) is kept as the kernel's input; k and v as gathered under CP.
        kept = saved_bytes(lambda: attend(q * 1, k * 1, v * 1, plan))
    assert attention_kernel(device, torch.bfloat16, planned=True) == "varlen"
    estimate = attention_bytes_per_sample(cfg, "language")
    if layout == "cp8-packed":
        # Documents shorter than the row read fewer keys than the plan's bound (a
        # document's own), which it cannot know ahead: at most the estimate.
        assert kept <= estimate, (estimate, kept)
    else:
        assert 0.85 <= estimate / kept <= 1.15, (estimate, kept)
