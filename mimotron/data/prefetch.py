"""Background loading of upcoming samples, in the global, layout-independent order.

A training step asks for the samples at global positions ``[start, start + count)``
(:meth:`~mimotron.data.digits.SampleStream.samples`); decoding their images on the spot
would stall the step. :class:`PrefetchingReader` answers the same requests with the same
samples, but loads them on worker threads ahead of time: after each request it predicts
the next ``depth`` ones (same count, the same stride as between the last two requests:
the micro-batch size for :class:`~mimotron.training.data_provider.MicrobatchProvider`)
and submits their samples. A request that was not predicted is loaded at once.

**Determinism.** Which ``(index, epoch)`` sits at a position is decided by the stream on
the calling thread; workers only call the task's ``get(index, epoch)``, a pure function.
So the sample at every position is the same with 0, 1 or 16 workers, in any layout.
Threads suffice: PIL decodes and resizes, and numpy/torch compute, without the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from mimotron.data.collate import Sample


class _Stream(Protocol):
    """What the reader needs: positions -> ``(index, epoch)``, and the task."""

    dataset: Any

    def items(self, start: int, count: int) -> list[tuple[int, int]]: ...

    def load(self, positions: Sequence[int], parts: Sequence[frozenset[str]]
             ) -> list[Sample]: ...


class PrefetchingReader:
    """``samples(start, count)`` over a stream, loading ahead on worker threads.

    Args:
        stream: a :class:`~mimotron.data.digits.SampleStream` (or anything with
            ``items(start, count)`` and a ``dataset`` with ``get(index, epoch)``).
        num_workers: loader threads; 0 loads synchronously on the calling thread.
        depth: requests predicted and loaded ahead (memory: ``depth`` requests' samples).

    Raises:
        ValueError: a negative ``num_workers`` or a ``depth`` below 1.

    Example:
        >>> reader = PrefetchingReader(task.stream(seed), num_workers=4)  # doctest: +SKIP
        >>> provider = MicrobatchProvider(..., reader.samples, ...)  # doctest: +SKIP
    """

    def __init__(self, stream: _Stream, num_workers: int, depth: int = 2) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} is invalid: expected an integer >= 0")
        if depth < 1:
            raise ValueError(f"depth={depth!r} is invalid: expected an integer >= 1")
        self.stream = stream
        self.num_workers = num_workers
        self.depth = depth
        self._pool = (ThreadPoolExecutor(num_workers, thread_name_prefix="prefetch")
                      if num_workers else None)  # fmt: skip
        self._pending: dict[int, Future[Sample]] = {}
        self._last_start: int | None = None
        self.wait_seconds = 0.0
        """Time spent waiting for samples that were not ready (a throughput diagnostic)."""

    def samples(self, start: int, count: int) -> list[Sample]:
        """The samples at global positions ``[start, start + count)``, in order.

        Raises:
            ValueError: what the task's ``get`` raises for one of these samples.
        """
        if self._pool is None:
            return [self.stream.dataset.get(i, e, **self._parts(p))
                    for p, (i, e) in enumerate(self.stream.items(start, count), start)]
        self._submit(start, count)
        began = time.perf_counter()
        try:
            out = [self._pending.pop(p).result() for p in range(start, start + count)]
        finally:
            self.wait_seconds += time.perf_counter() - began
        stride = start - self._last_start if self._last_start is not None else 0
        self._last_start = start
        stride = stride if stride > 0 else count
        self._forget_before(start + count)
        for k in range(1, self.depth + 1):
            self._submit(start + k * stride, count)
        return out

    def _submit(self, start: int, count: int) -> None:
        """Queue the positions of ``[start, start + count)`` not yet queued."""
        assert self._pool is not None
        todo = [p for p in range(start, start + count) if p not in self._pending]
        if not todo:
            return
        # Runs of consecutive positions share one items() call (the epoch permutation).
        items = self.stream.items(todo[0], todo[-1] - todo[0] + 1)
        for p in todo:
            index, epoch = items[p - todo[0]]
            self._pending[p] = self._pool.submit(self.stream.dataset.get, index, epoch,
                                                 **self._parts(p))

    def _parts(self, position: int) -> dict[str, frozenset[str]]:
        """``get``'s ``parts`` keyword for ``position`` where the task says what each
        position loads (``parts_at``); none otherwise."""
        parts_at = getattr(self.stream.dataset, "parts_at", None)
        return {} if parts_at is None else {"parts": parts_at(position)}

    def load(self, positions: Sequence[int], parts: Sequence[frozenset[str]]) -> list[Sample]:
        """The samples at ``positions`` with only ``parts`` each, on the workers where
        there are any (the stream's :meth:`~mimotron.data.digits.SampleStream.load`)."""
        if self._pool is None:
            return self.stream.load(positions, parts)
        items = [self.stream.items(p, 1)[0] for p in positions]
        futures = [self._pool.submit(self.stream.dataset.get, index, epoch, parts=q)
                   for (index, epoch), q in zip(items, parts, strict=True)]
        return [f.result() for f in futures]

    def _forget_before(self, position: int) -> None:
        """Drop predicted positions the reader has moved past (a wrong guess)."""
        for p in [p for p in self._pending if p < position]:
            self._pending.pop(p).cancel()

    def close(self) -> None:
        """Stop the workers; pending loads are cancelled."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> PrefetchingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

