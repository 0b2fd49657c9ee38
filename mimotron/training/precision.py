"""Mixed precision of a training step: autocast per forward, one weight cast per step.

Weights and optimizer state stay fp32 (the master copy; a ZeRO-1 module under bf16 /
fp16 instead holds 16-bit weights, which autocast uses as they are, with fp32 masters in
its optimizer: :mod:`mimotron.parallel.zero`); each forward runs under
``torch.autocast``, which casts a weight to the compute dtype the first time a matmul
reads it. Autocast keeps those casts in a cache that it clears when the *outermost*
autocast region exits. With one region per micro-batch forward, every micro-batch in
flight therefore held its own 16-bit copy of every weight (saved for its backward):
``m`` copies under 1F1B warm-up, where Megatron, whose model weights are 16-bit, holds
one.

:func:`step_cast_scope` keeps one cast of each weight for the whole step instead: each
weight is cast once per step, the copy is shared by every micro-batch's saved tensors
and is freed when the step's scope exits, before the optimizer changes the weights.
Each *use* still gets an autograd node of its own micro-batch
(:mod:`mimotron.models.weight_casts`), so a layer's 16-bit weight gradient becomes
its fp32 gradient as soon as the layer's backward is done. Only fp32 parameters that
require a gradient are cached (autocast's rule): frozen weights are cast per use and,
needing no gradient, are never saved for backward. The scope also opens an outer
autocast region with autocast *disabled* (which changes nothing about which ops are
cast): as the outermost region it keeps autocast's own cache alive across the step
for any other cached cast.

The casts are thread-local, like autocast itself: the forwards must run on the thread
that opened the scope (they do; the schedule runs on the caller's thread), and the
backward sees them where autograd carries the caller's thread-local state (a
recomputed layer's forward runs again under them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from mimotron.models.weight_casts import StepWeightCasts
from mimotron.runtime import autocast_device_type, compute_dtype


def autocast_factory(precision: str, device: torch.device) -> Callable[[], Any]:
    """Mixed-precision context of one forward: compute in bf16/fp16, weights in fp32.

    Args:
        precision: ``train.precision``.
        device: the rank's device.

    Returns:
        A factory of context managers (``contextlib.nullcontext`` under fp32).
    """
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = compute_dtype(precision)
    return lambda: torch.autocast(device_type=autocast_device_type(device), dtype=dtype)


@contextlib.contextmanager
def step_cast_scope(precision: str, device: torch.device) -> Iterator[None]:
    """Keep autocast's weight casts for the whole step (one 16-bit copy per weight).

    Args:
        precision: ``train.precision``; ``fp32`` makes this a no-op.
        device: the rank's device.

    Yields:
        Inside, forwards entered with :func:`autocast_factory` share one cast of each
        weight; the casts are dropped on exit.
    """
    if precision == "fp32":
        yield
        return
    device_type = autocast_device_type(device)
    dtype = compute_dtype(precision)
    with torch.autocast(device_type=device_type, dtype=dtype, enabled=False), \
            StepWeightCasts(device_type, dtype):
        yield
