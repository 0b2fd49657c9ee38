"""Qwen3-VL's DeepStack: vision features added to the first decoder layers' outputs.

The tower hands over, besides its final tokens, the merged features of some of its
intermediate layers (``deepstack_visual_indexes``); decoder layer ``i`` adds feature set
``i`` at the visual positions of its output hidden states (``transformers``'
``Qwen3VLTextModel._deepstack_process``). :class:`~mimotron.models.language.LanguageModel`
does it for the layers it holds, so a pipeline stage adds only its own, and under
context or sequence parallelism each rank adds the features of the positions it holds.

:func:`visual_rows` finds, once per forward, where those positions are on this rank
and which feature row each takes; :func:`add_visual` adds one layer's features there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["VisualRows", "add_visual", "visual_rows"]

VisualRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(row, column, feature row)`` of each visual position a rank holds; the feature row
is ``None`` where the rank holds every position (features in mask order)."""


def visual_rows(visual_mask: torch.Tensor | None, deepstack: Sequence[torch.Tensor | None],
                shape: tuple[int, int], device: torch.device,
                held: torch.Tensor | None) -> VisualRows:
    """The visual positions of this rank's hidden states and their feature rows.

    Computed where the mask lives (on the host, no device sync), then moved.

    Args:
        visual_mask: bool ``[B, S]`` of the visual positions, whole rows.
        deepstack: one ``[num visual, hidden]`` feature tensor per layer (``None`` for
            a layer another pipeline stage holds).
        shape: ``(B, S)`` of the whole rows.
        device: where the hidden states are.
        held: the global positions along dim 1 this rank holds (``None``: all).

    Raises:
        ValueError: a mask of another shape, or features of another row count.
    """
    if visual_mask is None or tuple(visual_mask.shape) != shape:
        got = None if visual_mask is None else tuple(visual_mask.shape)
        raise ValueError(f"deepstack needs a visual_mask of [{shape[0]}, {shape[1]}] (whole "
                         f"rows), got {got}")
    mask = visual_mask.bool()
    order = mask.flatten().cumsum(0).view_as(mask) - 1  # feature row of each position
    num_visual = int(order[-1, -1]) + 1 if order.numel() else 0
    bad = [tuple(t.shape) for t in deepstack
           if t is not None and (t.dim() != 2 or t.shape[0] != num_visual)]
    if bad:
        raise ValueError(f"deepstack features of shapes {bad} for {num_visual} visual "
                         "positions: expected [num visual, hidden] each")
    if held is not None:
        mask, order = mask[:, held], order[:, held]
    rows, cols = mask.nonzero(as_tuple=True)
    features = None if held is None else order[rows, cols].to(device)
    return rows.to(device), cols.to(device), features


def add_visual(hidden: torch.Tensor, features: torch.Tensor, visual: VisualRows
               ) -> torch.Tensor:
    """``hidden`` plus DeepStack ``features`` at the visual positions (out of place)."""
    rows, cols, which = visual
    values = features if which is None else features.index_select(0, which)
    # Each position once: accumulate adds the feature to the hidden state in its dtype.
    return hidden.index_put((rows, cols), values.to(hidden.dtype), accumulate=True)
