"""What autograd keeps for backward, measured on fake tensors at real model sizes.

:func:`saved_bytes` counts the distinct storages autograd saves while a forward runs
(``torch.autograd.graph.saved_tensors_hooks``; a tensor saved by several ops, or views
of one storage, count once; parameters and their 16-bit casts are weights, not
activations, and are left out). Under ``FakeTensorMode`` nothing is allocated, so a
Llama-2-7B layer at 4096 tokens is measured on a laptop in a second: the fake CPU
tensors go through the same kernels' shape logic (SDPA picks its flash kernel, autocast
casts) as real ones.

:func:`layer_activation_bytes` measures one transformer layer of a module as one rank of
its tensor-parallel group holds it (TP and sequence parallelism applied with DTensor
over a ``fake`` process group of ``tensor`` ranks), in the config's precision. It is
how the analytic estimate (:func:`mimotron.estimate.memory.layer_bytes_per_token`) and
the published figures are checked (``tests/test_activation_bytes.py``,
``benchmarks/activations.py``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mimotron.config.schema import MimoConfig
from mimotron.models.build import build_module
from mimotron.names import LANGUAGE
from mimotron.parallel.tensor_parallel import apply_tensor_parallel
from mimotron.pipeline.shapes import residual_dtype
from mimotron.training.precision import autocast_factory


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _is_weight_copy(t: torch.Tensor, weights: set[int], hops: int = 4) -> bool:
    """Whether ``t`` is one of ``weights`` (storage keys) seen through casts and views
    (autocast's 16-bit copy, its transpose): a single chain to that leaf's accumulator."""
    fn = t.grad_fn
    for _ in range(hops):
        if fn is None:
            return False
        nexts = [n for n, _ in fn.next_functions if n is not None]
        if len(nexts) != 1:
            return False
        fn = nexts[0]
        if type(fn).__name__ == "AccumulateGrad":
            return _unwrap(fn.variable).untyped_storage()._cdata in weights
    return False


def saved_bytes(run: Callable[[], Any], weights: list[torch.Tensor] | None = None) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs.

    Saved-tensor hooks of the measured code must hand what they keep on to the hooks
    around them, as :mod:`mimotron.parallel.sequence_saved` does; then its kept shard
    is what is counted.

    Args:
        run: the forward to measure.
        weights: parameters: left out, together with their casts and views
            (autocast's 16-bit copies are weights, not activations).

    Returns:
        The byte count.
    """
    skip = {_unwrap(w).untyped_storage()._cdata for w in weights or []}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _unwrap(t).untyped_storage()
        if storage._cdata not in skip and not _is_weight_copy(t, skip):
            storages[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(storages.values())


@contextlib.contextmanager
def fake_tensor_group(world_size: int) -> Iterator[Any]:
    """A ``fake`` default process group of ``world_size`` ranks (this one rank 0) and a
    1-D CPU device mesh over it; destroyed on exit. No process group may exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ValueError("layer_activation_bytes needs no process group (it creates a fake one)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        gc.collect()  # the modules and meshes built on the group go before it does
        dist.destroy_process_group()


def _stage(cfg: MimoConfig, name: str, num_layers: int) -> nn.Module:
    """A middle pipeline stage of module ``name`` holding its first ``num_layers`` layers:
    no embedding, head or front end."""

    return build_module(cfg, name, 64, layer_ids=list(range(num_layers)), pre_process=False,
                        post_process=False, init=False)


def layer_activation_bytes(cfg: MimoConfig, name: str = LANGUAGE) -> int:
    """Bytes one transformer layer of ``name`` saves for backward on one rank, per micro-batch.

    A stage is built at the config's shapes under ``FakeTensorMode`` (CPU), sharded by
    ``parallel.tensor`` (and ``sequence_parallel``) over a fake group, and run forward on
    one micro-batch slice (``micro_batch_size / data`` samples of ``data.seq_length``
    tokens for the language model, ``num_output_tokens`` for an encoder) in the
    config's precision, as a middle pipeline stage receives it. The result is the
    difference between a two-layer and a one-layer stage: one layer's own tensors
    (its input included: its first norm saves it), without what all layers of a stage
    share (the RoPE tables).

    Raises:
        ValueError: a process group already exists, or the module has one layer.
    """
    if cfg.modules[name].num_layers < 2:
        raise ValueError(f"modules.{name}.num_layers={cfg.modules[name].num_layers}: measuring "
                         "one layer needs a module of at least 2 layers")
    if dist.is_initialized():
        raise ValueError("layer_activation_bytes needs no process group (it creates a fake one)")
    return _in_child(_layer_bytes, cfg, name)


def _layer_bytes(cfg: MimoConfig, name: str) -> int:
    return _stage_bytes(cfg, name, 2) - _stage_bytes(cfg, name, 1)


def _in_child(fn: Callable[..., int], *args: Any) -> int:
    """``fn(*args)`` in a forked child process.

    The measurement creates and destroys a fake default process group and DTensor meshes
    over it; torch keeps some of that state process-wide, and a process that later forks
    gloo ranks (a test suite) must not inherit it. A child keeps it to itself.
    """
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)

    def target() -> None:
        try:
            child.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            child.send(("error", f"{type(exc).__name__}: {exc}"))

    proc = ctx.Process(target=target, daemon=True)
    proc.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the measurement process died (exit code {proc.exitcode})") from None
    proc.join()
    if status != "ok":
        raise RuntimeError(f"the measurement failed: {value}")
    return value


def _stage_bytes(cfg: MimoConfig, name: str, num_layers: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    mod = cfg.modules[name]
    par = mod.parallel
    samples = max(1, cfg.train.micro_batch_size // par.data)
    tokens = cfg.data.seq_length if mod.is_language else mod.num_output_tokens
    autocast = autocast_factory(cfg.train.precision, torch.device("cpu"))
    with fake_tensor_group(par.tensor) as mesh, FakeTensorMode():
        part = _stage(cfg, name, num_layers)
        if par.tensor > 1:
            apply_tensor_parallel(part, mesh, mod.is_language,
                                  par.sequence_parallel and mod.is_language)
        x = torch.randn(samples, tokens, mod.hidden_size, dtype=residual_dtype(cfg),
                        requires_grad=True)

        def run() -> torch.Tensor:
            with autocast():
                return part(x) if mod.is_language else part.encoder(x)

        return saved_bytes(run, list(part.parameters()))
