"""The attention backend: segments, kernels, no ``S x S`` tensor, and the plan's terms.

* The plan's segments against a dense mask written here (causal, same document,
  padding a document of its own), for packed rows with and without context
  parallelism and grouped-query heads: outputs and gradients. Both branches run: the
  per-segment one and the GPU's ``varlen`` one with the CPU emulator of the kernel
  (:mod:`~mimotron.models.attention.varlen_emulation`) in its place, also through the
  attention layer under CP 2 and a packed CP 2 training run against the plain loop.
* On a GPU (``gpu`` marker, skipped without one) torch's kernel in bf16 against the
  dense mask and the emulator.
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

from mimotron.config import load_config
from mimotron.dryrun.saved_bytes import saved_bytes
from mimotron.estimate.activation_terms import attention_bytes_per_sample, context_keys_read
from mimotron.forked_ranks import run_ranks
from mimotron.models.attention import (
    Documents,
    attend,
    attention_kernel,
    attention_segments,
    kernels,
)
from mimotron.models.attention.varlen_emulation import varlen_attn_emulated
from mimotron.models.build import build_module
from mimotron.parallel.context_parallel import gathered_positions, load_balanced_positions
from mimotron.parallel.layout import check_layout
from tests.saved_bytes import LargestOutputs

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


@pytest.fixture
def emulated_varlen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Plans run the ``varlen`` branch of :func:`attend` with the CPU emulator as kernel.

    Returns a file that gains a line per kernel call (forked ranks append to it too).
    """
    calls = tmp_path / "varlen-calls"
    calls.touch()

    def counted(*args: Any, **kwargs: Any) -> Any:
        with calls.open("a") as f:
            f.write("call\n")
        return varlen_attn_emulated(*args, **kwargs)

    monkeypatch.setattr(kernels, "attention_kernel",
                        lambda device, dtype, planned: "varlen" if planned else "sdpa-causal")
    monkeypatch.setattr(kernels, "varlen_function", lambda: counted)
    return calls


def _calls(path: Path) -> int:
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("context", [1, 2, 4])
@pytest.mark.parametrize("kernel", ["segments", "varlen"])
def test_plans_equal_a_dense_document_mask(context: int, kernel: str,
                                           request: pytest.FixtureRequest) -> None:
    """Every CP rank's queries (all of them at CP 1) against the dense reference, with
    4 query heads over 2 key/value heads; gradients of q, k, v too. ``varlen`` runs the
    GPU branch with the CPU emulator in the kernel's place (CP chunks: fewer queries
    than keys, the causal window aligned at the lower right)."""
    calls = request.getfixturevalue("emulated_varlen") if kernel == "varlen" else None
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
        plan = attention_segments(docs, q.device, context, rank)
        want = _dense(q, k, v, doc_ids)
        got = attend(q[:, pos], k[:, order], v[:, order], plan)
        torch.testing.assert_close(got, want[:, pos])
        grads = torch.autograd.grad(got.square().sum(), (q, k, v))
        expect = torch.autograd.grad(want[:, pos].square().sum(), (q, k, v))
        for g, e in zip(grads, expect, strict=True):
            torch.testing.assert_close(g, e)
    if calls is not None:
        assert _calls(calls) == context  # one kernel call per rank's attention


def test_context_parallel_ranks_read_the_keys_the_plan_counts() -> None:
    """Unpacked rows: each rank's segments read S + S / 2c keys (the estimate's count)
    and each chunk's last query sees every earlier key."""
    seq = 64
    for context in (2, 4):
        for rank in range(context):
            plan = attention_segments(Documents.whole(1, seq), torch.device("cpu"), context, rank)
            assert plan.k_bounds[-1] == context_keys_read(seq, context)
            assert plan.num_segments == 2 and plan.max_k == seq - rank * seq // (2 * context)


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
    watch = LargestOutputs()
    with watch:
        logits = lm(x, documents=Documents.from_doc_ids(doc_ids), position_ids=positions)
        logits.float().square().mean().backward()
    limit = seq * seq // 16
    assert watch.largest[0] < limit, watch.largest
    assert attention_kernel(x.device, x.dtype, planned=True) == "segments"
    # The watcher sees a dense mask when there is one.
    dense = LargestOutputs()
    with dense:
        mask = doc_ids[:, :, None] == doc_ids[:, None, :]
        F.scaled_dot_product_attention(torch.randn(1, 1, seq, 8), torch.randn(1, 1, seq, 8),
                                       torch.randn(1, 1, seq, 8), attn_mask=mask[:, None])
    assert dense.largest[0] >= limit, dense.largest


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama-2-7B's config.json with linear RoPE scaling x 32 (a 131,072-token context:
    a longer ``seq_length`` than its 4,096 is refused without scaling)."""
    import json

    folder = tmp_path_factory.mktemp("llama2_7b_long")
    config = json.loads((ROOT / "tests/data/hf_configs/llama2_7b/config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 32.0}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("seq", [32768, 131072])
@pytest.mark.parametrize("layout", ["packed", "cp8", "cp8-packed"])
def test_plan_attention_term_matches_the_fake_accelerator(seq: int, layout: str,
                                                          long_llama: Path) -> None:
    """At the Llama-2-7B shape (32 heads of 128, bf16) the variable-length kernel runs on
    fake tensors; what attention keeps for backward (distinct saved storages) is within
    0.85-1.15 of the plan's term, and at most it with packed documents under CP."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    context = 8 if layout.startswith("cp8") else 1
    cfg = load_config(LLAVA_7B, [f"data.seq_length={seq}", "train.precision=bf16",
                                 f"modules.language.hf_path={long_llama}",
                                 "modules.language.parallel.tensor=1",
                                 f"modules.language.parallel.context={context}"])
    lengths = [seq // 4, seq // 8, seq // 2, seq // 8] if "packed" in layout else [seq]
    docs = Documents.from_doc_ids(
        torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None])
    device = torch.device("meta")
    heads, dim, local = 32, 128, seq // context
    with FakeTensorMode():
        plan = attention_segments(docs, device, context, context - 1)
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


def test_cp_attention_layer_on_the_varlen_branch(emulated_varlen: Path) -> None:
    """The attention layer (RoPE, 4 query over 2 key/value heads, the K/V gather and its
    backward) under CP 2 with packed documents, the emulator as kernel: each rank's
    outputs and input gradients equal whole-row attention with a dense mask."""
    from tests.context_parallel import attention_rows

    for res in run_ranks(2, attention_rows, True, timeout_s=120):
        assert res["out_err"] <= 1e-5 * res["scale"], res
        assert res["grad_err"] <= 1e-4, res
    assert _calls(emulated_varlen) == 2


def test_packed_cp_training_on_the_varlen_branch_matches_the_plain_loop(
        emulated_varlen: Path) -> None:
    """Packed rows under CP 2 trained with the GPU's attention branch (fp32, the emulator
    as kernel) match the plain loop step by step, as the per-segment branch does."""
    from tests.common import BASE, noncolocated
    from tests.context_parallel import check_cp_run, cp_engine_run
    from tests.parity import NUM_ITERS, packed_reference
    from tests.reference import PACKING

    overrides = ["data.packing=true", "train.iters=12", *noncolocated({}, {}, {"context": 2})]
    world = check_layout(load_config(DIGITS, BASE + overrides)).world_size
    results = run_ranks(world, cp_engine_run, overrides, NUM_ITERS, timeout_s=300)
    check_cp_run(results, packed_reference(PACKING, NUM_ITERS), overrides)
    assert _calls(emulated_varlen) > 0


def _gpu() -> torch.device | None:
    """The CUDA device when there is one and ``MIMOTRON_DEVICE`` allows it."""
    from mimotron.runtime import accelerator_available

    return torch.device("cuda", 0) if accelerator_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu() is None, reason="needs a CUDA device")
@pytest.mark.parametrize("context", [1, 2, 4])
def test_the_gpu_varlen_kernel_equals_the_dense_mask_and_the_emulator(context: int) -> None:
    """On a GPU in bf16 :func:`attend` runs torch's ``varlen_attn`` (packed rows, CP
    chunks, 4 query over 2 key/value heads): its outputs and gradients match the dense
    reference and the CPU emulator run on the same bf16 inputs in fp32."""
    device = _gpu()
    assert device is not None
    torch.manual_seed(0)
    seq, heads, kv_heads, dim = 32, 4, 2, 64
    doc_ids = _doc_ids(seq)
    docs = Documents.from_doc_ids(doc_ids)
    q = torch.randn(2, seq, heads, dim, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(2, seq, kv_heads, dim, dtype=torch.bfloat16, device=device)
            for _ in range(2))
    assert attention_kernel(device, torch.bfloat16, planned=True) == "varlen"
    for rank in range(context):
        pos = load_balanced_positions(seq, context, rank) if context > 1 else torch.arange(seq)
        order = gathered_positions(seq, context) if context > 1 else torch.arange(seq)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        got = attend(leaves[0][:, pos], leaves[1][:, order], leaves[2][:, order],
                     attention_segments(docs, device, context, rank))
        got.float().square().sum().backward()
        # The references in fp32 on the host, from the same bf16 values.
        ref = [t.detach().float().cpu().requires_grad_(True) for t in (q, k, v)]
        want = _dense(*ref, doc_ids)[:, pos]
        want.square().sum().backward()
        torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
        for leaf, r in zip(leaves, ref, strict=True):
            torch.testing.assert_close(leaf.grad.float().cpu(), r.grad, atol=5e-2, rtol=5e-2)
        plan = attention_segments(docs, torch.device("cpu"), context, rank)
        flat = [t.detach().float().cpu().reshape(-1, t.shape[2], dim)
                for t in (q[:, pos], k[:, order], v[:, order])]
        keys = flat[1:] if plan.k_index is None else [t[plan.k_index] for t in flat[1:]]
        emulated = varlen_attn_emulated(flat[0], *keys, plan.cu_q, plan.cu_k, plan.max_q,
                                        plan.max_k, window_size=(-1, 0), enable_gqa=True)
        torch.testing.assert_close(got.float().cpu().reshape(emulated.shape), emulated,
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu() is None, reason="needs a CUDA device")
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (3, 0), (-1, 2)])
def test_the_emulator_equals_the_gpu_kernel_on_each_window(window: tuple[int, int]) -> None:
    """Segments with fewer, as many and more queries than keys (lower-right alignment,
    queries that see no key): torch's kernel and the emulator agree, log-sum-exp too."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    device = _gpu()
    assert device is not None
    torch.manual_seed(0)
    q_lens, k_lens = [5, 7, 9, 4], [5, 11, 6, 4]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (q_lens, k_lens))
    q = torch.randn(sum(q_lens), 4, 64, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(sum(k_lens), 2, 64, dtype=torch.bfloat16, device=device)
            for _ in range(2))
    args = (max(q_lens), max(k_lens))
    got, lse = varlen_attn(q, k, v, cu_q.to(device), cu_k.to(device), *args,
                           window_size=window, enable_gqa=True, return_aux=AuxRequest(lse=True))
    want, want_lse = varlen_attn_emulated(*(t.float().cpu() for t in (q, k, v)), cu_q, cu_k,
                                          *args, window_size=window, enable_gqa=True,
                                          return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    lse = lse.float().cpu()
    assert lse.shape == want_lse.shape, (lse.shape, want_lse.shape)
    seen = want_lse.isfinite()
    torch.testing.assert_close(lse[seen], want_lse[seen], atol=2e-2, rtol=2e-2)
    assert not lse[~seen].isfinite().any()  # queries that see no key (+inf on flash 2)
