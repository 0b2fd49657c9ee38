"""Bidirectional attention within segments (``attend(..., plan, causal=False)``).

The vision towers attend within images, frames and windows without a causal order.
Both kernels of a plan run: the per-segment SDPA and the GPU's ``varlen`` branch with the
CPU emulator of torch's kernel in its place. Against a block-diagonal mask written out
here (outputs and gradients); a non-causal query's output moves when a key *after* it
in its segment changes, a causal one's does not, and neither moves for a key of another
segment. A context-parallel plan (keys other than the queries' own rows) is refused
without ``causal=True``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mimotron.models.attention import Documents, attend, attention_segments, kernels
from mimotron.models.attention.varlen_emulation import varlen_attn_emulated

BOUNDS = (0, 5, 14, 17, 28, 32)  # segments of 5, 9, 3, 11 and 4 rows
SEQ = BOUNDS[-1]


@pytest.fixture(params=["segments", "varlen"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run plans on one kernel; returns the ``window_size`` of each ``varlen`` call."""
    windows: list[Any] = []
    if request.param == "varlen":
        def recorded(*args: Any, **kwargs: Any) -> Any:
            windows.append(kwargs["window_size"])
            return varlen_attn_emulated(*args, **kwargs)

        monkeypatch.setattr(kernels, "attention_kernel",
                            lambda device, dtype, planned: "varlen" if planned else "sdpa")
        monkeypatch.setattr(kernels, "varlen_function", lambda: recorded)
    return windows


def _dense_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Each query over every key of its segment: the block-diagonal mask written out."""
    segment = torch.bucketize(torch.arange(SEQ), torch.tensor(BOUNDS[1:]), right=True)
    allowed = segment[:, None] == segment[None, :]
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _inputs(dim: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q = torch.randn(1, SEQ, 4, dim, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, SEQ, 2, dim, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    return q, k, v


def _plan() -> Any:
    return attention_segments(Documents(SEQ, (BOUNDS,)), torch.device("cpu"))


def test_non_causal_segments_equal_a_block_diagonal_mask(kernel: list[Any]) -> None:
    q, k, v = _inputs()
    got = attend(q, k, v, _plan(), causal=False)
    want = _dense_blocks(q, k, v)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expect = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, e in zip(grads, expect, strict=True):
        torch.testing.assert_close(g, e)
    assert kernel in ([], [(-1, -1)])  # varlen: one call, no window bound


@pytest.mark.parametrize("causal", [False, True])
def test_which_keys_a_query_sees(kernel: list[Any], causal: bool) -> None:
    """Change the value of row 10 (inside the segment [5, 14)): row 6 of that segment
    sees it only without causality, rows of other segments never do, row 12 always."""
    q, k, v = (t.detach() for t in _inputs())
    plan = _plan()
    before = attend(q, k, v, plan, causal=causal)
    v2 = v.clone()
    v2[0, 10] += 1.0
    moved = (attend(q, k, v2, plan, causal=causal) - before).abs().amax(dim=(0, 2, 3)) > 0
    assert bool(moved[6]) is not causal
    assert bool(moved[12])
    assert not moved[:5].any() and not moved[14:].any()
    assert kernel == [] or kernel == [(-1, 0) if causal else (-1, -1)] * 2


def test_non_causal_refuses_a_context_parallel_plan() -> None:
    q, k, v = (t.detach() for t in _inputs())
    plan = attention_segments(Documents(SEQ, (BOUNDS,)), torch.device("cpu"), 2, 0)
    half = q[:, : SEQ // 2]
    with pytest.raises(ValueError, match="non-causal attention needs a plan"):
        attend(half, k, v, plan, causal=False)


def _gpu() -> torch.device | None:
    from mimotron.runtime import accelerator_available

    return torch.device("cuda", 0) if accelerator_available() else None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu() is None, reason="needs a CUDA device")
def test_the_gpu_varlen_kernel_attends_within_segments() -> None:
    """On a GPU in bf16 a non-causal plan runs torch's ``varlen_attn``: outputs and
    gradients match the block-diagonal reference in fp32 on the same bf16 values."""
    device = _gpu()
    assert device is not None
    assert kernels.attention_kernel(device, torch.bfloat16, planned=True) == "varlen"
    q, k, v = (t.detach().to(device, torch.bfloat16).requires_grad_(True) for t in _inputs(64))
    plan = attention_segments(Documents(SEQ, (BOUNDS,)), device)
    got = attend(q, k, v, plan, causal=False)
    got.float().square().sum().backward()
    ref = [t.detach().float().cpu().requires_grad_(True) for t in (q, k, v)]
    want = _dense_blocks(*ref)
    want.square().sum().backward()
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)
    for leaf, r in zip((q, k, v), ref, strict=True):
        torch.testing.assert_close(leaf.grad.float().cpu(), r.grad, atol=5e-2, rtol=5e-2)
