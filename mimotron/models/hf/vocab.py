"""A language model's vocabulary larger than its checkpoint's: the extra rows.

The model's vocabulary is ``max(config.json vocab_size, tokenizer vocabulary)`` padded
to a multiple of 64 (so TP can split it), so the embedding and an untied output head can
have more rows than the checkpoint stores: padding and added placeholder tokens. The
first ``V`` rows are the checkpoint's (under vocabulary-parallel TP each rank reads its
row range intersected with ``[0, V)``); every row ``r >= V`` gets the value
:func:`mimotron.data.hf_tokenizer.new_embedding_rows` gives it: the per-dimension mean
of the checkpoint's rows plus noise drawn from ``(seed, r)`` scaled by their standard
deviation. The statistics are taken over the whole checkpoint table, read in fixed
chunks of rows in the same order on every rank, so every layout gets bitwise the same
rows, and no rank holds more than one chunk of the table at a time.
"""

from __future__ import annotations

import torch

from mimotron.data.hf_tokenizer import new_embedding_rows

# Rows read at once when the statistics are taken (bounds the memory to one chunk).
STATS_CHUNK_ROWS = 4096


def table_stats(hf_slice: object, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and (population) standard deviation of a ``[V, H]`` table.

    Two passes over fixed row chunks in float64, so the result does not depend on who
    reads it.

    Args:
        hf_slice: a safetensors slice (``handle.get_slice(name)``) of the table.
        num_rows: ``V``, the table's rows.

    Returns:
        ``(mean, std)``, each ``[H]`` float64.
    """
    starts = range(0, num_rows, STATS_CHUNK_ROWS)
    total = sum(hf_slice[s:s + STATS_CHUNK_ROWS].double().sum(dim=0)  # type: ignore[index]
                for s in starts)
    mean = total / num_rows
    sq = sum(((hf_slice[s:s + STATS_CHUNK_ROWS].double() - mean) ** 2).sum(dim=0)  # type: ignore[index]
             for s in starts)
    return mean, (sq / num_rows).sqrt()


@torch.no_grad()
def read_rows(local: torch.Tensor, row_start: int, hf_slice: object, num_rows: int,
              seed: int, cols: tuple[slice, ...]) -> None:
    """Fill ``local`` (rows ``row_start ..`` of the model's table) from a smaller table.

    Args:
        local: this rank's rows of the parameter, ``[n, ...]``.
        row_start: the global row of ``local[0]``.
        hf_slice: the checkpoint table's safetensors slice, ``[V, H]``.
        num_rows: ``V``.
        seed: the run seed (the new rows' noise).
        cols: the slices of the other dimensions this rank holds.
    """
    stop = row_start + local.shape[0]
    old_stop = min(stop, num_rows)
    if old_stop > row_start:
        local[: old_stop - row_start].copy_(hf_slice[(slice(row_start, old_stop), *cols)])  # type: ignore[index]
    first_new = max(row_start, num_rows)
    if first_new < stop:
        mean, std = table_stats(hf_slice, num_rows)
        new = new_embedding_rows(mean, std, range(first_new, stop), seed)
        local[first_new - row_start:].copy_(new[(slice(None), *cols)].to(local.dtype))
