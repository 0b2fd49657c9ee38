"""``mimotron plan --auto --calibrate``: measure this machine's costs for the step-time model.

Without a calibration the planner's step-time model (:mod:`mimotron.planner.cost`)
prices compute and communication from a device's constants
(:mod:`mimotron.planner.devices`). A calibration replaces them with what the configured
model and the collectives actually cost on the machine the command runs on:

* **Modules.** Each module is built the way training builds it (the config's sizes and
  initialisation, ``freeze`` applied; tensor = 1, pipeline = 1, no recompute) and run on
  real micro-batches of the config's data (``train.micro_batch_size`` samples of
  ``data.seq_length``, the run's precision): after a warm-up, the median forward and
  backward seconds of ONE micro-batch. The language model's backward includes the
  gradients of the encoder embeddings it received, as on a pipelined rank. Torch uses
  the threads a training rank of a ``--world`` launch gets (``OMP_NUM_THREADS`` when
  set, else ``cpu_count // world``, as ``mimotron train``'s launcher sets it).
* **Collectives.** ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all`` on
  groups of 2, 4, ... ranks up to ``--world`` (and the world itself), and a one-way
  ``send``/``recv`` (``p2p``, between 2 ranks), over gloo on ranks forked as the test
  harness forks them (:func:`mimotron.forked_ranks.run_ranks`), each at a few buffer sizes.
  Time per call is the slowest rank's mean over back-to-back calls, median over rounds;
  ``latency + bytes / bandwidth`` is then fitted by least squares. The bytes are the
  largest buffer a rank holds in the call (all-reduce: the tensor; all-gather: the
  gathered output; reduce-scatter: the input; all-to-all: the send buffer; p2p: the
  message), the convention :class:`~mimotron.planner.calibration_data.Calibration` prices with.
* **Host cores**: the cores' worth of compute ``--world`` busy ranks of this host get
  together (:func:`measure_host_cores`: the same matmul loop on one rank alone, then on
  every rank at once; at most :func:`core_probe_ranks` ranks are forked: no more than
  the usable cores or 16, the figure scaled up to the world where that is fewer), at
  most the CPUs this process may run on (its affinity). On an
  idle machine that is the affinity's count; where other work shares the CPUs it is
  less, and that is what the ranks of a local launch share.

Measurements are CPU-only: the calibration names device ``"cpu"``.

The result is cached as ``<log.dir>/planner_calibration.json`` (the run's folder; a file
the run-directory rules of :mod:`mimotron.run_dir` never move) together with a
fingerprint of what was measured: module shapes, micro-batch, sequence length, data
mix, precision, threads, the group sizes and the host's cores. A cached file is reused
only when the fingerprint matches (:func:`calibrate_cached`); otherwise it is measured
again and replaced.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mimotron.config.limits import max_local_ranks, usable_cores
from mimotron.config.schema import MimoConfig
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.data import build_datasets, collate
from mimotron.data.run_data import build_tokenizer
from mimotron.forked_ranks import run_ranks
from mimotron.models.attention import document_args
from mimotron.models.build import build_mimo_model
from mimotron.models.language import language_loss
from mimotron.names import LANGUAGE
from mimotron.planner.calibration_data import (
    COLLECTIVES,
    Calibration,
    CalibrationRangeError,
    LinkCost,
)
from mimotron.run_files import write_atomic
from mimotron.training.model_setup import freeze_modules
from mimotron.training.precision import autocast_factory

CALIBRATION_FILE = "planner_calibration.json"
"""The cache's file name inside the run's log.dir."""
DEVICE = "cpu"
"""The :class:`~mimotron.planner.devices.DeviceSpec` a calibration refines."""
_UNMEASURED_FIELDS = ("parallel", "recompute", "recompute_num_layers", "optimizer")
"""Module fields that change the layout or the optimizer, not what one micro-batch
costs at tensor = 1, pipeline = 1 without recompute: the fingerprint leaves them out."""


@dataclass(frozen=True)
class CalibrationOptions:
    """How much to measure (the defaults are what ``--calibrate`` uses).

    Attributes:
        warmup: untimed micro-batches (modules) or calls (collectives) first.
        repeats: timed micro-batches per module (the median is kept); each repeat
            reads the next micro-batch of the data, so encoders see the usual mix of
            present samples.
        comm_rounds: timed rounds per collective and buffer size (median kept).
        comm_calls: back-to-back calls per round (their mean is one round's figure).
        core_rounds: rounds of the host-cores probe (:func:`measure_host_cores`).
        buffer_bytes: per-rank buffer sizes the collectives are measured at (the
            convention of :class:`~mimotron.planner.calibration_data.Calibration`).
    """

    warmup: int = 2
    repeats: int = 7
    comm_rounds: int = 5
    comm_calls: int = 4
    core_rounds: int = 3
    buffer_bytes: tuple[int, ...] = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        for name in ("repeats", "comm_rounds", "comm_calls", "core_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration {name}={getattr(self, name)!r} is invalid: "
                                 "expected an integer >= 1")
        if self.warmup < 0:
            raise ValueError(f"calibration warmup={self.warmup!r} is invalid: expected >= 0")
        if len(set(self.buffer_bytes)) < 2 or min(self.buffer_bytes) < 8:
            raise ValueError(f"calibration buffer_bytes={self.buffer_bytes!r} is invalid: "
                             "expected at least 2 distinct sizes of >= 8 bytes")


def rank_threads(world_size: int) -> int:
    """Torch threads of one training rank of a local ``world_size``-rank launch."""
    if "OMP_NUM_THREADS" in os.environ:  # mimotron train keeps a user's setting
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return max(1, (os.cpu_count() or 1) // world_size)


def group_sizes(world_size: int, max_ranks: int | None = None) -> list[int]:
    """Collective group sizes to measure: 2, 4, 8, ... up to the world, and the world.

    Args:
        world_size: the world the plan is for.
        max_ranks: the most ranks this host may fork (default:
            :func:`~mimotron.config.limits.max_local_ranks`).
    """
    limit = min(world_size, max_ranks if max_ranks is not None else max_local_ranks())
    sizes, n = [], 2
    while n <= limit:
        sizes.append(n)
        n *= 2
    if limit >= 2 and limit not in sizes:
        sizes.append(limit)
    return sizes


def fingerprint(cfg: MimoConfig, world_size: int, options: CalibrationOptions) -> dict[str, Any]:
    """What a calibration of ``cfg`` measured; a cache is reused only when it is equal."""
    modules = {name: {k: v for k, v in dataclasses.asdict(mod).items()
                      if k not in _UNMEASURED_FIELDS}
               for name, mod in cfg.modules.items()}
    data = cfg.data
    return {
        "format": 2,  # 2: with module_fixed_seconds and the measured host cores
        "modules": modules,
        "data": {"dataset": data.dataset, "seq_length": data.seq_length, "path": data.path,
                 "packing": data.packing, "mix": [data.p_image, data.p_audio, data.p_both,
                                                  data.p_text]},
        "train": {"micro_batch_size": cfg.train.micro_batch_size,
                  "precision": cfg.train.precision, "seed": cfg.train.seed,
                  "fp32_residual_connection": cfg.train.fp32_residual_connection},
        "threads": rank_threads(world_size),
        "group_sizes": group_sizes(world_size),
        "buffer_bytes": list(options.buffer_bytes),
        "host_cores": usable_cores(),
        "torch": torch.__version__,
    }


def fingerprint_digest(measured: dict[str, Any]) -> str:
    """A short stable hash of :func:`fingerprint`'s dict."""
    text = json.dumps(measured, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- the cache ---------------------------------------------------------------------


def calibration_path(run_dir: str | Path) -> Path:
    """``<run_dir>/planner_calibration.json``."""
    return Path(run_dir) / CALIBRATION_FILE


def save_calibration(run_dir: str | Path, calibration: Calibration,
                     measured: dict[str, Any]) -> Path:
    """Write the calibration and its fingerprint into ``run_dir`` (created if needed).

    The file is replaced atomically: a reader never sees half of it.
    """
    path = calibration_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"fingerprint": fingerprint_digest(measured), "measured": measured,
           "calibration": json.loads(calibration.to_json())}
    # A fresh temporary file (never a planted name or link); a full disk names the file.
    write_atomic(path, json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    return path


def load_calibration(run_dir: str | Path, fingerprint: str | None = None
                     ) -> Calibration | None:
    """The calibration cached in ``run_dir``, or None.

    Args:
        run_dir: the run's log.dir.
        fingerprint: when given, a cached file measured for another fingerprint
            (:func:`fingerprint_digest`) is ignored (None is returned).

    Returns:
        None when there is no file, it is not a calibration (damaged, another format),
        or its fingerprint differs.

    Raises:
        ValueError: the file is this config's calibration but a value is out of range
            (NaN, infinite, negative, zero where a time or bandwidth must be positive):
            one line naming the file and the field. Nothing measures such a value; it
            would price a step at infinity (or not at all).
    """
    path = calibration_path(run_dir)
    try:
        doc = json.loads(path.read_text())
        if fingerprint is not None and doc.get("fingerprint") != fingerprint:
            return None
        return Calibration.from_json(json.dumps(doc["calibration"]))
    except CalibrationRangeError as exc:
        raise ValueError(f"calibration cache {path}: calibration.{exc}; delete the file "
                         "to measure again") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def calibrate_cached(cfg: MimoConfig, world_size: int,
                     options: CalibrationOptions | None = None, remeasure: bool = False,
                     log: Callable[[str], None] | None = None) -> tuple[Calibration, bool]:
    """The calibration cached in ``cfg``'s log.dir if it fits the config, else a new one.

    Args:
        cfg: the run config.
        world_size: the world the plan is for (threads per rank, group sizes).
        options: what to measure (default :class:`CalibrationOptions`).
        remeasure: measure even when the cache fits.
        log: called with one line per measurement stage (None: silent).

    Returns:
        ``(calibration, reused)``: ``reused`` is True when it came from the cache.

    Raises:
        ValueError: the cache fits the config but holds a value out of range
            (:func:`load_calibration`).
    """
    options = options or CalibrationOptions()
    measured = fingerprint(cfg, world_size, options)
    if not remeasure:
        cached = load_calibration(cfg.log_dir, fingerprint_digest(measured))
        if cached is not None:
            return cached, True
    calibration = calibrate(cfg, world_size, options, log)
    save_calibration(cfg.log_dir, calibration, measured)
    return calibration, False


def calibrate(cfg: MimoConfig, world_size: int, options: CalibrationOptions | None = None,
              log: Callable[[str], None] | None = None) -> Calibration:
    """Measure modules and collectives for ``cfg`` on a ``world_size``-rank plan.

    The collectives run first: their ranks are forked, and forking after this process
    ran multi-threaded work can hang the children.

    Raises:
        ValueError: ``world_size`` < 1 or an option out of range.
    """
    if world_size < 1:
        raise ValueError(f"--world={world_size!r} is invalid: expected an integer >= 1")
    options = options or CalibrationOptions()
    options.check()
    say = log or (lambda _line: None)
    sizes = group_sizes(world_size)
    say(f"calibrating collectives on gloo: groups of {sizes or 'none (one rank)'}, "
        f"buffers {list(options.buffer_bytes)} B")
    collectives = measure_collectives(sizes, options) if sizes else {}
    cores = (measure_host_cores(world_size, options.core_rounds) if world_size > 1
             else float(usable_cores()))
    say(f"{world_size} busy ranks got {cores:.2f} cores' worth of compute "
        f"({usable_cores()} usable)")
    threads = rank_threads(world_size)
    say(f"calibrating modules {list(cfg.modules)}: micro-batch "
        f"{cfg.train.micro_batch_size} x {cfg.data.seq_length}, {threads} thread(s)")
    modules, fixed = measure_modules(cfg, threads, options)
    return Calibration(device=DEVICE, module_seconds=modules, collectives=collectives,
                       host_cores=max(1, min(usable_cores(), round(cores))),
                       samples=cfg.train.micro_batch_size, module_fixed_seconds=fixed)


# ---- modules -----------------------------------------------------------------------


def _microbatches(cfg: MimoConfig, count: int, size: int
                  ) -> tuple[list[dict[str, torch.Tensor]], Any]:
    """``count`` micro-batches of ``size`` samples of the training data, in order; and
    the tokenizer."""
    tokenizer = build_tokenizer(cfg)
    task, _ = build_datasets(cfg, tokenizer)
    stream = task.stream(cfg.train.seed)
    kwargs = {"pad_id": task.pad_id, "image_shape": task.image_shape,
              "audio_shape": task.audio_shape}
    batches = [collate(stream.samples(i * size, size), cfg.data.seq_length, **kwargs)
               for i in range(count)]
    return batches, tokenizer


Seconds = dict[str, tuple[float, float]]


def measure_modules(cfg: MimoConfig, num_threads: int,
                    options: CalibrationOptions | None = None) -> tuple[Seconds, Seconds]:
    """Per module, the median ``(forward_s, backward_s)`` of one micro-batch (see the
    module docstring), and the part of it that does not scale with the samples.

    Micro-batches of the configured size and of a quarter of it alternate (so a slow
    spell of the host hits both); the fixed part is the intercept of the line through
    the two medians, within ``[0, the time]`` (zero at a micro-batch of 1). Torch runs
    ``num_threads`` threads meanwhile (restored after).

    Returns:
        ``(module_seconds, module_fixed_seconds)`` as :class:`Calibration` holds them.
    """
    options = options or CalibrationOptions()
    mbs = cfg.train.micro_batch_size
    small = max(1, mbs // 4)
    count = options.warmup + options.repeats
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batches, tokenizer = _microbatches(cfg, count, mbs)
        smalls = _microbatches(cfg, count, small)[0] if small < mbs else []
        placeholders = {n: tokenizer.placeholder_id(cfg.modules[n].modality)
                        for n in cfg.encoder_names}
        model = build_mimo_model(cfg, padded_vocab_size(tokenizer.vocab_size), placeholders)
        freeze_modules(model, cfg)
        autocast = autocast_factory(cfg.train.precision, torch.device("cpu"))
        full: dict[str, list[tuple[float, float]]] = {n: [] for n in cfg.modules}
        part: dict[str, list[tuple[float, float]]] = {n: [] for n in cfg.modules}
        for i in range(count):
            for times, group in ((full, batches), (part, smalls)):
                if not group:
                    continue
                for name, pair in _time_micro_batch(model, group[i], autocast).items():
                    if i >= options.warmup:
                        times[name].append(pair)
    finally:
        torch.set_num_threads(previous)
    seconds = {name: _medians(pairs) for name, pairs in full.items()}
    fixed: Seconds = {}
    for name, pairs in part.items():
        if not pairs:
            continue
        big, little = seconds[name], _medians(pairs)
        fwd, bwd = (min(t, max(0.0, t - (t - s) * mbs / (mbs - small)))
                    for t, s in zip(big, little, strict=True))
        fixed[name] = (fwd, bwd)
    return seconds, fixed


def _medians(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(f for f, _ in pairs), statistics.median(b for _, b in pairs)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _time_micro_batch(model: Any, batch: dict[str, torch.Tensor], autocast: Callable[[], Any]
                      ) -> dict[str, tuple[float, float]]:
    """One micro-batch through every module, each timed on its own: forward, backward.

    An encoder's backward gets a gradient of its output's shape (what the bridge brings
    back); the language model gets the encoders' outputs as leaves that need gradients
    (what a pipelined rank receives) and back-propagates its loss.
    """
    out: dict[str, tuple[float, float]] = {}
    received: dict[str, torch.Tensor] = {}
    for name in model.modality_submodules:
        with autocast():
            embeds, fwd = _timed(lambda n=name: model.encode(n, batch))
        if embeds.requires_grad:
            _, bwd = _timed(lambda e=embeds: e.backward(torch.ones_like(e)))
        else:  # frozen: nothing to back-propagate
            bwd = 0.0
        out[name] = (fwd, bwd)
        received[name] = embeds.detach().requires_grad_(True)
    lm = model.language_model
    if lm is None:
        return out

    def forward() -> torch.Tensor:
        with autocast():
            present = {n: model.present_mask(n, batch) for n in received}
            hidden = model.merge_embeddings(batch["tokens"], lm.embed_tokens(batch["tokens"]),
                                            received, present)
            logits = lm(hidden, **document_args(batch))
            loss_sum, num_tokens, _ = language_loss(logits, batch["labels"], batch["loss_mask"])
            return loss_sum / num_tokens.clamp(min=1)

    loss, fwd = _timed(forward)
    bwd = _timed(loss.backward)[1] if loss.requires_grad else 0.0
    out[LANGUAGE] = (fwd, bwd)
    return out


# ---- host cores --------------------------------------------------------------------

_PROBE_MATMULS = 1000
"""128 x 128 matmuls per probe: about 0.3 s of one core, long enough to time on a busy host."""
MAX_CORE_PROBE_RANKS = 16
"""Ranks the host-cores probe forks at most (a 300-rank plan must not fork 300 processes)."""

Spawner = Callable[..., list[Any]]
"""Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks (:func:`run_ranks`'s form)."""


def core_probe_ranks(world_size: int, cores: int | None = None) -> int:
    """Ranks :func:`measure_host_cores` forks for a ``world_size``-rank plan.

    The world, but no more than the host's usable ``cores`` (default
    :func:`~mimotron.config.limits.usable_cores`: more ranks than cores get no more
    compute together) nor :data:`MAX_CORE_PROBE_RANKS`; at least 2 (one rank alone
    shares nothing).
    """
    cores = cores or usable_cores()
    return min(world_size, max(2, min(cores, MAX_CORE_PROBE_RANKS)))


def measure_host_cores(world_size: int, rounds: int = 3, cores: int | None = None,
                       spawn: Spawner | None = None) -> float:
    """Cores' worth of compute ``world_size`` busy ranks of this host get together.

    Each of :func:`core_probe_ranks` forked ranks runs the same single-threaded matmul
    loop, first rank 0 alone (the others wait in a barrier), then all at once:
    ``ranks x alone / slowest together``, the median over ``rounds``. On an idle machine
    it is ``min(ranks, cores)``; where other work shares the CPUs (the scheduler splits
    them between sessions, not between processes) it can be far less, and that, not the
    affinity mask, is what a local launch's ranks share. Where the probe ran fewer ranks
    than ``min(world_size, cores)`` (the cap), the figure is scaled up to that many.

    Args:
        world_size: ranks of the plan.
        rounds: rounds of the probe.
        cores: the host's usable cores (default :func:`usable_cores`).
        spawn: what forks the ranks (default :func:`mimotron.forked_ranks.run_ranks`).
    """

    cores = cores or usable_cores()
    ranks = core_probe_ranks(world_size, cores)
    per_rank = (spawn or run_ranks)(ranks, _cores_rank, rounds, timeout_s=600.0)
    alone = per_rank[0][0]
    together = [max(r[1][i] for r in per_rank) for i in range(rounds)]
    measured = statistics.median(ranks * a / t for a, t in zip(alone, together, strict=True))
    target = min(world_size, cores)  # more ranks than cores share the same cores
    return measured * target / ranks if ranks < target else measured


def _cores_rank(rank: int, world_size: int, rounds: int) -> tuple[list[float], list[float]]:
    """One forked rank: (seconds of the probe alone (rank 0 only), seconds together)."""
    a = torch.randn(128, 128)

    def probe() -> float:
        start = time.perf_counter()
        for _ in range(_PROBE_MATMULS):
            torch.mm(a, a)
        return time.perf_counter() - start

    probe()  # warm-up
    alone, together = [], []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(probe())
        dist.barrier()
        together.append(probe())
    return alone, together


# ---- collectives -------------------------------------------------------------------


def fit_link(points: list[tuple[float, float]]) -> LinkCost:
    """Least-squares ``seconds = latency + bytes / bandwidth`` over ``(bytes, seconds)``.

    A noisy fit is kept physical: a negative intercept becomes the smallest time seen
    over 100 (latency > 0), and a non-positive slope (time not growing with bytes) the
    bandwidth of the largest buffer's average rate.

    Raises:
        ValueError: fewer than 2 points or 2 distinct sizes.
    """
    xs, ys = [float(b) for b, _ in points], [float(s) for _, s in points]
    if len(set(xs)) < 2:
        raise ValueError(f"fit_link needs at least 2 distinct buffer sizes, got {xs}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    latency = my - slope * mx
    if slope <= 0:
        big = max(range(len(xs)), key=lambda i: xs[i])
        slope, latency = ys[big] / xs[big] / 2, ys[big] / 2
    if latency <= 0:
        latency = min(ys) / 100
    return LinkCost(latency_s=latency, bytes_per_s=1.0 / slope)


def measure_collectives(sizes: list[int], options: CalibrationOptions | None = None
                        ) -> dict[str, dict[int, LinkCost]]:
    """Fitted costs of every collective kind at every group size in ``sizes`` (p2p: at 2).

    Forks ``max(sizes)`` gloo ranks (:func:`mimotron.forked_ranks.run_ranks`).
    """

    options = options or CalibrationOptions()
    world = max(sizes)
    per_rank = run_ranks(world, _collective_rank, sizes, options, timeout_s=600.0)
    out: dict[str, dict[int, LinkCost]] = {}
    for kind in COLLECTIVES:
        for n in ([2] if kind == "p2p" else sizes):
            # Each rank's median; the slowest rank bounds the collective.
            points = [(b, max(r[(kind, n, b)] for r in per_rank if (kind, n, b) in r))
                      for b in options.buffer_bytes]
            out.setdefault(kind, {})[n] = fit_link(points)
    return out


def _collective_rank(rank: int, world_size: int, sizes: list[int],
                     options: CalibrationOptions) -> dict[tuple[str, int, int], float]:
    """One forked rank: ``(kind, group size, bytes) -> median seconds per call``."""
    result: dict[tuple[str, int, int], float] = {}
    for n in sizes:
        group = dist.new_group(list(range(n))) if n < world_size else dist.group.WORLD
        if rank >= n:
            continue
        for kind in COLLECTIVES:
            if kind == "p2p" and n != 2:
                continue
            for num_bytes in options.buffer_bytes:
                result[(kind, n, num_bytes)] = _time_collective(kind, group, n, rank,
                                                                num_bytes, options)
    return result


def _time_collective(kind: str, group: Any, n: int, rank: int, num_bytes: int,
                     options: CalibrationOptions) -> float:
    """Median over rounds of the mean seconds of ``comm_calls`` back-to-back calls."""
    numel = max(n, num_bytes // 4 // n * n)  # float32, divisible by the group size
    send = torch.ones(numel)
    call = _call(kind, group, n, rank, send)
    for _ in range(options.warmup):
        call()
    rounds = []
    for _ in range(options.comm_rounds):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(options.comm_calls):
            call()
        rounds.append((time.perf_counter() - start) / options.comm_calls)
    return statistics.median(rounds)


def _call(kind: str, group: Any, n: int, rank: int, send: torch.Tensor) -> Callable[[], None]:
    """One call of ``kind`` with ``send`` as this rank's buffer."""
    if kind == "all_reduce":
        return lambda: dist.all_reduce(send, group=group)
    if kind == "all_gather":  # the bytes priced are the gathered output's
        shard = send[: send.numel() // n].clone()
        return lambda: dist.all_gather_single(send, shard, group=group)
    if kind == "reduce_scatter":
        shard = send.new_empty(send.numel() // n)
        return lambda: dist.reduce_scatter_single(shard, send, group=group)
    if kind == "all_to_all":
        received = torch.empty_like(send)
        return lambda: dist.all_to_all_single(received, send, group=group)
    assert kind == "p2p", kind
    # One-way: rank 0 sends, rank 1 receives (a pipeline stage's activation).
    if rank == 0:
        return lambda: dist.send(send, dst=1, group=group)
    return lambda: dist.recv(send, src=0, group=group)

