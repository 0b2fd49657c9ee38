"""``mimotron plot RUN_DIR [RUN_DIR ...]``: PNG figures from ``metrics.jsonl``.

Writes, into ``--out`` (default: the first run dir), one line per run so several runs
can be compared:

* ``loss.png`` — train loss (``loss``: the token-weighted mean over each log interval,
  not the logged iteration's ``loss_last``) and eval loss (log scale);
* ``eval.png`` — evaluation task metrics (``eval_accuracy`` ...);
* ``lr.png`` — learning rate per module;
* ``throughput.png`` — tokens/s, step time and, when recorded, model TFLOP/s per rank.

Runs are labelled by their directory name (made unique with the parent directory when
two runs share a name).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from mimotron.outputs import EXIT_FAILED, EXIT_USAGE, check_output_dir, report_error
from mimotron.run_files import replacing
from mimotron.training.metrics_file import METRICS_FILE, read_metrics_file

Records = list[dict[str, Any]]


def read_metrics(run_dir: Path) -> tuple[Records, Records]:
    """Split a run's metrics file into train records and eval records.

    A torn final line (a run writing it right now, or one that crashed mid-write) is
    skipped with a note on stderr.

    Raises:
        ValueError: ``run_dir`` holds no ``metrics.jsonl``, it holds no records, or a
            line is not a record (:class:`MetricsFileError`, naming the file and line).
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: pass a run directory (log.dir) of a run")
    contents = read_metrics_file(path)
    if contents.torn_line is not None:
        print(f"mimotron plot: skipped the torn last line (line {contents.torn_line}) of "
              f"{path}: a write in progress or interrupted", file=sys.stderr)
    if not contents.records:
        raise ValueError(f"no metrics in {path}: the run has not logged an iteration yet")
    train, evals = [], []
    for rec in contents.records:
        (evals if "eval_loss" in rec else train).append(rec)
    return train, evals


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of ``key``, skipping missing and non-finite values."""
    return _points([(r["iteration"], r.get(key)) for r in records])


def _points(pairs: list[tuple[int, Any]]) -> tuple[list[int], list[float]]:
    """The pairs whose value is a finite number (``null`` is how non-finite is written)."""
    pts = [(it, float(v)) for it, v in pairs
           if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]
    return [p[0] for p in pts], [p[1] for p in pts]


def run_labels(run_dirs: list[str]) -> list[str]:
    """A distinct label per run: the directory name, or ``parent/name`` when they clash."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    labels = [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name
              for p in paths]
    # Still equal (same dir given twice, or equal parents too): number them.
    return [f"{lab} ({i})" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def run_plot(run_dirs: list[str], out: str | None) -> int:
    """Write the figures; exit 0, 2 naming a missing, empty or damaged metrics file (or
    an output folder that cannot be made), 1 on any other failure (one line; the
    traceback too when ``MIMOTRON_DEBUG=1``).
    """
    try:
        return _plot(run_dirs, out)
    except ValueError as exc:
        return report_error("plot", exc, EXIT_USAGE, show_type=False)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback (see report_error)
        return report_error("plot", exc, EXIT_FAILED)


def _plot(run_dirs: list[str], out: str | None) -> int:
    import matplotlib

    matplotlib.use("Agg")

    runs = {label: read_metrics(Path(d))
            for label, d in zip(run_labels(run_dirs), run_dirs, strict=True)}
    out_dir = Path(out or run_dirs[0])
    check_output_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [_plot_loss(runs, out_dir / "loss.png"), _plot_eval(runs, out_dir / "eval.png"),
               _plot_lr(runs, out_dir / "lr.png"),
               _plot_throughput(runs, out_dir / "throughput.png")]
    for path in written:
        print(f"wrote {path}")
    return 0


def _plot_loss(runs: dict[str, tuple[Records, Records]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (train, evals) in runs.items():
        # "loss" is the interval mean: smooth at any log.interval (loss_last is noisy).
        (line,) = ax.plot(*_series(train, "loss"), label=f"{name} train (interval mean)")
        if evals:
            ax.plot(*_series(evals, "eval_loss"), "o--", color=line.get_color(),
                    label=f"{name} eval")
    ax.set(xlabel="iteration", ylabel="loss (per token)", yscale="log", title="Loss")
    return _save(fig, [ax], path)


def _plot_eval(runs: dict[str, tuple[Records, Records]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (_, evals) in runs.items():
        keys = sorted({k for r in evals for k in r if k.startswith("eval_")
                       and k not in ("eval_loss", "eval_samples")})
        for key in keys:
            ax.plot(*_series(evals, key), "o-", label=f"{name} {key}")
    ax.set(xlabel="iteration", ylabel="value", title="Evaluation metrics", ylim=(0, 1.02))
    return _save(fig, [ax], path)


def _plot_lr(runs: dict[str, tuple[Records, Records]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ("-", "--", ":", "-.")  # Modules often share a schedule: keep both visible.
    for name, (train, _) in runs.items():
        for i, m in enumerate(sorted({m for r in train for m in _lr(r)})):
            pts = _points([(r["iteration"], _lr(r)[m]) for r in train if m in _lr(r)])
            ax.plot(*pts, styles[i % len(styles)], label=f"{name} {m}")
    ax.set(xlabel="iteration", ylabel="learning rate", title="Learning rate per module")
    return _save(fig, [ax], path)


def _lr(record: dict[str, Any]) -> dict[str, Any]:
    """A record's ``lr`` object (module -> value); empty when absent or malformed."""
    lr = record.get("lr")
    return lr if isinstance(lr, dict) else {}


def _plot_throughput(runs: dict[str, tuple[Records, Records]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    has_flops = any(_series(train, "tflops_per_second_per_rank")[0]
                    for train, _ in runs.values())
    fig, axes = plt.subplots(1, 3 if has_flops else 2, figsize=(15 if has_flops else 11, 4))
    for name, (train, _) in runs.items():
        axes[0].plot(*_series(train, "tokens_per_second"), label=name)
        its, times = _series(train, "step_time_s")
        axes[1].plot(its, [t * 1e3 for t in times], label=name)
        if has_flops:
            axes[2].plot(*_series(train, "tflops_per_second_per_rank"), label=name)
    axes[0].set(xlabel="iteration", ylabel="tokens / s", title="Throughput")
    axes[1].set(xlabel="iteration", ylabel="ms", title="Step time")
    if has_flops:
        axes[2].set(xlabel="iteration", ylabel="TFLOP/s", title="Model TFLOP/s per rank")
    return _save(fig, list(axes), path)


def _save(fig: Any, axes: list[Any], path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with replacing(path) as tmp:  # A fresh file: never written through a link.
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
