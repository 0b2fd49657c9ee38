"""Metrics sinks: ``metrics.jsonl`` (contract), the console, TensorBoard.

Only the logging rank (language module, DP 0, TP 0, last stage) constructs a writer, so
the file is written once per run, not once per rank.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


class MetricsWriter:
    """Writes one JSON object per logged iteration and per evaluation.

    Args:
        log_dir: run directory; ``metrics.jsonl`` goes there (truncated when a run starts
            from scratch, appended to on resume).
        total_iters: for the ETA and progress display.
        tensorboard: also write TensorBoard scalars under ``log_dir/tensorboard``.
        progress: print a progress line; a bar is drawn when stdout is a terminal.
        append: keep existing lines (resume).
    """

    def __init__(self, log_dir: Path, total_iters: int, tensorboard: bool = False,
                 progress: bool = True, append: bool = False) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a" if append else "w")
        self.total_iters = total_iters
        self.progress = progress
        self._tty = sys.stdout.isatty()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(log_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed at once so a crash keeps what was logged)."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = record["iteration"]
            for key, value in record.items():
                if isinstance(value, dict):
                    for sub, v in value.items():
                        self._tb.add_scalar(f"{key}/{sub}", v, step)
                elif isinstance(value, int | float) and key != "iteration" and not isinstance(
                        value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def console(self, record: dict[str, Any], elapsed_s: float) -> None:
        """One progress line per logged iteration."""
        if not self.progress:
            return
        it = record["iteration"]
        lrs = record.get("lr", {})
        lr = next(iter(lrs.values()), 0.0) if len(set(lrs.values())) <= 1 else max(lrs.values())
        eta = (self.total_iters - it) * record["step_time_s"]
        norm = record.get("grad_norm")
        line = (f"iter {it:>6}/{self.total_iters} | loss {record['loss']:.4f} | grad "
                f"{norm if norm is None else f'{norm:.3f}'} | lr {lr:.2e} | "
                f"{_fmt_count(record['tokens_per_second'])} tok/s | "
                f"{record['step_time_s'] * 1e3:.0f} ms/it | elapsed {_fmt_duration(elapsed_s)} | "
                f"ETA {_fmt_duration(eta)}")
        if record.get("skipped"):
            line += " | skipped"
        if self._tty:
            done = int(30 * it / max(self.total_iters, 1))
            line = f"[{'#' * done}{'.' * (30 - done)}] " + line
        print(line, flush=True)

    def eval_line(self, record: dict[str, Any]) -> None:
        if self.progress:
            extra = "".join(f" | {k} {v:.4f}" for k, v in record.items()
                            if k.startswith("eval_") and k != "eval_loss")
            print(f"eval @ iter {record['iteration']} | eval_loss {record['eval_loss']:.4f}"
                  f"{extra}", flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


class StepClock:
    """Wall time between consecutive logged iterations, for throughput."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        out, self._last = now - self._last, now
        return out
