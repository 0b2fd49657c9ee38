"""The native-resolution keys of a collated batch: image grids, token counts, 3-D positions.

A native-resolution vision module (:mod:`mimotron.config.native_vision`) reads, besides
``image`` (patch rows in slots) and ``has_image``, each image's patch grid and token
count; its language model reads 3-D rotary positions. Samples carry them as
``image_grid`` ``[3]`` (``[K, 3]`` with several images), ``image_tokens`` ``[]``
(``[K]``) and ``position_ids`` ``[3, L]``; :func:`stack_native` stacks them into
``[B, 3]`` / ``[B, K, 3]``, ``[B]`` / ``[B, K]`` (zeros where absent) and
``[B, 3, S]`` (0 on padding), so slicing by samples (dim 0) cuts them like every other
key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NATIVE_KEYS", "stack_native"]

NATIVE_KEYS = ("image_grid", "image_tokens", "position_ids")
"""The per-sample keys :func:`stack_native` stacks."""


def _items(samples: Sequence[dict[str, Any]], key: str, item_shape: tuple[int, ...]
           ) -> torch.Tensor:
    """``key`` of every sample, zero where absent, padded to the most items (dim 1)."""
    values = [s.get(key) for s in samples]
    items = max((v.shape[0] for v in values if v is not None and v.dim() > len(item_shape)),
                default=0)
    rows = []
    for value in values:
        value = torch.zeros(item_shape, dtype=torch.long) if value is None else value.long()
        if items:  # several items per sample: [K, ...]
            value = value.reshape(-1, *item_shape)
            value = F.pad(value, (*(0, 0) * len(item_shape), 0, items - value.shape[0]))
        rows.append(value)
    return torch.stack(rows)


def stack_native(samples: Sequence[dict[str, Any]], seq_length: int) -> dict[str, torch.Tensor]:
    """The native-resolution keys of a batch, ``{}`` when no sample has them.

    Args:
        samples: the batch's samples.
        seq_length: the padded sequence length.

    Raises:
        ValueError: some samples carry the keys and others do not, or positions longer
            than ``seq_length``.
    """
    # image_grid marks a native sample (packed samples carry 1-D position_ids of their own)
    has = ["image_grid" in s for s in samples]
    if not any(has):
        return {}
    if not all(has):
        raise ValueError(f"samples {[i for i, h in enumerate(has) if not h]} lack "
                         f"{list(NATIVE_KEYS)} that the others carry")
    positions = []
    for i, sample in enumerate(samples):
        pos = sample["position_ids"].long()
        if pos.dim() != 2 or pos.shape[0] != 3 or pos.shape[1] > seq_length:
            raise ValueError(f"sample {i}: position_ids of shape {tuple(pos.shape)}: expected "
                             f"[3, L] with L <= seq_length={seq_length}")
        positions.append(F.pad(pos, (0, seq_length - pos.shape[1])))
    return {"image_grid": _items(samples, "image_grid", (3,)),
            "image_tokens": _items(samples, "image_tokens", ()),
            "position_ids": torch.stack(positions)}
