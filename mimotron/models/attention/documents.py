"""Which queries attend to which keys: packed documents and context-parallel chunks.

**Documents.** A packed row (``data.packing``) holds several documents back to back;
a query sees the keys of its own document up to itself. :class:`Documents` keeps, per
row, where each document starts and ends, read once on the host from the batch's
``doc_ids`` (padding, id -1, is a document of its own, so no query is left without a
key). An unpacked row under context parallelism is one document.

**Segments.** Under context parallelism a rank holds two chunks of each row (a head
and a tail, :func:`~mimotron.parallel.context_parallel.load_balanced_positions`) and
the keys of the whole row (all-gathered, in rank order). :func:`attention_segments` cuts
this rank's queries into *segments*: maximal runs of consecutive positions of one
document inside one chunk. A segment of queries ``[q0, q1)`` of a document starting at
``d`` attends to the keys ``[d, q1)``, causally aligned at the lower right (query
``q1 - 1`` sees every key, query ``q0`` the keys up to ``q0``). Without context
parallelism each segment is a whole document and its keys are its own positions.

The plan is the cumulative query and key boundaries of the segments (the
``cu_seqlens`` of variable-length attention), and under context parallelism the
index of each segment's keys in the gathered key rows. It costs ``O(S)`` integers per
row, never ``O(S^2)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from mimotron.host_sync import host_copy
from mimotron.parallel.context_parallel import gathered_positions, load_balanced_ranges


@dataclass(frozen=True)
class Documents:
    """Document boundaries of each row, on the host.

    Attributes:
        seq_len: positions per row (the global sequence length under CP).
        bounds: per row, ascending ``(0, b1, ..., seq_len)``: document ``i`` holds
            positions ``[bounds[i], bounds[i + 1])``.
    """

    seq_len: int
    bounds: tuple[tuple[int, ...], ...]

    @classmethod
    def from_doc_ids(cls, doc_ids: torch.Tensor) -> Documents:
        """The documents of ``[B, S]`` document ids (a new document where the id changes).

        A device tensor is read back once (a host copy, :func:`document_args`, avoids
        that).
        """
        ids = doc_ids.detach().to("cpu")
        change = ids[:, 1:] != ids[:, :-1]
        seq = int(ids.shape[-1])
        rows = tuple((0, *(torch.nonzero(row).flatten() + 1).tolist(), seq) for row in change)
        return cls(seq, rows)

    @classmethod
    def whole(cls, num_rows: int, seq_len: int) -> Documents:
        """Rows of one document each (an unpacked batch)."""
        return cls(seq_len, ((0, seq_len),) * num_rows)

    @property
    def num_rows(self) -> int:
        return len(self.bounds)

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs the segments attend over, whole rows (without context
        parallelism): each document's square, the square of a padding run included (it
        is a segment too). What the FLOP count reads
        (:func:`~mimotron.estimate.flops.transformer_layer_flops`)."""
        return sum((b - a) ** 2 for row in self.bounds for a, b in itertools.pairwise(row))


@dataclass(frozen=True)
class AttentionSegments:
    """This rank's attention as variable-length segments (see the module docstring).

    Attributes:
        q_bounds: cumulative query counts, ``(0, ..., B * S_local)``; segment ``i`` is
            flattened query rows ``[q_bounds[i], q_bounds[i + 1])``.
        k_bounds: cumulative key counts over the keys the segments read, in order.
        max_q: the longest segment's queries.
        max_k: the longest segment's keys.
        k_index: under context parallelism, the flattened gathered key row of each key
            the segments read (``[k_bounds[-1]]`` int64, on the device); ``None`` when
            the keys are the queries' own rows.
        cu_q: ``q_bounds`` as an int32 tensor on the device.
        cu_k: ``k_bounds`` likewise.
    """

    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]
    max_q: int
    max_k: int
    k_index: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @property
    def num_segments(self) -> int:
        return len(self.q_bounds) - 1


def _segments(docs: Documents, ranges: list[tuple[int, int]]
              ) -> list[tuple[int, int, int, int]]:
    """``(row, doc_start, q_start, q_end)`` of every segment, in flattened query order."""
    out = []
    for row, bounds in enumerate(docs.bounds):
        for start, end in ranges:
            for d0, d1 in zip(bounds[:-1], bounds[1:], strict=True):
                q0, q1 = max(start, d0), min(end, d1)
                if q0 < q1:
                    out.append((row, d0, q0, q1))
    return out


def attention_segments(docs: Documents, device: torch.device, cp_size: int = 1,
                   cp_rank: int = 0) -> AttentionSegments:
    """The segments of this rank's queries and the keys each reads.

    Args:
        docs: the rows' documents (whole rows, ``seq_len`` = the global length).
        device: where the kernels run (the plan's tensors live there).
        cp_size: the context-parallel degree (1 = none).
        cp_rank: this rank's coordinate in the CP group.

    Returns:
        The :class:`AttentionSegments`.
    """
    ranges = ([(0, docs.seq_len)] if cp_size == 1
              else load_balanced_ranges(docs.seq_len, cp_size, cp_rank))
    segments = _segments(docs, ranges)
    q_len = [q1 - q0 for _, _, q0, q1 in segments]
    k_len = [q1 - d0 for _, d0, _, q1 in segments]
    # Host arithmetic only: under the dry run's FakeTensorMode tensors hold no values.
    q_bounds, k_bounds = (tuple(accumulate(n, initial=0)) for n in (q_len, k_len))
    k_index = None
    if cp_size > 1:
        # Keys arrive in rank order; row r's key at global position p is gathered row
        # r * S + inverse[p].
        # Built on the device: no host tensor to copy per forward.
        inverse = torch.argsort(gathered_positions(docs.seq_len, cp_size, device))
        k_index = torch.cat([row * docs.seq_len + inverse[d0:q1] for row, d0, _, q1 in segments])
    # The kernel's cumulative lengths: two small copies from the host per forward.
    return AttentionSegments(
        q_bounds, k_bounds, max(q_len), max(k_len), k_index,
        torch.tensor(q_bounds, dtype=torch.int32).to(device),
        torch.tensor(k_bounds, dtype=torch.int32).to(device))


def document_args(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's document and position arguments of a batch (``{}``: neither).

    ``documents`` is read from the batch's host copy of ``doc_ids`` (no device sync);
    ``position_ids`` (RoPE positions restarting at 0 per document; a native-resolution
    VLM's 3-D positions, packed or not, ``[B, 3, S]`` in the batch) stays on the device.
    They travel with every stage's micro-batch, not as module state, so tensor- and
    pipeline-parallel stages all attend within the same documents.
    """
    args: dict[str, Any] = {}
    if "doc_ids" in batch:
        args["documents"] = Documents.from_doc_ids(host_copy(batch, "doc_ids"))
    if "position_ids" in batch:
        positions = batch["position_ids"]
        # M-RoPE positions travel per sample as [B, 3, S]; the model takes [3, B, S].
        args["position_ids"] = positions.transpose(0, 1) if positions.dim() == 3 else positions
    return args
