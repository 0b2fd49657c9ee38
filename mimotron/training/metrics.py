"""Metrics: what the loop measures, and its sinks (``metrics.jsonl``, console, TensorBoard).

:class:`LoopMonitor` is everything ``train_mimo`` measures. At each logged iteration
every rank joins one ``all_gather_object`` (the same iterations on every rank, so the
collective order is fixed) carrying its timers, per-module times, peak memory, lr per
module, encoder sample counts and auxiliary losses; the logging rank (language module,
DP 0, TP 0, last stage) turns them into one record and is the only writer, so
``metrics.jsonl`` is written once per run, not once per rank.

A train record holds the contract fields of docs/operations.md ("Metrics, console, profiling"):
``iteration``, ``loss`` (the token-weighted mean over the iterations since the previous
record, see :mod:`mimotron.training.interval`), ``grad_norm``, ``lr`` {module: lr},
``loss_scale``, ``skipped``, ``num_zeros``, ``consumed_samples``, ``tokens_per_second``
= ``global_batch_size · seq_length / step_time_s``, ``step_time_s`` = wall time per
iteration over the log interval, with evaluation excluded. And more:
``loss_scale_per_module``, ``samples_per_second``, ``loss_last`` (the logged iteration's
own loss), ``train_accuracy`` (interval mean) and ``train_accuracy_last``, auxiliary
losses by name (interval mean, and ``<name>_last``), ``interval_iters`` /
``interval_skipped_iters`` (iterations the record covers / left out of its means),
``skipped_iters`` / ``nan_iters`` (run totals), ``skipped_samples`` (bad samples the
dataset left out, only for a dataset that checks them: ``llava``), ``peak_memory_bytes``
(max over ranks) and ``peak_memory_bytes_per_rank``, ``model_flops_per_iteration`` and
``model_flops_per_module`` (:mod:`mimotron.estimate.flops`),
``hardware_flops_per_iteration`` (model FLOPs plus what full recompute runs again,
:mod:`mimotron.estimate.hardware_flops`), ``tflops_per_second_per_rank``, ``mfu`` and
``hfu`` (only where the device's peak is known),
``time_s`` (the step's timers) and ``module_time_s`` {module: {forward, backward,
communication}} — seconds per iteration, the max over the ranks holding the module (see
:mod:`mimotron.training.profiling` for what they cover). An MoE language model adds
``moe_aux_loss``, ``moe_z_loss`` (when on), per-layer ``moe_load_min`` / ``moe_load_max`` /
``moe_load_cv`` and ``moe_dropped_tokens`` (:mod:`mimotron.training.moe_metrics`).
``real_tokens_per_second`` counts only non-padding tokens and ``padding_fraction`` is the
share of padding positions in the logged iterations (packed or not, ``data.packing``).

**Auxiliary losses.** A forward step may return extra metrics beside ``correct`` and
``samples``: a 2-element tensor ``[sum, count]`` is logged as the global sum over the
count (Megatron-Bridge's convention); a scalar is logged as its global sum over the step.
Both are averaged over the log interval like the loss.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from mimotron.data.packing import real_tokens
from mimotron.estimate.flops import model_flops_per_iteration
from mimotron.estimate.hardware_flops import recompute_flops_per_iteration
from mimotron.host_sync import host_copy
from mimotron.models.attention import attention_kernel
from mimotron.models.attention.documents import Documents
from mimotron.names import LANGUAGE
from mimotron.run_files import open_text, write_error
from mimotron.runtime import compute_dtype, device_peak_flops, peak_memory_bytes
from mimotron.training.console import LiveLine, fmt_duration, format_lrs, progress_bar
from mimotron.training.infra import MimoModelInfra
from mimotron.training.interval import LAST, IntervalMeans, aux_value
from mimotron.training.metrics_file import (
    METRICS_FILE,
    encode_record,
    read_metrics_file,
    rewrite_records,
)
from mimotron.training.moe_metrics import add_moe_sums, local_moe_sums, moe_record
from mimotron.training.profiling import ModuleTimes
from mimotron.training.state import GlobalState, TrainState
from mimotron.training.step import module_parts
from mimotron.training.tensorboard_sink import TENSORBOARD_DIR, TensorBoardSink

# The language ranks' count of non-padding tokens, beside the encoders' sample counts.
REAL_TOKENS = "__real_tokens__"
ATTENTION_PAIRS = "__attention_pairs__"

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer
    from mimotron.training.wandb_sink import WandbSink


def _fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _scalars(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    """Flatten nested dicts of numbers into ``a/b/c`` TensorBoard tags."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _scalars(f"{prefix}/{k}" if prefix else str(k), v)
    elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        yield prefix, float(value)



def attention_pairs(batch: dict[str, Any]) -> int:
    """The (query, key) pairs the language model's attention computes over a batch:
    each packed document's square and each padding run's (the segments the attention
    runs, read from the host copy of ``doc_ids``: no device sync), or ``rows x S²``."""
    if "doc_ids" in batch:
        return Documents.from_doc_ids(host_copy(batch, "doc_ids")).attention_pairs
    rows, seq = batch["tokens"].shape[:2]
    return rows * seq * seq

class TrainingDivergedError(RuntimeError):
    """Too many consecutive iterations had non-finite gradients (raised on every rank)."""


def check_divergence(ts: TrainState, loss: float, max_skipped: int,
                     precision: str = "fp32") -> None:
    """Stop after ``max_skipped`` consecutive skipped iterations, with a clear message.

    ``ts`` is identical on every rank (skips are a world decision), so every rank raises
    at the same iteration and no rank waits on a collective the others left. The advice
    follows the cause: a non-finite loss means the model diverged (lower the lr); a
    finite loss under fp16 means the scaled gradients overflow (the scale is still coming
    down from its start, or even its minimum is too high), which no lr fixes (change the
    precision or the loss-scale settings).

    Args:
        ts: the run's train state.
        loss: the last iteration's loss.
        max_skipped: ``train.max_skipped``.
        precision: ``train.precision``.

    Raises:
        TrainingDivergedError: ``ts.consecutive_skips >= max_skipped``.
    """
    if ts.consecutive_skips < max_skipped:
        return
    what = (f"training diverged at iteration {ts.iteration}: {ts.consecutive_skips} "
            f"consecutive iterations had non-finite gradients and were skipped (last loss "
            f"{loss}, {ts.nan_iters} iterations with a non-finite loss in all); stopping "
            f"because train.max_skipped={max_skipped}. ")
    if not math.isfinite(loss):
        advice = ("The loss itself is non-finite: lower optimizer.lr (or warm up longer), "
                  "lower optimizer.clip_grad, or check the data"
                  + (", or use precision bf16 or fp32 instead of fp16"
                     if precision == "fp16" else ""))
    elif precision == "fp16":
        # Each skip halves the scale (after hysteresis): either it is still coming down
        # from a too-high start, or the gradients overflow fp16 even at its minimum.
        advice = ("The loss is finite, so the scaled fp16 gradients overflow: a loss scale "
                  "problem, not divergence (a lower lr will not help). Use train.precision "
                  "bf16 or fp32, or start from a lower optimizer.initial_loss_scale, allow "
                  "a lower optimizer.min_loss_scale, or raise train.max_skipped so the "
                  "scale can come down")
    else:
        advice = ("The loss is finite but the gradients are not: lower optimizer.lr or "
                  "optimizer.clip_grad, or check the data and the forward step")
    raise TrainingDivergedError(what + advice)


class MetricsWriter:
    """Writes one JSON object per logged iteration and per evaluation; prints them.

    Args:
        log_dir: run directory; ``metrics.jsonl`` goes there (truncated when a run starts
            from scratch, appended to on resume). Non-finite numbers are written as
            ``null`` (see :mod:`mimotron.training.metrics_file`). Never opened through
            a link (:mod:`mimotron.run_files`).
        total_iters: for the ETA and progress display.
        tensorboard: also write TensorBoard scalars under ``log_dir/tensorboard``; a
            write that fails mid-run is one line and the run goes on without them
            (:mod:`mimotron.training.tensorboard_sink`).
        progress: print to the console (banner, a line per log interval, summary); on a
            terminal a progress bar, and a live line redrawn every iteration
            (:class:`~mimotron.training.console.LiveLine`).
        append: keep existing lines (resume); a torn last line is dropped (and said).
        resumed_at: on resume, the checkpoint's iteration: lines logged after it (by a run
            that went on past its last checkpoint before it stopped) are dropped, so each
            iteration appears once.
        stream: the console; ``None``: ``sys.stdout`` when written to.
        wandb: a wandb run that gets every record too (``log.wandb``); closed with this.
        module_order: the order per-module learning rates are shown in (the config's).
    """

    def __init__(self, log_dir: Path, total_iters: int, tensorboard: bool = False,
                 progress: bool = True, append: bool = False, resumed_at: int | None = None,
                 stream: TextIO | None = None, wandb: WandbSink | None = None,
                 module_order: Sequence[str] = ()) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / METRICS_FILE
        # Opened first, so a link (or anything but a plain file) is refused before the
        # file is read or written through it; created empty when missing.
        self._file = open_text(self.path, "a" if append else "w")
        if append:
            try:
                rewritten = self._prepare_append(resumed_at)
            except BaseException:
                self._file.close()
                raise
            if rewritten:  # The open file is the one replaced: continue the new one.
                self._file.close()
                self._file = open_text(self.path, "a")
        self._write_failed = False
        self.total_iters = total_iters
        self.progress = progress
        self.live = LiveLine(total_iters, stream)
        self._tty = self.live.is_terminal()
        self._wandb = wandb
        self._module_order = tuple(module_order)
        self._tb = TensorBoardSink(log_dir / TENSORBOARD_DIR) if tensorboard else None

    def _prepare_append(self, resumed_at: int | None) -> bool:
        """Make the existing file safe to continue: whole records, up to ``resumed_at``.

        A torn final line (a crash mid-write, a full disk) is dropped with one line on
        stderr; lines after ``resumed_at`` (logged past the last checkpoint) are dropped
        so each iteration appears once; the file is rewritten (atomically) when anything
        changed or its last line lacks a newline, so the next record starts a fresh line.

        Returns:
            Whether the file was rewritten.

        Raises:
            MetricsFileError: any other damage (names the file and line).
        """
        contents = read_metrics_file(self.path)
        kept = [r for r in contents.records
                if resumed_at is None or r["iteration"] <= resumed_at]
        if contents.torn_line is not None:
            print(f"metrics: dropped the torn last line (line {contents.torn_line}) of "
                  f"{self.path}, left by an interrupted write (crash or full disk); the "
                  f"{len(contents.records)} complete lines before it are intact",
                  file=sys.stderr, flush=True)
        if contents.torn_line is not None or not contents.terminated \
                or len(kept) != len(contents.records):
            rewrite_records(self.path, kept)
            return True
        return False

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (flushed at once so a crash keeps what was logged).

        Raises:
            RunFileError: ``metrics.jsonl`` could not be written (a full disk; names it).
        """
        try:
            self._file.write(encode_record(record))  # Non-finite numbers become null.
            self._file.flush()
        except OSError as exc:
            self._write_failed = True
            raise write_error(self.path, exc) from None
        if self._tb is not None:
            scalars = _scalars("", {k: v for k, v in record.items() if k != "iteration"})
            if not self._tb.add_scalars(record["iteration"], scalars):
                self._tb = None  # It said why; metrics.jsonl goes on.
        if self._wandb is not None:
            self._wandb.log(record)

    def print(self, text: str) -> None:
        """Print ``text`` when console output is on (over the live line, if drawn)."""
        if self.progress:
            self.live.clear()
            print(text, file=self.live.stream, flush=True)

    def tick(self, iteration: int, loss: float, step_time_s: float) -> None:
        """Redraw the live line for an iteration that logs no record (terminal only)."""
        if self.progress and self._tty:
            self.live.update(iteration, loss, step_time_s)

    def console(self, record: dict[str, Any], elapsed_s: float) -> None:
        """One progress line per logged iteration (with a bar on a terminal)."""
        it = record["iteration"]
        eta = (self.total_iters - it) * record["step_time_s"]
        norm = record.get("grad_norm")
        line = (f"iter {it:>6}/{self.total_iters} | loss {record['loss']:.4f} | grad "
                f"{norm if norm is None else f'{norm:.3f}'} | "
                f"{format_lrs(record.get('lr', {}), self._module_order)} | "
                f"{_fmt_count(record['tokens_per_second'])} tok/s | "
                f"{record['step_time_s'] * 1e3:.0f} ms/it")
        if record.get("mfu") is not None:
            line += f" | MFU {100 * record['mfu']:.1f}%"
        line += f" | elapsed {fmt_duration(elapsed_s)} | ETA {fmt_duration(eta)}"
        if record.get("skipped"):
            line += " | skipped"
        if self._tty:
            line = f"{progress_bar(it, self.total_iters)} " + line
        self.print(line)

    def eval_line(self, record: dict[str, Any]) -> None:
        """One line per evaluation."""
        extra = "".join(f" | {k} {v:.4f}" for k, v in record.items()
                        if k.startswith("eval_") and k not in ("eval_loss", "eval_samples"))
        self.print(f"eval @ iter {record['iteration']} | eval_loss {record['eval_loss']:.4f}"
                   f"{extra}")

    def close(self) -> None:
        """Close the file, the TensorBoard writer and the wandb run (idempotent).

        Raises:
            RunFileError: the file's last bytes could not be written (names it); not
                after a write that failed already (it said so, and the bytes are lost).
        """
        try:
            self._file.close()
        except OSError as exc:
            if not self._write_failed:
                raise write_error(self.path, exc) from None
        finally:
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                wandb, self._wandb = self._wandb, None
                wandb.close()


def _attention_line(cfg: Any, device: torch.device) -> str:
    """Which attention kernel the language model runs (mimotron.models.attention)."""

    planned = cfg.data.packing or cfg.modules[LANGUAGE].parallel.context > 1
    kernel = attention_kernel(device, compute_dtype(cfg.train.precision), planned)
    what = {"sdpa-causal": "causal SDPA (no mask)",
            "varlen": "variable-length flash attention per document/chunk (no mask)",
            "segments": "one SDPA per document/chunk (no mask)"}[kernel]
    return f"attention: {what}"


def format_banner(global_state: GlobalState, infra: MimoModelInfra,
                  params: dict[str, tuple[int, int]]) -> str:
    """The start-up banner: run, rank map, parameter counts, batch and outputs.

    Args:
        global_state: config, runtime, train state.
        infra: the layout.
        params: module -> (parameters, trainable parameters), whole module.

    Returns:
        The banner text (several lines).
    """
    cfg, rt, ts = global_state.cfg, global_state.runtime, global_state.train_state
    lines = [f"mimotron: run {cfg.name!r} on {rt.world_size} rank(s) ({rt.backend}, "
             f"{rt.device.type}), precision {cfg.train.precision}, iterations "
             f"{ts.iteration + 1}..{cfg.train.iters}",
             infra.layout.format_rank_map(), "",
             f"{'module':<10} {'kind':<9} {'parameters':>12} {'trainable':>12}"]
    for name, (total, trainable) in params.items():
        kind = cfg.modules[name].kind if name in cfg.modules else "?"
        lines.append(f"{name:<10} {kind:<9} {total:>12,} {trainable:>12,}")
    lines.append(f"{'total':<10} {'':<9} {sum(p[0] for p in params.values()):>12,} "
                 f"{sum(p[1] for p in params.values()):>12,}")
    lines.append(f"global batch {cfg.train.global_batch_size} = {cfg.num_microbatches} "
                 f"micro-batch(es) of {cfg.train.micro_batch_size}, seq length "
                 f"{cfg.data.seq_length}; log every {cfg.log.interval}, eval every "
                 f"{cfg.eval.interval}; metrics -> {cfg.log_dir / 'metrics.jsonl'}")
    lines.append(_attention_line(cfg, rt.device))
    if global_state.data_summary is not None:
        lines.extend(global_state.data_summary.lines())
    if cfg.data.num_workers:
        lines.append(f"data: training samples loaded ahead by {cfg.data.num_workers} "
                     "background worker(s)")
    if global_state.skipped_samples:
        lines.append(f"data: {global_state.skipped_samples} bad sample(s) of {cfg.data.path} "
                     "skipped (data.skip_bad_samples)")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any], metrics_path: Path | None = None) -> str:
    """The final summary table (see :meth:`LoopMonitor.finish` for the keys).

    Args:
        summary: the run summary.
        metrics_path: shown as the last row when given.

    Returns:
        The table text.
    """
    rows = [("iterations", f"{summary['iteration']}"),
            ("wall time", fmt_duration(summary["wall_time_s"])
             + f" ({summary['wall_time_s']:.1f} s)"),
            ("final loss", f"{summary.get('loss', float('nan')):.4f}")]
    rows += [(k, f"{v:.4f}") for k, v in summary.get("eval", {}).items() if k != "eval_samples"]
    if summary.get("tokens_per_second"):
        rows.append(("throughput", f"{_fmt_count(summary['tokens_per_second'])} tok/s, "
                     f"{summary['samples_per_second']:.1f} samples/s, "
                     f"{summary['step_time_s'] * 1e3:.0f} ms/it (mean)"))
    if summary.get("tflops_per_second_per_rank") is not None:
        mfu = summary.get("mfu")
        rows.append(("model TFLOP/s", f"{summary['tflops_per_second_per_rank']:.4g} per rank"
                     + ("" if mfu is None else f", MFU {100 * mfu:.1f}%")))
    if summary.get("peak_memory_bytes") is not None:
        rows.append(("peak memory", f"{_mib(summary['peak_memory_bytes'])} (max over ranks)"))
    rows.append(("skipped / NaN", f"{summary['skipped_iters']} / {summary['nan_iters']}"))
    if metrics_path is not None:
        rows.append(("metrics", str(metrics_path)))
    width = max(len(k) for k, _ in rows)
    bar = "-" * (width + 2 + max(len(v) for _, v in rows))
    return "\n".join(["summary", bar, *(f"{k:<{width}}  {v}" for k, v in rows), bar])


class LoopMonitor:
    """What ``train_mimo`` measures: logs records, prints, summarises.

    Construct it on every rank before the first step (it installs the per-module timing
    hooks of :class:`~mimotron.training.profiling.ModuleTimes`). The loop then calls it
    explicitly: :meth:`count_samples` with each step's data, :meth:`after_step` after
    every iteration with the step's auxiliary metrics and transport time (a collective
    on logged iterations), :meth:`excluded` around what is not step time, and
    :meth:`finish` at the end.

    Args:
        global_state: config, runtime, timers, train state.
        infra: layout and roles of this rank.
        model: the ``MimoModel`` (this rank's modules).
        optimizer: the ``MimoOptimizer`` (lr per module comes from its param groups).
    """

    def __init__(self, global_state: GlobalState, infra: MimoModelInfra, model: nn.Module,
                 optimizer: MimoOptimizer) -> None:
        cfg, ts = global_state.cfg, global_state.train_state
        self.state, self.infra, self.model, self.optimizer = global_state, infra, model, optimizer
        self.writer = None
        if infra.is_logging_rank:
            wandb = None
            if cfg.log.wandb:
                from mimotron.training.wandb_sink import WandbSink  # imports wandb: ~1 s

                wandb = WandbSink(cfg, resume=ts.iteration > 0)
            self.writer = MetricsWriter(cfg.log_dir, cfg.train.iters, cfg.log.tensorboard,
                                        cfg.log.progress, append=ts.iteration > 0,
                                        resumed_at=ts.iteration, wandb=wandb,
                                        module_order=list(cfg.modules))
        self.module_times = ModuleTimes(module_parts(model), global_state.runtime.device)
        self._counted = {r.module for r in infra.layout.roles(infra.rank)
                         if r.module != LANGUAGE and r.tp == 0 and r.cp == 0
                         and r.is_first_stage}
        # One language rank per DP replica (TP 0, first stage) counts its rows' tokens.
        lm_role = infra.roles.get(LANGUAGE)
        self._counts_tokens = (lm_role is not None and lm_role.tp == 0 and lm_role.cp == 0
                               and lm_role.is_first_stage)
        self._modality_of = {n: str(m.modality) for n, m in cfg.modules.items()
                             if m.is_encoder}
        self._counts: dict[str, Any] = defaultdict(float)  # Summed lazily (tensors).
        self._transfer_s = 0.0  # Transport time since the last record.
        self._interval = IntervalMeans()
        self._last_iter = ts.iteration
        self._interval_start = time.perf_counter()
        self._excluded_s = 0.0
        self._run = {"iters": 0, "step_s": 0.0, "flops": 0.0, "flops_iters": 0,
                     "real_tokens": 0.0}
        self._last: dict[str, Any] = {}
        self.start_time = time.monotonic()

    # ---- explicit measurements, called by the loop -----------------------------------------
    def count_samples(self, microbatches: list[dict[str, dict[str, Any]]]) -> None:
        """Add the step's samples each counted encoder sees (for the FLOPs of the record).

        A rank counts an encoder module when it holds its first stage at TP 0, CP 0, so
        every DP replica's slice is counted exactly once over the world. The counts stay
        tensors (summed lazily): no device synchronisation per step.
        """
        for mb in microbatches:
            for module in self._counted & set(mb):
                batch = mb[module]
                key = f"has_{self._modality_of[module]}"
                present = (batch[key].sum() if key in batch
                           else batch[self._modality_of[module]].shape[0])
                self._counts[module] = self._counts[module] + present
            if self._counts_tokens and LANGUAGE in mb:
                self._counts[REAL_TOKENS] = self._counts[REAL_TOKENS] + real_tokens(mb[LANGUAGE])
                self._counts[ATTENTION_PAIRS] += attention_pairs(mb[LANGUAGE])

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside (evaluation, checkpointing) does not count as step time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._excluded_s += time.perf_counter() - t0

    # ---- start-up -------------------------------------------------------------------------
    def banner(self) -> None:
        """Print the banner on the logging rank (collective: parameter counts)."""
        if not self.state.cfg.log.progress:
            return
        local: dict[str, tuple[int, int]] = {}
        for role in self.infra.layout.roles(self.infra.rank):
            part = module_parts(self.model).get(role.module)
            if part is not None and role.tp == 0 and role.cp == 0 and role.dp == 0:
                ps = list(part.parameters())
                local[role.module] = (sum(p.numel() for p in ps),
                                      sum(p.numel() for p in ps if p.requires_grad))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        params: dict[str, tuple[int, int]] = {}
        for name in self.state.cfg.modules:
            # Pipeline stages hold disjoint layers: their counts add up.
            items = [g[name] for g in gathered if name in g]
            params[name] = (sum(i[0] for i in items), sum(i[1] for i in items))
        if self.writer is not None:
            self.writer.print(format_banner(self.state, self.infra, params))

    # ---- per iteration --------------------------------------------------------------------
    def after_step(self, loss_dict: dict[str, float], skipped: bool, grad_norm: float | None,
                   num_zeros: int | None, aux: dict[str, torch.Tensor] | None = None,
                   transfer_s: float = 0.0) -> dict[str, Any] | None:
        """Record the step; log the iteration if it is due (a collective on every rank).

        Args:
            loss_dict: ``train_step_mimo``'s loss dictionary.
            skipped: whether the optimizer skipped the step.
            grad_norm: the global gradient norm (``None`` when skipped).
            num_zeros: zero gradient elements (``None`` unless counted).
            aux: the step's auxiliary metrics (``LanguageStep.pop_aux``); only the
                language loss leaders' count, so each replica contributes once.
            transfer_s: the step's transport seconds (``pop_transfer_seconds``),
                charged to every module this rank holds (each side of a transfer waits).

        Returns:
            The record written (the same on every rank), or ``None`` when the iteration
            is not logged.
        """
        cfg, ts = self.state.cfg, self.state.train_state
        self._interval.add(loss_dict, skipped,
                           (aux or {}) if self.infra.is_loss_leader else {})
        self._transfer_s += transfer_s
        if ts.iteration % cfg.log.interval and ts.iteration != cfg.train.iters:
            if self.writer is not None:  # no collective: this rank's clock and loss
                done = max(ts.iteration - self._last_iter, 1)
                elapsed = time.perf_counter() - self._interval_start - self._excluded_s
                self.writer.tick(ts.iteration, loss_dict["loss"], elapsed / done)
            return None
        now = time.perf_counter()
        num_iters = max(ts.iteration - self._last_iter, 1)
        step_time = (now - self._interval_start - self._excluded_s) / num_iters
        self._interval_start, self._excluded_s, self._last_iter = now, 0.0, ts.iteration
        gathered = self._gather()
        record: dict[str, Any] = {
            "iteration": ts.iteration, **self._interval.record(), "grad_norm": grad_norm,
            "lr": gathered["lr"], "loss_scale": float(self.optimizer.get_loss_scale()),
            "loss_scale_per_module": gathered["loss_scale"],
            "skipped": bool(skipped), "num_zeros": num_zeros,
            "consumed_samples": ts.consumed_samples,
            "tokens_per_second": cfg.train.global_batch_size * cfg.data.seq_length / step_time,
            "step_time_s": step_time,
            "samples_per_second": cfg.train.global_batch_size / step_time,
        }
        counted = self._interval.counted
        self._interval.reset()
        aux, aux_last = gathered["aux"]
        for key in sorted(set(aux) | set(aux_last)):  # Never shadow a contract field.
            name = f"aux_{key}" if key in record or key + LAST in record else key
            record[name] = aux_value(aux[key], counted) if key in aux else None
            record[name + LAST] = aux_value(aux_last[key], 1) if key in aux_last else None
        record.update(moe_record(gathered["moe"], cfg.modules[LANGUAGE].moe_z_loss_coeff > 0))
        if self.state.skipped_samples is not None:  # Datasets that check their samples.
            record["skipped_samples"] = self.state.skipped_samples
        record.update(skipped_iters=ts.skipped_iters, nan_iters=ts.nan_iters,
                      peak_memory_bytes=max(gathered["peak"]),
                      peak_memory_bytes_per_rank=gathered["peak"])
        real = gathered["counts"].pop(REAL_TOKENS, 0.0) / num_iters
        record["real_tokens_per_second"] = real / step_time
        record["padding_fraction"] = 1.0 - real / (cfg.train.global_batch_size
                                                   * cfg.data.seq_length)
        record.update(self._flops(gathered["vocab"], gathered["counts"], num_iters, step_time))
        record["time_s"] = {k: v / num_iters for k, v in gathered["timers"].items()}
        record["module_time_s"] = {m: {k: v / num_iters for k, v in t.items()}
                                   for m, t in gathered["modules"].items()}
        self._run["iters"] += num_iters
        self._run["real_tokens"] += real * num_iters
        self._run["step_s"] += step_time * num_iters
        self._last = record
        if self.writer is not None:
            self.writer.write(record)
            self.writer.console(record, time.monotonic() - self.start_time)
        return record

    def _gather(self) -> dict[str, Any]:
        """One world all-gather of this interval's per-rank measurements."""
        rt = self.state.runtime
        lrs: dict[str, float] = {}
        for group in self.optimizer.param_groups:
            lrs.setdefault(group.get("module", "model"), float(group["lr"]))
        scales = {name: float(info.loss_scaler.scale)
                  for name, info in self.optimizer.module_infos.items()
                  if info.is_active}
        lm = self.model.language_model
        modules = self.module_times.pop()
        for m in self.infra.module_names:
            modules.setdefault(m, {"forward": 0.0, "backward": 0.0})["communication"] = \
                self._transfer_s
        self._transfer_s = 0.0
        aux = self._interval.aux_sums()
        role = self.infra.roles.get(LANGUAGE)
        moe = local_moe_sums(lm, role is not None and role.tp == 0)
        local = {"peak": peak_memory_bytes(rt.device), "lr": lrs, "loss_scale": scales,
                 "modules": modules, "timers": self.state.timers.pop_all(),
                 "counts": {m: float(c) for m, c in self._counts.items()}, "aux": aux,
                 "moe": moe, "vocab": getattr(lm, "vocab_size", None)}
        self._counts.clear()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return _combine(gathered)

    def _flops(self, vocab: int | None, counts: dict[str, float], num_iters: int,
               step_time: float) -> dict[str, Any]:
        """Model FLOPs of the iteration, TFLOP/s per rank and (when known) MFU."""
        if vocab is None:  # A language model that is not the built-in one: no count.
            return {}
        cfg, rt = self.state.cfg, self.state.runtime
        pairs = counts.pop(ATTENTION_PAIRS, None)
        samples = {m: c / num_iters for m, c in counts.items()}
        pairs = None if pairs is None else pairs / num_iters
        per_module = model_flops_per_iteration(cfg, vocab, samples, attention_pairs=pairs)
        flops = sum(per_module.values())
        hardware = flops + sum(recompute_flops_per_iteration(
            cfg, vocab, samples, attention_pairs=pairs).values())
        self.state.train_state.floating_point_operations_so_far += flops * num_iters
        self._run["flops"] += flops * num_iters
        self._run["flops_iters"] += num_iters
        out: dict[str, Any] = {"model_flops_per_iteration": flops,
                               "model_flops_per_module": per_module,
                               "hardware_flops_per_iteration": hardware,
                               "tflops_per_second_per_rank":
                                   flops / step_time / rt.world_size / 1e12}
        peak = device_peak_flops(rt.device, compute_dtype(cfg.train.precision))
        if peak:
            out["mfu"] = flops / step_time / (peak * rt.world_size)
            out["hfu"] = hardware / step_time / (peak * rt.world_size)
        return out

    # ---- the end --------------------------------------------------------------------------
    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Complete the summary, print the table (logging rank), close sinks and hooks.

        Adds ``wall_time_s``, ``skipped_iters``, ``nan_iters``, ``tokens_per_second``,
        ``real_tokens_per_second`` (non-padding tokens),
        ``samples_per_second`` and ``step_time_s`` (means over the logged run),
        ``peak_memory_bytes`` (max over ranks at the last log), and
        ``tflops_per_second_per_rank`` / ``mfu`` when known.
        """
        cfg, ts, rt = self.state.cfg, self.state.train_state, self.state.runtime
        summary.update(iteration=ts.iteration, wall_time_s=time.monotonic() - self.start_time,
                       skipped_iters=ts.skipped_iters, nan_iters=ts.nan_iters,
                       peak_memory_bytes=self._last.get("peak_memory_bytes"))
        if self._run["iters"]:
            step = self._run["step_s"] / self._run["iters"]
            summary.update(step_time_s=step, samples_per_second=cfg.train.global_batch_size / step,
                           tokens_per_second=cfg.train.global_batch_size * cfg.data.seq_length
                           / step,
                           real_tokens_per_second=self._run["real_tokens"] / self._run["step_s"])
            if self._run["flops_iters"]:
                flops = self._run["flops"] / self._run["flops_iters"]
                summary["tflops_per_second_per_rank"] = flops / step / rt.world_size / 1e12
                if "mfu" in self._last:
                    peak = device_peak_flops(rt.device, compute_dtype(cfg.train.precision))
                    summary["mfu"] = flops / step / (peak * rt.world_size)
        self.close()
        if self.writer is not None:
            self.writer.print(format_summary(summary, self.writer.path))
        return summary

    def close(self) -> None:
        """Remove the hooks and close the writer (idempotent)."""
        self.module_times.remove()
        if self.writer is not None:
            self.writer.close()


def _combine(gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank measurements: max of times, sums of counts and auxiliary sums."""
    out: dict[str, Any] = {"peak": [g["peak"] for g in gathered], "lr": {}, "loss_scale": {},
                           "timers": {}, "modules": {}, "counts": defaultdict(float),
                           "aux": ({}, {}), "moe": {}, "vocab": None}
    for g in gathered:
        for m, lr in g["lr"].items():
            out["lr"][m] = max(out["lr"].get(m, lr), lr)
        out["loss_scale"].update(g["loss_scale"])
        out["vocab"] = out["vocab"] or g["vocab"]
        for k, v in g["timers"].items():
            out["timers"][k] = max(out["timers"].get(k, 0.0), v)
        for m, times in g["modules"].items():
            slot = out["modules"].setdefault(m, {})
            for k, v in times.items():
                slot[k] = max(slot.get(k, 0.0), v)
        for m, c in g["counts"].items():
            out["counts"][m] += c
        add_moe_sums(out["moe"], g.get("moe", {}))
        for sums, mine in zip(out["aux"], g["aux"], strict=True):
            for k, v in mine.items():
                acc = sums.setdefault(k, [0.0] * len(v))
                for i, x in enumerate(v):
                    acc[i] += x
    out["lr"] = dict(sorted(out["lr"].items()))
    out["loss_scale"] = dict(sorted(out["loss_scale"].items()))
    return out
