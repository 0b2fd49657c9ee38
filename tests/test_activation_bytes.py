"""Activations at the field's level: what a layer keeps, checked against published figures.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), adjusted for SwiGLU, no dropout and flash attention, count ``16h + 8f`` bytes
per token per layer in bf16: 600 MiB for a Llama-2-7B layer at 4096 tokens, 187 MiB at
TP 8 (norms and the linears' inputs whole) and 75 MiB at TP 8 with sequence
parallelism. :func:`mimotron.dryrun.saved_bytes.layer_activation_bytes` measures what
our layer keeps (every storage autograd saves, once) under ``FakeTensorMode`` with
TP applied over a ``fake`` group of 8, and must land within 1.2x of each.

Also here: the pieces that get there, each tested on its own because the reference loop
of the parity tests shares the model code. The RMSNorm function against plain ops; the
one weight cast per step against autocast's default of one per micro-batch, its
weight gradients reaching fp32 layer by layer in every micro-batch; the
16-bit residual stream and stage links; GQA without expanded keys/values.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import mimotron.models.blocks as blocks
from mimotron.config import load_config
from mimotron.dryrun.saved_bytes import layer_activation_bytes, saved_bytes
from mimotron.estimate.memory import layer_bytes_per_token
from mimotron.models.blocks import Attention, TransformerBlock, rms_norm
from mimotron.models.language import LanguageModel
from mimotron.models.recompute import apply_recompute
from mimotron.pipeline.shapes import residual_dtype
from mimotron.training.precision import autocast_factory, step_cast_scope
from tests.common import DIGITS

MIB = 2**20
H, F_WIDTH, SEQ = 4096, 11008, 4096
LLAMA_7B_LAYER = [
    "modules.language.hidden_size=4096", "modules.language.num_heads=32",
    "modules.language.ffn_hidden_size=11008", "modules.language.num_layers=32",
    f"data.seq_length={SEQ}", "train.micro_batch_size=1", "train.precision=bf16",
]
TP8 = ["modules.language.parallel.tensor=8"]
SP = ["modules.language.parallel.sequence_parallel=true"]
# (label, overrides, published bytes per layer)
PUBLISHED = [
    ("no parallelism", [], (16 * H + 8 * F_WIDTH) * SEQ),
    ("TP 8", TP8, (8 * H + (8 * H + 8 * F_WIDTH) // 8) * SEQ),
    ("TP 8 + SP", TP8 + SP, (16 * H + 8 * F_WIDTH) // 8 * SEQ),
]


@pytest.mark.parametrize(("label", "extra", "published"), PUBLISHED,
                         ids=[p[0] for p in PUBLISHED])
def test_layer_activations_match_the_published_analysis(label, extra, published):
    cfg = load_config(DIGITS, LLAMA_7B_LAYER + extra)
    measured = layer_activation_bytes(cfg)
    ratio = measured / published
    assert 1 / 1.2 <= ratio <= 1.2, f"{label}: {measured / MIB:.1f} MiB vs {published / MIB} MiB"
    # And the plan's formula says the same (within the per-token statistics it leaves out).
    whole, split = layer_bytes_per_token(cfg, "language")
    estimate = SEQ * (whole + split // cfg.modules["language"].parallel.tensor)
    assert 0.98 <= measured / estimate <= 1.02, (label, measured, estimate)


def test_fp32_residual_keeps_the_stream_in_fp32():
    base = load_config(DIGITS, LLAMA_7B_LAYER)
    fp32 = load_config(DIGITS, LLAMA_7B_LAYER + ["train.fp32_residual_connection=true"])
    assert residual_dtype(base) == torch.bfloat16 and residual_dtype(fp32) == torch.float32
    # Two norm inputs per layer grow from 2 to 4 bytes per value: 4h per token.
    assert layer_activation_bytes(fp32) - layer_activation_bytes(base) == pytest.approx(
        4 * H * SEQ, rel=0.01)


def _plain_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


@pytest.mark.parametrize("chunk", [1 << 22, 16], ids=["whole", "chunked"])
def test_rms_norm_function_matches_plain_ops(chunk, monkeypatch):
    monkeypatch.setattr(blocks, "_NORM_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    g = torch.randn(3, 5, 8)
    y = rms_norm(x, w, 1e-6)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    y_ref = _plain_rms_norm(x, w, 1e-6)
    rx, rw = torch.autograd.grad(y_ref, (x, w), g)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)
    # The incoming gradient is not modified (it may also flow down the residual path).
    assert torch.equal(g, torch.randn(3, 5, 8).copy_(g))


def test_rms_norm_saves_its_input_only():
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.ones(64))
    kept = saved_bytes(lambda: rms_norm(x, w, 1e-6), [w])
    assert kept == x.numel() * 2 + 2 * 16 * 4  # the input and a per-token fp32 rstd


def _saved_weight_copies(scoped: bool, microbatches: int = 4) -> int:
    torch.manual_seed(0)
    block = TransformerBlock(64, 4, 0, causal=True)
    shapes = {tuple(p.shape) for p in block.parameters() if p.dim() == 2}
    copies: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            copies.add(t.untyped_storage().data_ptr())
        return t

    device = torch.device("cpu")
    autocast = autocast_factory("bf16", device)
    scope = step_cast_scope("bf16", device) if scoped else contextlib.nullcontext()
    with scope, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = []
        for _ in range(microbatches):
            with autocast():
                outs.append(block(torch.randn(2, 8, 64)))
        for out in outs:
            out.float().sum().backward()
    return len(copies)


def test_one_weight_cast_per_step_not_per_microbatch():
    linears = 7  # wq, wk, wv, wo, w1, w2, w3
    assert _saved_weight_copies(scoped=False) == 4 * linears  # autocast's own behaviour
    assert _saved_weight_copies(scoped=True) == linears


def _weight_grads_pending_at_backward_end(microbatches: int = 3) -> list[int]:
    """Per micro-batch: the 16-bit weight gradients not yet in ``.grad`` when the
    backward reaches the stack's input (the last thing it computes)."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*(TransformerBlock(64, 4, 0, causal=True) for _ in range(2)))
    weights = [p for p in stack.parameters() if p.dim() == 2]
    arrived = dict.fromkeys(map(id, weights), 0)

    def count(p: torch.Tensor) -> None:
        arrived[id(p)] += 1

    for p in weights:
        p.register_post_accumulate_grad_hook(count)
    pending: list[int] = []
    device = torch.device("cpu")
    autocast = autocast_factory("bf16", device)
    with step_cast_scope("bf16", device):
        xs = [torch.randn(2, 8, 64, requires_grad=True) for _ in range(microbatches)]
        outs = []
        for x in xs:
            with autocast():
                outs.append(stack(x))
        for k, (x, out) in enumerate(zip(xs, outs, strict=True)):
            x.register_hook(lambda g, k=k: pending.append(
                sum(arrived[id(p)] <= k for p in weights)))
            out.float().sum().backward()
    return pending


def test_weight_grads_reach_fp32_layer_by_layer_in_every_microbatch():
    """The step's one cast per weight must not make later micro-batches hold every
    layer's 16-bit weight gradient until their backward ends (each use of a cast has a
    node of its own micro-batch, run right after the layer's matmul)."""
    assert _weight_grads_pending_at_backward_end() == [0, 0, 0]


class _WeightCasts(TorchDispatchMode):
    """Counts the 16-bit casts made of fp32 tensors of the given 2-D shapes."""

    def __init__(self, shapes: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32
                and out.dtype == torch.bfloat16 and tuple(out.shape) in self.shapes):
            self.count += 1
        return out


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_recomputed_layers_read_the_steps_weight_casts(mode: str) -> None:
    """A recomputation (in the backward) reads the forward's 16-bit copies: still one
    cast per weight per step over 3 micro-batches, forwards and backwards."""
    torch.manual_seed(0)
    lm = LanguageModel(32, num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=96,
                       max_seq_len=8)
    apply_recompute(lm, mode)
    shapes = {tuple(p.shape) for p in lm.parameters() if p.dim() == 2}
    casts = _WeightCasts(shapes)
    device = torch.device("cpu")
    autocast = autocast_factory("bf16", device)
    with step_cast_scope("bf16", device), casts:
        outs = []
        for _ in range(3):
            with autocast():
                outs.append(lm(torch.randn(2, 8, 64)))
        for out in outs:
            out.float().sum().backward()
    assert casts.count == sum(p.dim() == 2 for p in lm.parameters() if p is not lm.embed.weight)


def test_weight_cast_scope_changes_no_number():
    torch.manual_seed(0)
    block = TransformerBlock(64, 4, 0, causal=True)
    xs = [torch.randn(2, 8, 64) for _ in range(3)]
    device = torch.device("cpu")
    autocast = autocast_factory("bf16", device)

    def grads(scoped: bool) -> list[torch.Tensor]:
        block.zero_grad()
        scope = step_cast_scope("bf16", device) if scoped else contextlib.nullcontext()
        with scope:
            outs = []
            for x in xs:
                with autocast():
                    outs.append(block(x))
            for out in outs:
                out.float().sum().backward()
        return [p.grad.clone() for p in block.parameters()]

    for a, b in zip(grads(False), grads(True), strict=True):
        assert torch.equal(a, b)


def test_grouped_query_attention_matches_expanded_keys_and_keeps_them_grouped():
    torch.manual_seed(0)
    attn = Attention(64, 8, causal=True, num_kv_heads=2)
    x = torch.randn(2, 16, 64, requires_grad=True)
    out = attn(x)
    # The expanded computation, written out (transformers' repeat_kv).
    q = attn.wq(x).view(2, 16, 8, 8).transpose(1, 2)
    k = attn.wk(x).view(2, 16, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    v = attn.wv(x).view(2, 16, 2, 8).transpose(1, 2).repeat_interleave(4, dim=1)
    ref = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                  .transpose(1, 2).reshape(2, 16, 64))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # Saved keys and values hold 2 heads, not 8.
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attn(x)
    assert (2, 2, 16, 8) in shapes and (2, 8, 16, 8) in shapes
    assert shapes.count((2, 8, 16, 8)) <= 2  # queries and the output, never expanded K/V


def _vocab_parallel_loss_saved(rank: int, world: int) -> tuple[int, int, float]:
    import torch.distributed as dist

    from mimotron.parallel.tensor_parallel import vocab_parallel_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 16, 96, requires_grad=True)
    labels = torch.randint(0, 96 * world, (2, 16))
    mask = torch.ones(2, 16)
    group = dist.new_group(list(range(world)))
    kept = saved_bytes(lambda: vocab_parallel_loss(logits, labels, mask, group)[0])
    loss = vocab_parallel_loss(logits, labels, mask, group)[0]
    (grad,) = torch.autograd.grad(loss, logits)
    # The plain cross entropy's gradient, on this rank's shard of the vocabulary.
    full = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(full, logits.detach())
    ref_logits = torch.cat(full, dim=-1).requires_grad_(True)
    ref = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(),
                                            reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    mine = ref_grad[..., rank * 96:(rank + 1) * 96]
    return kept, logits.numel(), float((grad - mine).abs().max())


def test_vocab_parallel_loss_keeps_one_fp32_copy_of_the_logits():
    """The loss keeps its exp (4 bytes per logit) and the label indices, not the shifted
    logits ``gather`` would keep; the gradient is the plain cross entropy's."""
    from mimotron.forked_ranks import run_ranks

    for kept, numel, err in run_ranks(2, _vocab_parallel_loss_saved, timeout_s=60):
        assert 4 * numel <= kept <= 4 * numel + 4096, kept
        assert err < 1e-5
