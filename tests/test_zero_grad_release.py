"""ZeRO-1 with 16-bit weights holds one fp32 gradient copy, not two, across steps.

The fragments' ``.grad`` view this rank's rows of the fp32 ``main_grad`` buffers
(:mod:`mimotron.parallel.zero`), and a view keeps its whole buffer alive. If a step's
fragment gradients outlived it, every later backward would hold the previous step's
``main_grad`` next to its own: 4 more bytes per parameter at the peak (25 GiB on
Llama-2-7B), which ``mimotron plan`` does not count. Measured here on the digits model,
two gloo ranks, every module ZeRO-1 in bf16 (the language model fully recomputed): at
the end of the second step's backward no storage of the first step's gradients is
alive, and the ``main_grad`` buffers alive are exactly 4 bytes per parameter.
"""

from __future__ import annotations

import weakref
from typing import Any
from unittest import mock

import torch
from torch.distributed.tensor import DTensor

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.main_grad import MAIN_GRAD
from mimotron.parallel.zero import ZeroShards
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE, DIGITS, colocated, train_step

ZERO_BF16 = [*colocated(2), "train.precision=bf16", "modules.language.recompute=full",
             *(f"modules.{m}.parallel.shard_optimizer=true"
               for m in ("vision", "audio", "language"))]


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def _grad_storages(zero: Any) -> list[torch.UntypedStorage]:
    """The storages of a module's fp32 gradients: its ``main_grad`` buffers and whatever
    its fragments' gradients keep alive (views of those buffers, after a step)."""
    params = [zero.model_param(n) for n, _ in zero.fragments]
    held = [getattr(p, MAIN_GRAD) for p in params] + [f.grad for _, f in zero.fragments]
    return [_storage(t) for t in held if t is not None]


def _two_steps(rank: int, world: int) -> dict[str, int]:
    run = setup_mimo(load_config(DIGITS, BASE + ZERO_BF16), init_runtime())
    zeros = [info.zero for info in run.optimizer.module_infos.values() if info.zero is not None]
    train_step(run)
    first = {id(s): (weakref.ref(s), s.nbytes()) for z in zeros for s in _grad_storages(z)}
    seen = {"first_step_alive": 0, "main_grad": 0, "params": 0, "first_step": 0}
    seen["first_step"] = sum(n for _, n in first.values())
    reduce_grads = ZeroShards.reduce_grads

    def after_backward(self: ZeroShards) -> None:
        # Called once per module when the step's backward is over, before its reduction.
        seen["first_step_alive"] += sum(n for ref, n in first.values() if ref() is not None)
        params = [self.model_param(n) for n, _ in self.fragments]
        seen["main_grad"] += sum(_storage(getattr(p, MAIN_GRAD)).nbytes() for p in params)
        seen["params"] += sum(p.numel() for p in params)
        reduce_grads(self)

    with mock.patch.object(ZeroShards, "reduce_grads", after_backward):
        train_step(run)
    return seen


def test_second_backward_holds_one_fp32_gradient_copy() -> None:
    for rank, seen in enumerate(run_ranks(2, _two_steps, timeout_s=180)):
        assert seen["first_step"] > 0, (rank, seen)  # the first step made fp32 gradients
        assert seen["first_step_alive"] == 0, (rank, seen)
        assert seen["main_grad"] == 4 * seen["params"] > 0, (rank, seen)
