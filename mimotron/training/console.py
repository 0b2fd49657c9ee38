"""The console's progress display: per-module learning rates and the live line.

**Learning rates.** The progress line shows one ``lr`` when every module's schedule
gives the same value, and one per module, in config order, when they differ, by short
name (``lr v 1.0e-3 | a 1.0e-3 | lm 2.0e-5``): ``lm`` for the language model, the
shortest unambiguous prefix for the others (:func:`short_names`).

**The live line.** On a terminal, :class:`LiveLine` redraws one line in place every
iteration (bar, iteration, loss, step time, ETA) with a carriage return, and clears it
before any full line is printed, so the record lines of each log interval scroll as
before. Off a terminal (a log file, a pipe) it writes nothing: logs keep exactly one
line per log interval. The line ends with ``"\\r"`` rather than starting with it, so a
line-buffering stream (:class:`~mimotron.cli.lines.LineWriter`) can write it at once.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import TextIO

from mimotron.names import LANGUAGE

BAR_WIDTH = 30
"""Characters of the progress bar (``[####......]``)."""
_SAME_LR_RTOL = 1e-9  # schedules that agree to rounding show one value


def fmt_duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s``: a duration for the ETA and elapsed columns."""
    seconds = max(0, int(seconds)) if math.isfinite(seconds) else 0
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_bar(iteration: int, total: int) -> str:
    """``[#####.........]``: ``iteration`` of ``total`` in :data:`BAR_WIDTH` characters."""
    done = min(BAR_WIDTH, int(BAR_WIDTH * iteration / max(total, 1)))
    return f"[{'#' * done}{'.' * (BAR_WIDTH - done)}]"


def short_names(names: Iterable[str]) -> dict[str, str]:
    """A short, unambiguous label per module: ``lm`` for the language model, else the
    shortest prefix no other module shares (``vision`` -> ``v``, ``audio`` -> ``a``)."""
    names = list(dict.fromkeys(names))
    out = {}
    for name in names:
        if name == LANGUAGE:
            out[name] = "lm"
            continue
        others = [n for n in names if n != name] + ["lm"]
        size = next((k for k in range(1, len(name)) if not any(
            o.startswith(name[:k]) for o in others)), len(name))
        out[name] = name[:size]
    return out


def compact_float(value: float) -> str:
    """``1.0e-3`` (``1.0e-03`` without the exponent's padding zero)."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{value:.1e}")


def format_lrs(lrs: Mapping[str, float], order: Sequence[str] = ()) -> str:
    """``lr 1.00e-03`` when the modules agree, ``lr v 1.0e-3 | a 1.0e-3 | lm 2.0e-5``
    when they differ.

    Args:
        lrs: module -> learning rate (a record's ``lr``).
        order: the modules' display order (the config's); others follow in ``lrs`` order.
    """
    lrs = {m: lrs[m] for m in [*order, *lrs] if m in lrs}
    values = list(lrs.values())
    if not values:
        return "lr -"
    first = values[0]
    if all(math.isclose(v, first, rel_tol=_SAME_LR_RTOL, abs_tol=0.0) for v in values):
        return f"lr {first:.2e}"
    labels = short_names(lrs)
    return "lr " + " | ".join(f"{labels[m]} {compact_float(v)}" for m, v in lrs.items())


class LiveLine:
    """The line a terminal redraws every iteration (rules in the module docstring).

    Args:
        total_iters: the run's last iteration (bar and ETA).
        stream: where to write; ``None``: ``sys.stdout`` at each write (a test's capture
            or a replaced stream is honoured).
    """

    def __init__(self, total_iters: int, stream: TextIO | None = None) -> None:
        self.total_iters = total_iters
        self._stream = stream
        self._width = 0  # characters of the line on screen; 0: none

    @property
    def stream(self) -> TextIO:
        """The stream written to."""
        return self._stream if self._stream is not None else sys.stdout

    def is_terminal(self) -> bool:
        """Whether the stream is a terminal (the live line is drawn only there)."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def update(self, iteration: int, loss: float, step_time_s: float) -> None:
        """Redraw the line for ``iteration`` (nothing off a terminal).

        Args:
            iteration: the iteration just finished.
            loss: its loss.
            step_time_s: the current estimate of seconds per iteration (for the ETA).
        """
        if not self.is_terminal():
            return
        eta = (self.total_iters - iteration) * step_time_s
        text = (f"{progress_bar(iteration, self.total_iters)} iter {iteration:>6}/"
                f"{self.total_iters} | loss {loss:.4f} | {step_time_s * 1e3:.0f} ms/it | "
                f"ETA {fmt_duration(eta)}")
        # Padded over a longer previous line; "\r" last: the cursor waits at its start.
        self.stream.write(text.ljust(self._width) + "\r")
        self.stream.flush()
        self._width = len(text)

    def clear(self) -> None:
        """Blank the live line if one is drawn, so the next full line starts clean."""
        if self._width:
            self.stream.write(" " * self._width + "\r")
            self.stream.flush()
            self._width = 0
