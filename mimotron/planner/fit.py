"""Whether each rank's memory estimate fits one device, and the ranks that stand for all.

:func:`rank_classes` picks one rank per module stage: every rank of a stage holds the
same estimate (:func:`mimotron.estimate.memory.estimate_memory`), so a layout of any
size is judged from those ranks. :func:`fit_lines` is the verdict ``mimotron plan
--device-memory`` prints: every shown rank's estimated peak (the sum of its modules'
totals) against the device, and one summary line over every rank of the layout (how
many do not fit, the worst one); ``mimotron plan --auto``'s search checks the same
ranks against its memory limit.

The verdict is information, not a refusal: ``mimotron plan`` still exits 0 when a rank
does not fit (the estimate leaves out the allocator's fragmentation, the CUDA context
and the communication library's buffers; see docs/performance.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mimotron.parallel.layout import (
    Layout,
    format_skipped,
    is_colocated_pipeline,
    language_pipeline,
)


@dataclass(frozen=True)
class RankFit:
    """One rank's estimated peak against the device."""

    rank: int
    modules: list[str]
    total: int
    device: int

    @property
    def headroom(self) -> int:
        """Bytes left on the device at the peak; negative when it does not fit."""
        return self.device - self.total

    @property
    def fits(self) -> bool:
        return self.headroom >= 0


def rank_classes(layout: Layout) -> list[tuple[int, int]]:
    """``(representative rank, ranks like it)``: one per module stage (colocated: one, or
    one per language stage where the language model is pipelined).

    Every rank of a module's pipeline stage holds the same estimate (it depends on the
    module and the stage only), whatever its tensor, context, data or expert coordinate.
    """
    if is_colocated_pipeline(layout):
        return rank_classes(language_pipeline(layout))
    if layout.colocated:
        return [(0, layout.world_size)]
    out = []
    for placement in layout.modules.values():
        p = placement.parallel.pipeline
        out += [(placement.rank_at(pp=s), placement.size // p) for s in range(p)]
    return out


def fit_lines(layout: Layout, totals: Callable[[list[int]], dict[int, list[tuple[str, int]]]],
              device: int, shown: list[int], label: str = "") -> list[str]:
    """The verdict block of ``mimotron plan --device-memory``.

    Args:
        layout: the layout.
        totals: ranks -> per rank ``[(module, total bytes)]`` (the estimate).
        device: bytes of one device.
        shown: the ranks to list (every rank up to the rank map's limit).
        label: the size as the user wrote it, for the header.

    Returns:
        Lines: a header, one per shown rank, a skipped-ranks line where ranks are left
        out, and the summary over every rank.
    """
    classes = rank_classes(layout)
    wanted = sorted(set(shown) | {rank for rank, _ in classes})
    fits = {rank: RankFit(rank, [m for m, _ in items], sum(t for _, t in items), device)
            for rank, items in totals(wanted).items()}
    size = f"{label} ({_mib(device)} MiB)" if label else f"{_mib(device)} MiB"
    lines = [f"fit on a device of {size}; per rank, MiB:",
             f"{'rank':>4}  {'modules':<24} {'total':>10} {'headroom':>10}  verdict"]
    previous = -1
    for rank in shown:
        if rank > previous + 1:
            lines.append(format_skipped(rank - previous - 1))
        previous = rank
        f = fits[rank]
        verdict = "fits" if f.fits else "does not fit"
        lines.append(f"{rank:>4}  {', '.join(f.modules):<24} {_mib(f.total):>10} "
                     f"{_mib(f.headroom):>10}  {verdict}")
    if previous < layout.world_size - 1:
        lines.append(format_skipped(layout.world_size - 1 - previous))
    lines.append(_summary([(fits[rank], count) for rank, count in classes], layout.world_size))
    return lines


def _summary(classes: list[tuple[RankFit, int]], world_size: int) -> str:
    """One line: how many ranks do not fit and the worst (least headroom) rank."""
    worst = min(classes, key=lambda c: (c[0].headroom, c[0].rank))[0]
    short = sum(count for f, count in classes if not f.fits)
    where = f"rank {worst.rank} ({', '.join(worst.modules)})"
    if short == 0:
        return (f"fit: all {world_size:,} ranks fit; the tightest is {where}, "
                f"{_mib(worst.headroom)} MiB left of {_mib(worst.device)} MiB")
    return (f"fit: {short:,} of {world_size:,} ranks do not fit; the worst is {where}, "
            f"needing {_mib(worst.total)} MiB, {_mib(-worst.headroom)} MiB more than "
            "the device")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"
