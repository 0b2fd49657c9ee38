"""Bytes one transformer layer keeps for backward under each activation-recompute mode.

``python benchmarks/recompute.py [--hidden H --heads N --seq S --precision P --context C ...]
[--time]`` builds the language model of ``configs/digits.toml`` at that shape (and, with
``--vision``, the digits vision encoder) and, for ``modules.<m>.recompute`` = ``none``,
``selective`` and ``full``, counts what one layer keeps between its forward and its
backward: the storages the module's forward creates that are still alive when it
returns (each storage once, however many views or saves share it; found with a
``TorchDispatchMode`` holding weak references), as the difference between a module of
two layers and one of one layer, at three samples minus two, so that what does not
scale with both (the ends, 16-bit weight casts, RoPE tables, the RNG states checkpoint
keeps) cancels. Through the module's own forward, so a layer's input has the dtype it
has in training. ``--context C`` runs the language model on ``C`` forked gloo ranks
with context parallelism (rank 0's count; its collectives run over a ``fake``
group, since only sizes matter here). The analytic figure next to each is
``mimotron plan``'s (:func:`mimotron.estimate.memory.layer_bytes_per_sample` minus
:func:`~mimotron.estimate.memory.recompute_dropped_bytes`). ``--time`` adds the
median CPU wall time of a forward and backward of the two-layer module.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mimotron.config import MimoConfig, load_config  # noqa: E402
from mimotron.estimate.memory import layer_bytes_per_sample, recompute_dropped_bytes  # noqa: E402
from mimotron.forked_ranks import run_ranks  # noqa: E402
from mimotron.models.build import build_module  # noqa: E402
from mimotron.models.recompute import apply_recompute  # noqa: E402

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
MODES = ("none", "selective", "full")


class _Created(TorchDispatchMode):
    """Weak references to every storage an operator creates while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(d.untyped_storage()) for t in tree_leaves(out)
                      if isinstance(t, torch.Tensor) for d in _data_tensors(t)]
        return out


def _data_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s data: a wrapper subclass's (a DTensor's local tensor,
    an ``AsyncCollectiveTensor``'s result) instead of its own storage, which holds none."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, name) for name in names]
    return [d for i in inner if isinstance(i, torch.Tensor) for d in _data_tensors(i)]


def kept_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the storages ``run()`` creates that are alive after it (its output's too).

    Garbage in reference cycles is collected first: it is not kept, only not freed yet.
    Only objects made by ``run`` are examined (``gc.freeze`` sets the others aside), so
    this costs little in a large process.
    """
    created = _Created()
    gc.freeze()
    try:
        with created:
            out = run()
        gc.collect()
    finally:
        gc.unfreeze()
    alive = {id(s): s.nbytes() for ref in created.refs if (s := ref()) is not None}
    del out
    return sum(alive.values())


def module_input(cfg: MimoConfig, name: str, samples: int, context: int = 1) -> torch.Tensor:
    """A forward input of module ``name``: hidden states for the language model (this
    CP rank's ``seq / context`` positions), raw images or spectrograms for an encoder."""
    mod = cfg.modules[name]
    if mod.kind == "language":
        return torch.randn(samples, cfg.data.seq_length // context, mod.hidden_size,
                           requires_grad=True)
    if mod.kind == "vit":
        return torch.randn(samples, mod.in_channels, mod.image_size, mod.image_size)
    return torch.randn(samples, mod.num_freq_bins, mod.num_frames)


def build(cfg: MimoConfig, name: str, mode: str, group: dist.ProcessGroup | None = None,
          init: bool = True) -> torch.nn.Module:
    """Module ``name`` of ``cfg`` with recompute ``mode`` (and CP over ``group``)."""
    torch.manual_seed(0)
    module = build_module(cfg, name, 64, init=init)
    if group is not None:
        module.set_context_parallel(group)
    apply_recompute(module, mode)
    return module


def kept_per_layer(overrides: list[str], name: str, mode: str,
                   group: dist.ProcessGroup | None = None, fake: bool = False) -> int:
    """What one layer of module ``name`` keeps per sample under recompute ``mode``.

    Args:
        overrides: config overrides of ``configs/digits.toml`` (the shape, precision).
        name: the module.
        mode: ``modules.<name>.recompute``.
        group: a context-parallel group for the language model, or ``None``.
        fake: build and run under ``FakeTensorMode`` (nothing allocated or computed;
            the kernels' shape logic, SDPA's choice included, is the CPU's).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    kept = {}
    context = 1 if group is None else dist.get_world_size(group)
    for layers in (1, 2):
        cfg = load_config(DIGITS, [*overrides, f"modules.{name}.num_layers={layers}"])
        with FakeTensorMode() if fake else contextlib.nullcontext():
            module = build(cfg, name, mode, group, init=not fake)
            bf16 = cfg.train.precision == "bf16"
            for samples in (2, 3):
                x = module_input(cfg, name, samples, context)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    kept[layers, samples] = kept_bytes(partial(module, x))
    return (kept[2, 3] - kept[1, 3]) - (kept[2, 2] - kept[1, 2])


def estimated_per_layer(overrides: list[str], name: str, mode: str) -> int:
    """``mimotron plan``'s bytes per sample for one layer under ``mode``."""
    cfg = load_config(DIGITS, [*overrides, f"modules.{name}.recompute='{mode}'"])
    return layer_bytes_per_sample(cfg, name) - recompute_dropped_bytes(cfg, name)


def step_seconds(overrides: list[str], name: str, mode: str, reps: int = 5) -> float:
    """Median wall time of one forward and backward of a two-layer module (3 samples)."""
    cfg = load_config(DIGITS, [*overrides, f"modules.{name}.num_layers=2"])
    module = build(cfg, name, mode)
    x = module_input(cfg, name, 3)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):
            out = module(x)
        out.float().square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _cp_rank(rank: int, world: int, overrides: list[str], mode: str) -> int:
    # A fake group over the same ranks: a gloo worker thread lets go of a finished
    # collective's buffers a moment after its wait returns, which a byte count can see.
    return kept_per_layer(overrides, "language", mode, fake_group())


def fake_group() -> dist.ProcessGroup:
    """A ``fake`` process group over the default group's ranks, for counting bytes: its
    collectives finish at once and hold nothing, where a gloo worker thread lets go of
    a finished collective's buffers a moment after its wait returns."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    return dist.new_group(backend="fake")


def _fake_kept(overrides: list[str], name: str, mode: str, context: int) -> int:
    """:func:`kept_per_layer` on fake tensors; under CP, rank 0 of a ``fake`` group."""
    if context == 1:
        return kept_per_layer(overrides, name, mode, fake=True)
    from mimotron.dryrun.saved_bytes import fake_tensor_group

    with fake_tensor_group(context):
        return kept_per_layer(overrides, name, mode, dist.group.WORLD, fake=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    p.add_argument("--context", type=int, nargs="*", default=[1])
    p.add_argument("--vision", action="store_true", help="also the digits vision encoder")
    p.add_argument("--time", action="store_true", help="also a fwd+bwd wall time per mode")
    p.add_argument("--ffn", type=int, default=0, help="SwiGLU width (0: the default)")
    p.add_argument("--fake", action="store_true",
                   help="on fake tensors: any shape in seconds (CP over a fake group)")
    args = p.parse_args(argv)
    shape = [f"modules.language.hidden_size={args.hidden}",
             f"modules.language.num_heads={args.heads}", f"data.seq_length={args.seq}",
             f"modules.language.ffn_hidden_size={args.ffn}", f"train.precision={args.precision}"]
    rows = [("language", c) for c in args.context] + ([("vision", 1)] if args.vision else [])
    print(f"bytes one layer keeps per sample ({args.precision}; language h={args.hidden}, "
          f"{args.heads} heads, seq {args.seq}): measured / estimated")
    for name, context in rows:
        cp = [f"modules.language.parallel.context={context}"] if context > 1 else []
        line = [f"{name}{f' CP {context}' if context > 1 else ''}:"]
        for mode in MODES:
            if args.fake:
                got = _fake_kept(shape + cp, name, mode, context)
            elif context > 1:
                got = run_ranks(context, _cp_rank, shape + cp, mode, timeout_s=600)[0]
            else:
                got = kept_per_layer(shape, name, mode)
            want = estimated_per_layer(shape + cp, name, mode)
            line.append(f"{mode} {got:,} / {want:,}")
            if args.time and context == 1 and not args.fake:
                line.append(f"({step_seconds(shape, name, mode) * 1e3:.1f} ms fwd+bwd)")
        print("  ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
