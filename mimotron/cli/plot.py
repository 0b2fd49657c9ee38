"""``mimotron plot RUN_DIR [RUN_DIR ...]``: PNG figures from ``metrics.jsonl``.

Writes ``loss.png`` (train and eval loss), ``eval.png`` (eval metrics such as accuracy),
``lr.png`` (lr per module) and ``throughput.png`` (tokens/s and step time), one line per
run so several runs can be compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split a run's metrics file into train records and eval records."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass a run directory (log.dir) of a run")
    train, evals = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        (evals if "eval_loss" in rec else train).append(rec)
    return train, evals


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def run_plot(run_dirs: list[str], out: str | None) -> int:
    """Write the figures; exit 0, or 2 naming a missing metrics file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        runs = {Path(d).name or d: read_metrics(Path(d)) for d in run_dirs}
    except ValueError as exc:
        print(f"mimotron plot: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(out or run_dirs[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (train, evals) in runs.items():
        ax.plot(*_series(train, "loss"), label=f"{name} train")
        if evals:
            ax.plot(*_series(evals, "eval_loss"), "o--", label=f"{name} eval")
    ax.set(xlabel="iteration", ylabel="loss (per token)", yscale="log", title="Loss")
    written.append(_save(fig, ax, out_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (_, evals) in runs.items():
        keys = sorted({k for r in evals for k in r if k.startswith("eval_")
                       and k not in ("eval_loss", "eval_samples")})
        for key in keys:
            ax.plot(*_series(evals, key), "o-", label=f"{name} {key}")
    ax.set(xlabel="iteration", ylabel="value", title="Evaluation metrics", ylim=(0, 1.02))
    written.append(_save(fig, ax, out_dir / "eval.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (train, _) in runs.items():
        modules = sorted({m for r in train for m in r.get("lr", {})})
        for m in modules:
            its = [r["iteration"] for r in train if m in r.get("lr", {})]
            ax.plot(its, [r["lr"][m] for r in train if m in r.get("lr", {})],
                    label=f"{name} {m}")
    ax.set(xlabel="iteration", ylabel="learning rate", title="Learning rate per module")
    written.append(_save(fig, ax, out_dir / "lr.png"))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, (train, _) in runs.items():
        ax1.plot(*_series(train, "tokens_per_second"), label=name)
        its, times = _series(train, "step_time_s")
        ax2.plot(its, [t * 1e3 for t in times], label=name)
    ax1.set(xlabel="iteration", ylabel="tokens / s", title="Throughput")
    ax2.set(xlabel="iteration", ylabel="ms", title="Step time")
    ax2.legend(fontsize=8)
    written.append(_save(fig, ax1, out_dir / "throughput.png"))

    for path in written:
        print(f"wrote {path}")
    return 0


def _save(fig: Any, ax: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
