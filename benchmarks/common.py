"""Shared pieces of the benchmark cases: options, statistics, configs, engine steps, RSS.

Every case measures two things side by side (A and B) in one invocation: repetitions
alternate the order (A B, B A, A B, ...) so slow drift of the machine (other users, CPU
frequency) hits both sides alike; each figure is reported as a median with the min-max
over repetitions. Threads are pinned to one per rank (``run.py`` sets ``OMP_NUM_THREADS``
before torch is imported; ``mimotron.forked_ranks.run_ranks`` sets ``torch.set_num_threads(1)``
in every forked rank).
"""

from __future__ import annotations

import copy
import itertools
import os
import re
import statistics
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mimotron.config import MimoConfig, apply_override, config_from_dict, validate_config

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "configs" / "digits.toml"
SIZES = ("tiny", "default")


@dataclass(frozen=True)
class Options:
    """What ``run.py`` was asked for.

    Attributes:
        quick: fewer repetitions and steps, smaller stand-ins for the largest cases.
        size: ``default`` (the sizes the figures are quoted at) or ``tiny`` (seconds;
            for the smoke test: numbers are not meaningful).
        reps: repetitions of every A/B pair (at least 5).
    """

    quick: bool = False
    size: str = "default"
    reps: int = 5

    @property
    def tiny(self) -> bool:
        return self.size == "tiny"


@dataclass
class Figure:
    """One headline number of a case, with its target (if the issue sets one)."""

    name: str
    value: float
    target: str = ""  # e.g. "<= 1.05" or a range "0.80-1.25"; empty = reported only
    spread: tuple[float, float] | None = None  # min-max over repetitions
    detail: str = ""

    @property
    def passed(self) -> bool | None:
        """Whether ``value``, at the table's two decimals, meets ``target`` (None: no target)."""
        if not self.target:
            return None
        if " " not in self.target:  # a closed range "lo-hi"
            lo, hi = (float(b) for b in self.target.split("-"))
            return lo <= round(self.value, 2) <= hi
        op, bound = self.target.split()
        value, bound_f = round(self.value, 2), float(bound)
        return {"<=": value <= bound_f, ">=": value >= bound_f, "==": value == bound_f}[op]

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "target": self.target or None,
            "passed": self.passed,
            "min": None if self.spread is None else self.spread[0],
            "max": None if self.spread is None else self.spread[1],
            "detail": self.detail,
        }


@dataclass
class CaseResult:
    """Figures (headline numbers) and measurements (every raw figure) of one case."""

    name: str
    figures: list[Figure] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "figures": {f.name: f.to_json() for f in self.figures},
            "measurements": self.measurements,
            "notes": self.notes,
        }


# ---- statistics ----------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the raw values (all in the JSON)."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": list(values),
    }


def ratio_figure(
    name: str, a: list[float], b: list[float], target: str = "", detail: str = ""
) -> Figure:
    """``median(a) / median(b)``; the spread is the min-max of the per-repetition ratios."""
    paired = [x / y for x, y in zip(a, b, strict=True)]
    return Figure(
        name,
        statistics.median(a) / statistics.median(b),
        target,
        (min(paired), max(paired)),
        detail,
    )


def interleave(reps: int, sides: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
    """Run each side once per repetition, alternating the order (ABAB -> AB, BA, AB ...)."""
    names = list(sides)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(sides[name]())
    return out


def timed(fn: Callable[[], Any], repeat: int = 1) -> float:
    """Seconds per call of ``fn`` averaged over ``repeat`` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def timed_cpu(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, float]:
    """(wall, process CPU) seconds per call: CPU time barely moves when others load the
    machine, so a ratio of CPU times is a cross-check of a wall-time ratio."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - wall) / repeat, (time.process_time() - cpu) / repeat


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def fmt_stats(s: dict[str, Any], unit: Callable[[float], str] = fmt_s) -> str:
    return f"{unit(s['median'])} [{unit(s['min'])}-{unit(s['max'])}]"


# ---- configs -------------------------------------------------------------------------


def digits_raw() -> dict[str, Any]:
    """``configs/digits.toml`` as a nested dict (edit it, then :func:`make_config`)."""
    return tomllib.loads(DIGITS.read_text())


# The smallest model that still exercises every module (smoke tests, --size tiny).
TINY = [
    "modules.vision.hidden_size=16",
    "modules.vision.num_layers=1",
    "modules.audio.hidden_size=16",
    "modules.language.hidden_size=32",
    "modules.language.num_layers=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
]


def make_config(raw: dict[str, Any], overrides: list[str] = ()) -> MimoConfig:
    """Validated config from a raw dict plus ``key=value`` overrides (raw is not changed).

    Evaluation, checkpoints, logging and tensorboard are off: the cases time steps only.
    """
    raw = copy.deepcopy(raw)
    quiet = [
        "eval.interval=1000000",
        "checkpoint.interval=0",
        'checkpoint.load="none"',
        "log.tensorboard=false",
        "log.progress=false",
    ]
    for item in quiet + list(overrides):
        apply_override(raw, item)
    return validate_config(config_from_dict(raw))


def parallel(module: str, **degrees: int) -> list[str]:
    """Overrides setting ``modules.<module>.parallel.<key>``."""
    return [f"modules.{module}.parallel.{k}={v}" for k, v in degrees.items()]


def one_rank(raw: dict[str, Any]) -> list[str]:
    """Overrides that put every module of ``raw`` on one rank (DP 1, offset 0)."""
    return [o for m in raw["modules"] for o in parallel(m, data=1, rank_offset=0)]


# ---- driving the engine ----------------------------------------------------------------


def precompute_steps(run: Any, num_steps: int) -> list[Any]:
    """Take ``num_steps`` steps' micro-batches from the run's iterator (data excluded)."""
    return [next(run.train_data_iterator) for _ in range(num_steps)]


def engine_stepper(run: Any, steps: list[Any]) -> Callable[[], dict[str, float]]:
    """A callable doing one ``train_step_mimo`` on the next precomputed step (cycled)."""
    from mimotron.training.megatron_compat import train_step_mimo
    from mimotron.training.step import default_forward_step

    data: Iterator[Any] = itertools.cycle(steps)

    def step() -> dict[str, float]:
        loss, _, _, _ = train_step_mimo(
            default_forward_step,
            data,
            run.model,
            run.optimizer,
            run.schedulers,
            run.global_state,
            run.communicator,
            infra=run.infra,
        )
        return loss

    return step


def setup_run(cfg: MimoConfig) -> Any:
    """``setup_mimo`` on this (already initialised) rank, as tests/test_parity.py does."""
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo

    return setup_mimo(cfg, init_runtime())


def warm_imports() -> None:
    """Import and touch the lazy parts once in the parent, so forked ranks start warm.

    scikit-learn (the digits images) and torch.optim's first construction take ~2 s;
    paying that in every forked repetition would dwarf what is measured.
    """
    torch.set_num_threads(1)
    from mimotron.data.digits import load_digit_images

    load_digit_images()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p])
    p.grad = torch.zeros(2)
    opt.step()


# ---- resident memory -------------------------------------------------------------------


def rss_bytes() -> dict[str, int]:
    """Current (VmRSS) and peak (VmHWM) resident set of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def runqueue_wait_s() -> float:
    """Seconds the calling thread has waited for a CPU while runnable (Linux schedstat).

    Other processes on the machine show up here: a rank that waits for a core is slower
    for reasons outside what is measured. 0.0 where the kernel does not report it.
    """
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_info() -> dict[str, Any]:
    """Where the figures were measured."""
    return {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
    }


def host_syncs_per_step(cfg: MimoConfig) -> dict[int, int]:
    """Device-to-host syncs of one training step, per rank of ``cfg``'s layout.

    Counted by the fake-device dry run (``mimotron.dryrun``: every host read of a device
    value, each a GPU stall), in a forked process of its own because the dry run makes
    fake default process groups. The second step is counted (the first builds the
    optimizer state).
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def count() -> None:
        from mimotron.dryrun import dry_run

        reports = dry_run(cfg, steps=2, evaluate=False, checkpoint=False)
        child.send({r.rank: r.steps[-1].num_syncs for r in reports})
        child.close()

    proc = ctx.Process(target=count)
    proc.start()
    child.close()
    try:
        return parent.recv()
    finally:
        proc.join()


def host_sync_figure(cfg: MimoConfig) -> Figure:
    """``host_syncs_per_step``: the most syncs of one step on any rank (reported only)."""
    per_rank = host_syncs_per_step(cfg)
    return Figure("host_syncs_per_step", float(max(per_rank.values())), "", None,
                  "device-to-host syncs of one training step by rank (fake-device dry run): "
                  + ", ".join(f"rank {r}: {n}" for r, n in sorted(per_rank.items())))

