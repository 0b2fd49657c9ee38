"""Transfer shapes both sides of a pipeline link know in advance (pure functions).

A tensor whose shape and dtype the receiver can derive from the config, exactly as the
sender does, travels without a shape header (:mod:`mimotron.pipeline.p2p`). Only the
language model's stage links qualify: every stage of it sees the same padded batch
geometry, so a link carries ``[micro_batch_size / data, seq_length / context, hidden]``
in the residual stream's dtype forward, and the same shape and dtype (the gradient of
that input) backward. Everything whose shape depends on the data keeps its header:
encoder stage links and the bridge carry one row per sample *present* in the slice,
and a context-parallel bridge the rows of the placeholders each CP rank holds.

The decision uses nothing but the layout and the batch geometry, which are identical on
every rank, so both ends of a link agree without a collective; the sender checks every
tensor against the same shape before sending (a batch of another geometry is a
``ValueError`` there, not a hang or a silently mismatched message).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout


@dataclass(frozen=True)
class StageLinkShape:
    """The tensor every language stage link carries (forward, and its gradient back)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    origin: str
    """The config values the shape comes from, for error messages."""
    tokens: tuple[int, int]
    """``[rows, seq_length]`` of the token batch each language DP rank must be fed."""

    def check(self, t: torch.Tensor, what: str) -> None:
        """Raise if ``t`` does not match (before anything is sent).

        Raises:
            ValueError: ``t``'s shape or dtype differs; the message names the geometry.
        """
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(
                f"{what} is {list(t.shape)} {t.dtype}, but the language model's stage link "
                f"carries {list(self.shape)} {self.dtype} ({self.origin}): every micro-batch "
                f"must hold {list(self.tokens)} tokens per language data-parallel rank")


def stage_link_shape(layout: Layout, micro_batch_size: int, seq_length: int | None,
                     hidden_size: int | None, dtype: torch.dtype = torch.float32
                     ) -> StageLinkShape | None:
    """The language model's stage-link tensor, or ``None`` if it is not known in advance.

    Args:
        layout: the placement of every module.
        micro_batch_size: the global micro-batch size.
        seq_length: every micro-batch's padded sequence length (``data.seq_length``);
            ``None``: unknown (the links keep their headers).
        hidden_size: the language model's hidden size; ``None``: unknown.
        dtype: the residual stream's dtype. Parameters stay fp32 under every
            ``train.precision`` (autocast computes matmuls in bf16/fp16 but the
            residual additions promote back), so stage outputs are fp32.

    Returns:
        ``None`` where the language model has one stage or a value is unknown.
    """
    if LANGUAGE not in layout.modules or seq_length is None or hidden_size is None:
        return None
    par = layout.modules[LANGUAGE].parallel
    if par.pipeline == 1:
        return None
    shape = (micro_batch_size // par.data, seq_length // par.context, hidden_size)
    origin = (f"train.micro_batch_size={micro_batch_size} / data={par.data}, "
              f"data.seq_length={seq_length} / context={par.context}, hidden_size={hidden_size}")
    return StageLinkShape(shape, dtype, origin, (shape[0], seq_length))
