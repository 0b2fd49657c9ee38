"""Activation bytes as autograd saves them, for the memory-estimate tests.

The real modules run forward (and the language loss) for 3 and 2 samples while
``saved_tensors_hooks`` records each distinct non-parameter storage once; the
difference is one sample's bytes, what ``activation_bytes(in_flight=1)`` estimates per
sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mimotron.estimate.memory import activation_bytes
from mimotron.models.build import build_module
from mimotron.models.language import language_loss

VOCAB = 64
SEQ = 64


def saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while ``run()`` runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(storages.values())


def saved_inside(tower: torch.nn.Module, run: Callable[[], Any]) -> int:
    """Bytes autograd saves while ``tower``'s forward runs, over ``run()``."""
    inside = [False]
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and not isinstance(t, torch.nn.Parameter):
            total[0] += t.untyped_storage().nbytes()
        return t

    handles = [tower.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
               tower.register_forward_hook(lambda *_: inside.__setitem__(0, False))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    return total[0]


def per_sample(module: torch.nn.Module, make_input: Callable[[int], torch.Tensor],
               precision: str, loss: bool) -> int:
    """Saved bytes per sample: ``saved(3 samples) - saved(2 samples)``.

    (Not 2 - 1: with one sample some reshapes are views that copy for more.)
    """
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
           else torch.autocast("cpu", enabled=False))

    def run(n: int) -> torch.Tensor:
        x = make_input(n)
        with ctx:
            out = module(x)
            if loss:
                labels = torch.zeros(n, SEQ, dtype=torch.long)
                out = language_loss(out, labels, torch.ones(n, SEQ))[0]
        return out

    return saved_bytes(lambda: run(3)) - saved_bytes(lambda: run(2))


def language_bytes_per_sample(cfg: Any, precision: str) -> tuple[int, float]:
    """``(measured, estimated)`` activation bytes per sample of the config's language model
    (what autograd saves through a forward with the loss; ``activation_bytes``)."""
    torch.manual_seed(0)
    lm = build_module(cfg, "language", VOCAB)
    measured = per_sample(lm, lambda n: torch.randn(n, SEQ, 128, requires_grad=True),
                          precision, loss=True)
    samples = cfg.train.micro_batch_size // cfg.modules["language"].parallel.data
    return measured, activation_bytes(cfg, "language", VOCAB, in_flight=1) / samples


class LargestOutputs(TorchDispatchMode):
    """The largest element count of any operator output (forward and backward) while
    the mode is on: how the attention tests show no ``[S, S]`` tensor is made."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, str] = (0, "")

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), f"{func}: {tuple(t.shape)}")
        return out
