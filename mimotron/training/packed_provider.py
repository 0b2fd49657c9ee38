"""Per-rank micro-batches of packed rows (``data.packing``), in one global order.

The rows of a step are packed from the global stream position ``start`` by
:func:`~mimotron.data.packing.pack_rows`, identically on every rank; from there the
layout rules are those of :class:`~mimotron.training.data_provider.MicrobatchProvider`
with rows in place of samples: global batch = ``global_batch_size`` rows, micro-batch
``j`` = rows ``[j*m, (j+1)*m)``, DP replica ``d`` takes its contiguous slice of them.
The next step starts at the first sample not packed, which is what ``consumed_samples``
records, so a resume continues with the rows a straight run would have built.
"""

from __future__ import annotations

from collections.abc import Iterator

from mimotron.data.collate import slice_batch
from mimotron.data.packing import collate_packed, pack_rows
from mimotron.training.data_provider import Microbatch, MicrobatchProvider


class PackedMicrobatchProvider(MicrobatchProvider):
    """Builds this rank's slices of every micro-batch of a packed step.

    Constructed as :class:`~mimotron.training.data_provider.MicrobatchProvider`
    (``micro_batch_size`` counts rows).
    """

    def packed_step(self, start: int, num_microbatches: int
                    ) -> tuple[list[Microbatch], int, int]:
        """The step whose first sample is at ``start``.

        Returns:
            ``(micro-batches, next start, real tokens of the whole global batch)``.
        """
        rows, next_start = pack_rows(self.sample_at, start, num_microbatches * self.mbs,
                                     self.seq_length)
        real = sum(int(s["tokens"].numel()) for row in rows for s in row)
        span = self.span
        out: list[Microbatch] = []
        for j in range(num_microbatches):
            if span is None:
                out.append({})
                continue
            lo, hi = span
            mb_rows = rows[j * self.mbs + lo: j * self.mbs + hi]
            batch = collate_packed(mb_rows, self.seq_length, **self.collate_kwargs)
            out.append({name: slice_batch(batch, s - lo, e - lo)
                        for name, (s, e) in self.slices.items()})
        return out, next_start, real


class PackedTrainIterator(Iterator[list[Microbatch]]):
    """Endless packed steps from stream position ``start`` (resume = consumed samples).

    After each ``next``, ``step_samples`` is the number of stream samples that step
    consumed and ``step_real_tokens`` its non-padding tokens (the same on every rank).

    Args:
        provider: the packed provider.
        start: the first step's stream position.
        global_batch_size: rows per step.
    """

    def __init__(self, provider: PackedMicrobatchProvider, start: int,
                 global_batch_size: int) -> None:
        self.provider = provider
        self.position = start
        self.num_microbatches = global_batch_size // provider.mbs
        self.step_samples = 0
        self.step_real_tokens = 0

    def __next__(self) -> list[Microbatch]:
        mbs, nxt, real = self.provider.packed_step(self.position, self.num_microbatches)
        self.step_samples, self.step_real_tokens = nxt - self.position, real
        self.position = nxt
        return mbs
