"""The files one training step passes through: ``train_step`` traced, filtered to mimotron.

``python benchmarks/step_files.py`` runs two steps of the digits demo on one rank (the
second is traced) and prints the files the step enters in first-entry order, which of
them are engine files, and the file-to-file jumps; ``--world 4`` traces the config's own
split layout (vision | audio | language DP 2) on four ranks. ``tests/test_step_files.py``
keeps the count of engine files at most 10 and the jumps in one direction.

What counts (the trace is ``sys.setprofile``'s ``call`` events of one
:func:`~mimotron.training.step.train_step` call, on the calling thread; a ``call`` event
is a Python function, a generator resumed, or a comprehension, entered):

* a *mimotron file* is a Python file under ``mimotron/``. *Model code*
  (``mimotron/models/``: what is trained, not how) is left out of every count, like torch
  and the standard library;
* a *jump* is a call from one mimotron file into another, both outside model code: the
  caller is the innermost frame of such a file on the stack (model code and torch in
  between are passed over). Jumps are counted as distinct call sites, ``(caller file,
  caller function) -> (callee file, callee function)``, not as calls;
* an *engine file* is a mimotron file outside model code that the step enters and from
  which it calls on into another mimotron file (model code included): control passes
  through it. A *leaf* is entered but calls nothing of mimotron's (a look-up, predicate
  or arithmetic helper that returns to its caller); leaves are listed, not counted;
* the step goes *one direction* when its jumps form no cycle: no file is entered again
  from a file it called.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import mimotron

PACKAGE = Path(mimotron.__file__).resolve().parent
MODEL_CODE = "models/"

# A jump: (caller file, caller function, callee file, callee function).
Jump = tuple[str, str, str, str]


@dataclass
class StepTrace:
    """The mimotron files one traced call entered (paths relative to ``mimotron/``)."""

    files: list[str] = field(default_factory=list)
    """Every mimotron file outside model code, in first-entry order."""
    jumps: set[Jump] = field(default_factory=set)
    calls_out: set[str] = field(default_factory=set)
    """Files that called into another mimotron file (model code included)."""

    @property
    def engine_files(self) -> list[str]:
        """The files control passes through, in first-entry order."""
        return [f for f in self.files if f in self.calls_out]

    @property
    def leaves(self) -> list[str]:
        """The files entered that call nothing of mimotron's, in first-entry order."""
        return [f for f in self.files if f not in self.calls_out]

    def cycles(self) -> list[list[str]]:
        """File cycles of the jumps (empty: one direction), each from its first file."""
        graph: dict[str, set[str]] = {}
        for caller, _, callee, _ in self.jumps:
            graph.setdefault(caller, set()).add(callee)
        found: list[list[str]] = []

        def visit(path: list[str]) -> None:
            for nxt in sorted(graph.get(path[-1], ())):
                if nxt == path[0]:
                    found.append([*path, nxt])
                elif nxt not in path and nxt > path[0]:  # each cycle once, from its least file
                    visit([*path, nxt])

        for start in sorted(graph):
            visit([start])
        return found


def _mimotron_file(frame: FrameType) -> str | None:
    path = frame.f_code.co_filename
    prefix = f"{PACKAGE}/"
    return path[len(prefix):] if path.startswith(prefix) else None


def trace_files(fn: Callable[[], Any]) -> tuple[Any, StepTrace]:
    """Call ``fn()`` under a profile hook and return its result and :class:`StepTrace`."""
    trace = StepTrace()
    seen: set[str] = set()
    inside: set[int] = set()  # frames entered during the call (the callers that count)

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        inside.add(id(frame))
        callee = _mimotron_file(frame)
        if callee is None:
            return
        outer = frame.f_back
        while outer is not None and id(outer) in inside and _mimotron_file(outer) is None:
            outer = outer.f_back
        if outer is not None and id(outer) not in inside:
            outer = None  # the call came from outside the traced call
        caller = None if outer is None else _mimotron_file(outer)
        if caller is not None and caller != callee and not caller.startswith(MODEL_CODE):
            trace.calls_out.add(caller)
        if callee.startswith(MODEL_CODE):
            return
        if callee not in seen:
            seen.add(callee)
            trace.files.append(callee)
        if caller is not None and caller != callee and not caller.startswith(MODEL_CODE):
            trace.jumps.add((caller, outer.f_code.co_name, callee, frame.f_code.co_name))

    sys.setprofile(hook)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, trace


def traced_step(rank: int, world: int, overrides: list[str]) -> StepTrace:
    """One rank: set up the digits demo, take a step, trace the second (a ``run_ranks`` body)."""
    from mimotron.config import load_config
    from mimotron.runtime import init_runtime
    from mimotron.training.loop import setup_mimo
    from mimotron.training.step import build_step_run, train_step

    digits = PACKAGE.parent / "configs" / "digits.toml"
    cfg = load_config(digits, overrides)
    built = setup_mimo(cfg, init_runtime())
    run = build_step_run(built.model, built.optimizer, built.schedulers, built.global_state,
                         built.infra, built.communicator)
    train_step(run, next(built.train_data_iterator))  # the first step builds lazy state
    batches = next(built.train_data_iterator)
    _, trace = trace_files(lambda: train_step(run, batches))
    return trace


def _report(rank: int, trace: StepTrace) -> None:
    print(f"rank {rank}: {len(trace.engine_files)} engine files, {len(trace.leaves)} leaves, "
          f"{len(trace.jumps)} jumps, cycles: {trace.cycles() or 'none'}")
    for i, name in enumerate(trace.engine_files, 1):
        print(f"  {i:2d}. {name}")
    print(f"  leaves: {', '.join(trace.leaves)}")


def main() -> None:
    """Print the trace of one step on one rank, or on each rank of the split layout."""
    from mimotron.forked_ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=(1, 4), default=1,
                        help="1: every module on one rank; 4: the config's split layout")
    args = parser.parse_args()
    small = ["modules.vision.hidden_size=32", "modules.vision.num_layers=1",
             "modules.audio.hidden_size=32", "modules.language.hidden_size=64",
             "train.global_batch_size=16", "train.micro_batch_size=8"]
    one_rank = [f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
                for k, v in (("data", 1), ("rank_offset", 0))]
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*small, f"log.dir={tmp}", *(one_rank if args.world == 1 else [])]
        traces = run_ranks(args.world, traced_step, overrides, timeout_s=300)
    for rank, trace in enumerate(traces):
        _report(rank, trace)


if __name__ == "__main__":
    main()
