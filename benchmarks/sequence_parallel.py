"""Activation memory per rank with sequence parallelism vs without, measured and analytic.

``python benchmarks/sequence_parallel.py [--json OUT]`` trains one step of the digits
model (vision | audio | language TP 2, non-colocated, one micro-batch per step) with
``modules.language.parallel.sequence_parallel`` off and on. On the language ranks the
tensors autograd saves for backward are recorded with
``torch.autograd.graph.saved_tensors_hooks``: each distinct storage counts once (views
of one tensor share it; a saved tensor stays alive until backward, so its address
cannot be reused within the forward), parameters excluded. The measured SP / no-SP ratio
is printed next to the analytic one of ``mimotron plan``
(:func:`mimotron.estimate.memory.activation_bytes`).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import is_traceable_wrapper_subclass  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    digits_raw,
    engine_stepper,
    make_config,
    parallel,
    precompute_steps,
    setup_run,
)
from mimotron.forked_ranks import run_ranks  # noqa: E402

LAYOUT = [*parallel("vision", rank_offset=0, data=1), *parallel("audio", rank_offset=1, data=1),
          *parallel("language", rank_offset=2, tensor=2, data=1)]
ONE_MICRO_BATCH = ["train.global_batch_size=16", "train.micro_batch_size=16"]
MODELS = {
    "digits": [],
    "wide": ["modules.language.hidden_size=512", "modules.language.num_layers=4",
             "modules.language.num_heads=8"],
}


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a saved tensor's data (DTensor / collective wrappers)."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inners = [getattr(t, n) for n in names]
    return [x for i in inners if isinstance(i, torch.Tensor) for x in _plain_tensors(i)]


def _saved_bytes(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """One training step; the bytes autograd saved on a language rank (None elsewhere)."""
    cfg = make_config(digits_raw(), overrides)
    run = setup_run(cfg)
    step = engine_stepper(run, precompute_steps(run, 1))
    lm = run.model.language_model
    if lm is None:
        step()
        return {"saved": None}
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
              for p in lm.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        for inner in _plain_tensors(t):
            s = inner.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return {"saved": sum(storages.values())}


def saved_by_layout(layouts: dict[str, tuple[list[str], int]]) -> dict[str, Any]:
    """For each ``name: (overrides, world size)``: saved bytes per language rank (``name``)
    and the analytic estimate of ``mimotron plan`` (``name_analytic``)."""
    from mimotron.estimate.memory import activation_bytes

    out: dict[str, Any] = {}
    for name, (overrides, world) in layouts.items():
        results = run_ranks(world, _saved_bytes, overrides, timeout_s=600)
        out[name] = [r["saved"] for r in results if r["saved"] is not None]
        out[f"{name}_analytic"] = activation_bytes(make_config(digits_raw(), overrides),
                                                   "language")
    return out


def measure(model: list[str]) -> dict[str, Any]:
    """Saved bytes per language rank and the ratios, SP off and on."""
    out = saved_by_layout({
        key: ([*LAYOUT, *ONE_MICRO_BATCH, *model,
               f"modules.language.parallel.sequence_parallel={str(sp).lower()}"], 4)
        for key, sp in (("no_sp", False), ("sp", True))})
    out["measured_ratio"] = max(out["sp"]) / max(out["no_sp"])
    out["analytic_ratio"] = out["sp_analytic"] / out["no_sp_analytic"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="write the measurements here")
    p.add_argument("--model", choices=sorted(MODELS), action="append",
                   help="models to measure (default: all)")
    args = p.parse_args(argv)
    results = {name: measure(MODELS[name]) for name in (args.model or sorted(MODELS))}
    for name, r in results.items():
        print(f"{name}: saved activations per language rank (MiB) "
              f"no SP {[round(b / 2**20, 3) for b in r['no_sp']]}, "
              f"SP {[round(b / 2**20, 3) for b in r['sp']]}; "
              f"SP/no-SP measured {r['measured_ratio']:.3f}, analytic {r['analytic_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
