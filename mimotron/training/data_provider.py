"""Per-rank micro-batches in one global sample order, whatever the layout.

Global batch ``k`` is the samples at stream positions ``[k*G, (k+1)*G)``; micro-batch
``j`` of it is ``[j*m, (j+1)*m)``; DP replica ``d`` of a module with DP degree ``D``
takes the contiguous slice ``[d*m/D, (d+1)*m/D)`` of each micro-batch. A rank builds
only the samples its modules need (the union of its modules' slices), collates once and
slices per module, so an encoder-only rank never tokenises text it does not use.

**Packed rows** (``data.packing``, :class:`PackedMicrobatchProvider`): the rows of a step
are packed from the global stream position ``start`` by
:func:`~mimotron.data.packing.pack_rows`, identically on every rank; the rules above then
hold with rows in place of samples (global batch = ``global_batch_size`` rows). The next
step starts at the first sample not packed, which is what ``consumed_samples`` records,
so a resume continues with the rows a straight run would have built. Where the task
knows its samples' token counts without loading them (LLaVA data, :func:`stream_lengths`)
the rows are decided from those counts alone and a rank loads only the samples of its
own rows, with the parts it loads: an encoder rank that never tokenises packs the same
rows as the language ranks and feeds each row's media in document order.

**Device placement.** Batches are collated on the host; :func:`microbatches_to_device`
(called by the step and by evaluation) moves them to the rank's device. On the CPU it
returns them as they are (zero copy). On an accelerator the copies are ``non_blocking``
from pinned memory: :class:`StepPrefetcher` (``data.num_workers > 0``) collates and pins
the next step on a background thread while the current step runs, so the step only
issues the asynchronous copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import accumulate
from typing import Any, NamedTuple

import torch

from mimotron.config.schema import MimoConfig
from mimotron.data.collate import Sample, collate
from mimotron.data.media_policy import DeferredMedia
from mimotron.data.packing import collate_packed, pack_lengths, pack_rows, sample_length
from mimotron.host_sync import HOST
from mimotron.parallel.layout import Layout
from mimotron.pipeline.edges import slice_range
from mimotron.runtime import pins_memory
from mimotron.training.balanced_batches import Balance, BalancedSplit

Microbatch = dict[str, dict[str, torch.Tensor]]
LengthsAt = Callable[[int, int], Sequence[int]]
"""``f(start, count) -> token counts`` of the stream's samples at those positions."""


class MicrobatchProvider:
    """Builds this rank's slices of every micro-batch of a step.

    Args:
        layout: module placement (gives this rank's modules and DP coordinates).
        rank: this global rank.
        micro_batch_size: the global micro-batch size.
        seq_length: padded sequence length.
        sample_at: ``f(position) -> sample dict`` over the global order.
        collate_kwargs: passed to ``collate`` (modality shapes).
        balance: what is dealt out by work instead of by position
            (:class:`~mimotron.training.balanced_batches.Balance`; ``None``: nothing).
        media: the second read of the media the first left out
            (:func:`media_reader`; ``None``: every sample read whole).
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, seq_length: int,
                 sample_at: Any, collate_kwargs: dict[str, Any] | None = None,
                 balance: Balance | None = None, media: MediaReader | None = None) -> None:
        self.media = media
        self.mbs = micro_batch_size
        self.seq_length = seq_length
        self.sample_at = sample_at
        self.collate_kwargs = collate_kwargs or {}
        self.slices: dict[str, tuple[int, int]] = {}
        for role in layout.roles(rank):
            dp = layout.modules[role.module].parallel.data
            self.slices[role.module] = slice_range(micro_batch_size, dp, role.dp)
        self.balanced = BalancedSplit(layout, rank, micro_batch_size, balance or Balance())

    @property
    def span(self) -> tuple[int, int] | None:
        """Union of this rank's module slices inside a micro-batch (the whole micro-batch
        where media are balanced: an item of any sample may be this rank's)."""
        if not self.slices:
            return None
        if self.balanced.encoders:
            return 0, self.mbs
        return min(s for s, _ in self.slices.values()), max(e for _, e in self.slices.values())

    def microbatch(self, start: int) -> Microbatch:
        """The micro-batch whose first sample is at global position ``start``."""
        return self.step(start, 1)[0]

    def step(self, start: int, num_microbatches: int) -> list[Microbatch]:
        """All micro-batches of the step whose first sample is at ``start``."""
        span = self.span
        if span is None:
            return [{} for _ in range(num_microbatches)]
        lo, _ = span
        read = self.balanced.reader(self.sample_at, start, num_microbatches, span)
        parts = [read(j) for j in range(num_microbatches)]
        batches = [collate(samples, self.seq_length, **self.collate_kwargs)
                   for _, samples in parts]
        deals = self.balanced.deal(batches)
        if self.media is not None:
            batches = [self._with_encoded_media(*part, batch, owners, lo)
                       for part, batch, owners in zip(parts, batches, deals, strict=True)]
        return [self.balanced.split(b, self.slices, lo, owners)
                for b, owners in zip(batches, deals, strict=True)]

    def _with_encoded_media(self, positions: list[int], samples: list[Sample], batch: Any,
                            owners: dict[str, list[int]], lo: int) -> Any:
        """``batch`` with the media this rank encodes decoded (a second read of their
        samples); the others stay zeros, which no module of this rank reads."""
        assert self.media is not None
        wanted = self.balanced.encoded_media(batch, self.slices, lo, owners,
                                             self.media.modalities)
        todo = {k: m for k, m in sorted(wanted.items())
                if any(samples[k].get(x) is None for x in m)}  # pads come whole
        if not todo:
            return batch
        loaded = self.media.load([positions[k] for k in todo], list(todo.values()))
        samples = list(samples)
        for (k, modalities), sample in zip(todo.items(), loaded, strict=True):
            samples[k] = {**samples[k], **{m: sample[m] for m in modalities}}
            if sample.get("media_failed"):  # as a whole read would: nothing of it trains
                samples[k]["loss_mask"] = torch.zeros_like(samples[k]["loss_mask"])
        return collate(samples, self.seq_length, **self.collate_kwargs)


def _map_tensors(microbatches: list[Microbatch], fn: Any) -> list[Microbatch]:
    return [{module: {key: fn(v) if isinstance(v, torch.Tensor) else v
                      for key, v in batch.items()}
             for module, batch in mb.items()} for mb in microbatches]


def pin_microbatches(microbatches: list[Microbatch], device: torch.device
                     ) -> list[Microbatch]:
    """Page-locked copies of host micro-batches bound for ``device`` (as-is on the CPU).

    Pinned memory is what lets :func:`microbatches_to_device` copy asynchronously; it is
    done on the host, so a loader thread can do it ahead of the step.
    """
    if not pins_memory(device):
        return microbatches
    return _map_tensors(microbatches, lambda t: t if t.is_pinned() else t.pin_memory())


def microbatches_to_device(microbatches: list[Microbatch], device: torch.device
                           ) -> list[Microbatch]:
    """The step's micro-batches on ``device``.

    On the CPU the same objects come back (no copy). Otherwise every tensor is copied
    with ``non_blocking=True`` when it is pinned (the copy overlaps the host's next
    work; the device stream orders it before the step's kernels), synchronously when
    not. A tensor already on ``device`` is not copied. Each placed batch keeps its host
    integer and boolean tensors under :data:`~mimotron.host_sync.HOST` (see
    :func:`~mimotron.host_sync.host_copy`).

    Args:
        microbatches: ``[{module: {key: tensor}}]`` as the providers build them.
        device: the rank's device (``runtime.device``).

    Returns:
        The micro-batches with every tensor on ``device``.
    """
    if device.type == "cpu":
        return microbatches
    pinned = pins_memory(device)
    placed = _map_tensors(microbatches,
                          lambda t: t.to(device, non_blocking=pinned and t.is_pinned()))
    for host_mb, mb in zip(microbatches, placed, strict=True):
        for module, batch in mb.items():
            _keep_host_copies(host_mb[module], batch)
    return placed


def _keep_host_copies(host: dict[str, Any], placed: dict[str, Any]) -> None:
    """Keep ``host``'s integer and boolean tensors under ``HOST`` in ``placed``.

    The model and the communicator count present samples and placeholders from them
    (:func:`~mimotron.host_sync.host_copy`) instead of reading the device copies back:
    no sync. References only, no copy; floating tensors (media) are left out, so their
    pinned buffers are not held for the step.
    """
    kept = {key: t for key, t in host.items() if isinstance(t, torch.Tensor)
            and t.device.type == "cpu" and not t.is_floating_point()}
    previous = host.get(HOST)  # a batch placed twice keeps its first host copies
    if isinstance(previous, dict):
        kept = {**kept, **previous}
    if kept:
        placed[HOST] = kept


class StepPrefetcher(Iterator[list[Microbatch]]):
    """Builds (collates and pins) step ``k + 1`` on a background thread during step ``k``.

    Wraps a step iterator (:func:`train_iterator` or :class:`PackedTrainIterator`); the
    steps and their order are the wrapped iterator's, which only this thread advances.
    ``step_samples`` / ``step_real_tokens`` (packed steps) describe the step last
    returned. The thread does host work only: no collective, no device op.

    Args:
        steps: the wrapped step iterator.
        device: the rank's device (pinning happens only for an accelerator).
    """

    def __init__(self, steps: Iterator[list[Microbatch]], device: torch.device) -> None:
        self._steps = steps
        self._device = device
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="step-prefetch")
        self._next: Future[tuple[list[Microbatch], dict[str, Any]]] | None = None

    def _load(self) -> tuple[list[Microbatch], dict[str, Any]]:
        microbatches = next(self._steps)
        counts = {k: getattr(self._steps, k) for k in ("step_samples", "step_real_tokens")
                  if hasattr(self._steps, k)}
        return pin_microbatches(microbatches, self._device), counts

    def __next__(self) -> list[Microbatch]:
        if self._pool is None:
            raise StopIteration
        future = self._next if self._next is not None else self._pool.submit(self._load)
        microbatches, counts = future.result()
        for key, value in counts.items():
            setattr(self, key, value)
        self._next = self._pool.submit(self._load)
        return microbatches

    def close(self) -> None:
        """Stop the thread (a step being built is finished and dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def train_iterator(provider: MicrobatchProvider, start: int, global_batch_size: int
                   ) -> Iterator[list[Microbatch]]:
    """Endless steps from global position ``start`` (resume = consumed samples)."""
    num_mb = global_batch_size // provider.mbs
    pos = start
    while True:
        yield provider.step(pos, num_mb)
        pos += global_batch_size


class PackedMicrobatchProvider(MicrobatchProvider):
    """Builds this rank's slices of every micro-batch of a packed step.

    Constructed as :class:`~mimotron.training.data_provider.MicrobatchProvider`
    (``micro_batch_size`` counts rows), plus:

    Args:
        lengths_at: the samples' token counts by stream position without loading them
            (:func:`stream_lengths`), or ``None``: the lengths are read from the loaded
            samples (every rank then loads every sample of the step).
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, seq_length: int,
                 sample_at: Any, collate_kwargs: dict[str, Any] | None = None,
                 lengths_at: LengthsAt | None = None, balance: Balance | None = None) -> None:
        super().__init__(layout, rank, micro_batch_size, seq_length, sample_at, collate_kwargs,
                         balance)
        self.lengths_at = lengths_at

    def packed_step(self, start: int, num_microbatches: int
                    ) -> tuple[list[Microbatch], int, int]:
        """The step whose first sample is at ``start``.

        Returns:
            ``(micro-batches, next start, real tokens of the whole global batch)``.
        """
        num_rows = num_microbatches * self.mbs
        rows_in: Callable[[int, int], list[list[Sample]]]
        if self.lengths_at is None:
            rows, next_start = pack_rows(self.sample_at, start, num_rows, self.seq_length)
            row_tokens = [sum(sample_length(s) for s in row) for row in rows]
            rows_in = lambda a, b: rows[a:b]  # noqa: E731
        else:
            lengths, next_start = pack_lengths(self.lengths_at, start, num_rows,
                                               self.seq_length)
            row_tokens = [sum(row) for row in lengths]
            rows_in = _RowLoader(self.sample_at, lengths, start).rows
        span = self.span
        if span is None:
            return [{} for _ in range(num_microbatches)], next_start, sum(row_tokens)
        lo, hi = span
        order = self.balanced.order(row_tokens, num_microbatches)
        if order is None:
            picked = [rows_in(j * self.mbs + lo, j * self.mbs + hi)
                      for j in range(num_microbatches)]
        else:  # rows dealt by tokens: the step's rows read at once, in stream order
            every = rows_in(0, num_rows)
            picked = [[every[r] for r in order[j * self.mbs + lo:j * self.mbs + hi]]
                      for j in range(num_microbatches)]
        batches = [collate_packed(rows, self.seq_length, **self.collate_kwargs)
                   for rows in picked]
        out = [self.balanced.split(b, self.slices, lo, owners)
               for b, owners in zip(batches, self.balanced.deal(batches), strict=True)]
        return out, next_start, sum(row_tokens)


class _RowLoader:
    """Loads rows ``[a, b)`` of a step packed from lengths: only their samples, in one read.

    Args:
        sample_at: ``f(start, count) -> samples`` over the global stream.
        lengths: the step's rows as token counts (:func:`~mimotron.data.packing.pack_lengths`).
        start: the stream position of row 0's first sample.
    """

    def __init__(self, sample_at: Any, lengths: list[list[int]], start: int) -> None:
        self.sample_at = sample_at
        self.sizes = [len(row) for row in lengths]
        # firsts[r]: stream position of row r's first sample (firsts[-1]: past the last).
        self.firsts = list(accumulate(self.sizes, initial=start))

    def rows(self, a: int, b: int) -> list[list[Sample]]:
        """Rows ``[a, b)``: consecutive stream positions, read at once and cut by row."""
        first, end = self.firsts[a], self.firsts[b]
        samples = list(self.sample_at(first, end - first)) if end > first else []
        out = [samples[self.firsts[r] - first:self.firsts[r + 1] - first] for r in range(a, b)]
        for row, size in zip(out, self.sizes[a:b], strict=True):
            assert len(row) == size, "the reader returned fewer samples than asked"
        return out


def stream_lengths(stream: Any) -> LengthsAt | None:
    """Token counts by stream position without loading, where the task knows them.

    A LLaVA task records every sample's length when it checks the file
    (:meth:`~mimotron.data.llava.LlavaTask.length_of`), on every rank, whatever parts the
    rank loads; packing then decides its rows from them and each rank loads only its own
    rows. The synthetic tasks have no such table (``None``): their samples are cheap and
    loaded whole on every rank.

    Args:
        stream: a :class:`~mimotron.data.digits.SampleStream` (``items`` and ``dataset``).

    Returns:
        ``f(start, count) -> [length, ...]``, or ``None``.
    """
    length_of = getattr(stream.dataset, "length_of", None)
    if length_of is None:
        return None

    def lengths(start: int, count: int) -> list[int]:
        return [length_of(index) for index, _ in stream.items(start, count)]

    return lengths


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


class MediaReader(NamedTuple):
    """The second read of a run whose first read left the encoded media out
    (:class:`~mimotron.data.media_policy.DeferredMedia`).

    Attributes:
        modalities: this rank's encoder module -> the modality it decodes.
        load: ``f(positions, parts) -> samples``: the samples at those positions with
            only those parts.
    """

    modalities: dict[str, str]
    load: Callable[[Sequence[int], Sequence[frozenset[str]]], list[Sample]]


def media_reader(cfg: MimoConfig, layout: Layout, rank: int, task: Any,
                 load: Callable[[Sequence[int], Sequence[frozenset[str]]], list[Sample]]
                 ) -> MediaReader | None:
    """The second read of ``rank``'s media, where the task defers them; else ``None``.

    Args:
        cfg: the run's config (the modules' modalities).
        layout: the placement (this rank's encoder stages).
        rank: this global rank.
        task: the task read (its ``parts_at`` says whether media are deferred).
        load: how the samples of positions are read with given parts.
    """
    policy = getattr(task, "parts_at", None)
    if not isinstance(policy, DeferredMedia):
        return None
    modalities = {r.module: str(cfg.modules[r.module].modality) for r in layout.roles(rank)
                  if cfg.modules[r.module].is_encoder and r.is_first_stage}
    return MediaReader({m: x for m, x in modalities.items() if x in policy.deferred}, load)


def padded_reader(task: Any, pad_sample: Any) -> Any:
    """``f(start, count)`` over a finite split in order; positions past the end are pads.

    A pad sample has ``index = -1`` and an all-zero loss mask, so evaluation batches can
    be full-sized (every rank in lock-step) without counting pads in any metric.
    """
    n = len(task)

    parts_at = getattr(task, "parts_at", None)  # what each position loads

    def read(start: int, count: int) -> list[dict[str, Any]]:
        # get_many batches the tones' STFT; validation samples are epoch 0.
        positions = range(start, min(start + count, n))
        parts = None if parts_at is None else {"parts": [parts_at(p) for p in positions]}
        real = task.get_many([(p, 0) for p in positions], **(parts or {}))
        return real + [pad_sample] * (count - len(real))

    return read


def make_pad_sample(task: Any) -> dict[str, Any]:
    """A copy of sample 0 that contributes nothing: no loss tokens, index -1."""
    s = dict(task.get(0))
    s["loss_mask"] = torch.zeros_like(s["loss_mask"])
    s["index"] = -1
    return s
