"""The CPU stand-in for torch's variable-length flash kernel, against hand-computed cases.

The tests of the attention backend trust :func:`varlen_attn_emulated` in the kernel's
place; here it is checked on cases small enough to work out by hand. With zero queries
every score is 0, so a query's output is the mean of the values of the keys its window
lets it see: which keys those are is the whole point (causal, lower-right alignment,
sliding and full windows, segments kept apart, grouped heads).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.varlen import AuxRequest

from mimotron.models.attention.varlen_emulation import varlen_attn_emulated

VALUES = [1.0, 2.0, 4.0, 8.0]


def _cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32)


def _means(n: int, m: int, window: tuple[int, int]) -> list[float]:
    """Outputs of one segment of ``n`` zero queries over keys valued ``VALUES[:m]``."""
    q = torch.zeros(n, 1, 2, dtype=torch.float64)
    k = torch.randn(m, 1, 2, dtype=torch.float64)  # any keys: zero queries score them 0
    v = torch.tensor(VALUES[:m], dtype=torch.float64)[:, None, None].expand(m, 1, 2)
    out = varlen_attn_emulated(q, k, v, _cu(0, n), _cu(0, m), n, m, window_size=window)
    torch.testing.assert_close(out[..., 0], out[..., 1])
    return out[:, 0, 0].tolist()


@pytest.mark.parametrize(("n", "m", "window", "want"), [
    # Causal, as many queries as keys: query r sees keys 0..r.
    (3, 3, (-1, 0), [1.0, 1.5, 7 / 3]),
    # Full attention: every query sees every key.
    (3, 3, (-1, -1), [7 / 3] * 3),
    # Causal, 2 queries over 3 keys (a CP chunk after its document's start): aligned at
    # the lower right, query 0 sees keys 0..1 and the last query every key (upper-left
    # alignment would give 1.0, 1.5).
    (2, 3, (-1, 0), [1.5, 7 / 3]),
    (2, 4, (-1, 0), [7 / 3, 15 / 4]),
    # Sliding window of one key back: query r sees keys r-1..r.
    (3, 3, (1, 0), [1.0, 1.5, 3.0]),
    # One key ahead, unbounded behind, lower right: query 0 of 2 over 4 keys sees 0..3.
    (2, 4, (-1, 1), [15 / 4, 15 / 4]),
    # More queries than keys, causal: query 0 sees no key (a zero output).
    (3, 2, (-1, 0), [0.0, 1.0, 1.5]),
])
def test_the_window_picks_the_keys(n: int, m: int, window: tuple[int, int],
                                   want: list[float]) -> None:
    assert _means(n, m, window) == pytest.approx(want, abs=1e-12)


def test_segments_attend_only_to_their_own_keys_and_scale_the_scores() -> None:
    """Two segments packed in one call; ``q . k`` of ``ln 2`` weighs a key twice the
    other at scale 1, four times at scale 2; the log-sum-exp is ``[H, T_q]``."""
    ln2 = math.log(2.0)
    q = torch.ones(3, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, ln2, 0.0, ln2, 0.0], dtype=torch.float64)[:, None, None]
    v = torch.tensor([3.0, 6.0, 100.0, 9.0, 12.0], dtype=torch.float64)[:, None, None]
    # Segment 0: query 0 over keys 0..1; segment 1: queries 1..2 over keys 3..4 (key 2,
    # valued 100, belongs to no segment).
    cu_q, cu_k = _cu(0, 1, 3), torch.tensor([0, 2, 5], dtype=torch.int32)
    k_rows = torch.tensor([0, 1, 3, 4])
    cu_k_read = _cu(0, 2, 4)
    out, lse = varlen_attn_emulated(q, k[k_rows], v[k_rows], cu_q, cu_k_read, 2, 2,
                                    return_aux=AuxRequest(lse=True))
    # Segment 0: (3 + 2 * 6) / 3; segment 1, full window: (2 * 9 + 12) / 3.
    assert out[:, 0, 0].tolist() == pytest.approx([5.0, 10.0, 10.0])
    assert lse.shape == (1, 3) and lse[0].tolist() == pytest.approx([math.log(3.0)] * 3)
    scaled = varlen_attn_emulated(q, k[k_rows], v[k_rows], cu_q, cu_k_read, 2, 2, scale=2.0)
    assert scaled[0, 0, 0].item() == pytest.approx((3 + 4 * 6) / 5)
    # Read through cu_k over all five keys the segments are keys 0..1 and 2..4.
    out = varlen_attn_emulated(q, k, v, cu_q, cu_k, 2, 3)
    assert out[1:, 0, 0].tolist() == pytest.approx([(100 + 2 * 9 + 12) / 4] * 2)


def test_grouped_heads_share_their_key_value_head() -> None:
    """4 query heads over 2 key/value heads: heads 0-1 read head 0, heads 2-3 head 1."""
    q = torch.zeros(2, 4, 1, dtype=torch.float64)
    k = torch.zeros(2, 2, 1, dtype=torch.float64)
    v = torch.tensor([[1.0, 10.0], [3.0, 30.0]], dtype=torch.float64)[..., None]
    out = varlen_attn_emulated(q, k, v, _cu(0, 2), _cu(0, 2), 2, 2, window_size=(-1, 0),
                               enable_gqa=True)
    assert out[..., 0].tolist() == [[1.0, 1.0, 10.0, 10.0], [2.0, 2.0, 20.0, 20.0]]
    with pytest.raises(ValueError, match="enable_gqa=True"):
        varlen_attn_emulated(q, k, v, _cu(0, 2), _cu(0, 2), 2, 2)


def test_16_bit_inputs_come_back_in_their_dtype() -> None:
    q, k, v = (torch.randn(5, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    out = varlen_attn_emulated(q, k, v, _cu(0, 5), _cu(0, 5), 5, 5, window_size=(-1, 0))
    want = varlen_attn_emulated(*(t.double() for t in (q, k, v)), _cu(0, 5), _cu(0, 5), 5, 5,
                                window_size=(-1, 0))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


def test_rows_no_segment_covers_are_nan() -> None:
    """The kernel leaves them unwritten (``torch.empty``): a reader of them must fail."""
    q, k, v = (torch.ones(4, 1, 2) for _ in range(3))
    out = varlen_attn_emulated(q, k, v, _cu(1, 3), _cu(0, 2), 2, 2)
    assert out[:, 0, 0].isnan().tolist() == [True, False, False, True]


def test_keys_in_use_and_pages() -> None:
    """``seqused_k`` reads the first keys of a slot; ``block_table`` reads them from pages."""
    q = torch.zeros(1, 1, 1)
    k = torch.zeros(4, 1, 1)
    v = torch.tensor([1.0, 2.0, 4.0, 8.0])[:, None, None]
    with torch.no_grad():
        used = varlen_attn_emulated(q, k, v, _cu(0, 1), _cu(0, 4), 1, 4,
                                    seqused_k=_cu(2))
        assert used.item() == 1.5
        # Pages of 2 keys: [1, 2] and [4, 8]; the segment reads page 1, then page 0.
        paged = varlen_attn_emulated(q, k.view(2, 2, 1, 1), v.view(2, 2, 1, 1), _cu(0, 1),
                                     None, 1, 4, seqused_k=_cu(3),
                                     block_table=torch.tensor([[1, 0]], dtype=torch.int32))
        assert paged.item() == pytest.approx((4 + 8 + 1) / 3)
    with pytest.raises(RuntimeError, match="inference-only"):
        varlen_attn_emulated(q.requires_grad_(), k, v, _cu(0, 1), _cu(0, 4), 1, 4,
                             seqused_k=_cu(2))


@pytest.mark.parametrize(("cu_q", "cu_k", "max_q", "max_k", "needle"), [
    ((0, 3), (0, 3), 2, 3, "max_q=2"),  # the GPU would compute only max_q rows' blocks
    ((0, 3), (0, 3), 3, 2, "max_k=2"),
    ((0, 5), (0, 3), 5, 5, r"cu_seq_q=\[0, 5\] is invalid"),  # past the 4 query rows
    ((0, 3), (0, 6), 3, 6, r"cu_seq_k=\[0, 6\] is invalid"),
    ((0, 3, 2), (0, 1, 2), 3, 3, "must not decrease"),
    ((0, 2, 3), (0, 3), 3, 3, "both must be"),
])
def test_arguments_the_kernel_is_undefined_for_are_refused(
        cu_q: tuple[int, ...], cu_k: tuple[int, ...], max_q: int, max_k: int,
        needle: str) -> None:
    q, k, v = (torch.ones(4, 1, 2) for _ in range(3))
    with pytest.raises(ValueError, match=needle):
        varlen_attn_emulated(q, k, v, _cu(*cu_q), _cu(*cu_k), max_q, max_k)
