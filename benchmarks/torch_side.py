"""What a torch user's pipeline step does after the schedule, to match our optimizer.

Shared by the ``pipeline_vs_torch`` comparisons: AdamW over the rank's parameters with
the config's decay / no-decay groups, global gradient-norm clipping across the pipeline
stages (local squared norms, one ``all_reduce``, clip with ``optimizer.clip_grad``), the
logged loss summed over the ranks (in the same ``all_reduce``: the engine does both in
its one world collective too), and the check that both sides did the same math.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# A constant learning rate from the first step: the engine's scheduler and a plain AdamW
# then use the same lr, so the first step's weights can be compared.
CONSTANT_LR = ["scheduler.warmup_iters=0", "scheduler.decay_style=constant"]


def adamw(model: torch.nn.Module, cfg: Any) -> tuple[torch.optim.Optimizer, list[Any]]:
    """``torch.optim.AdamW`` over the rank's trainable parameters, decay groups as ours.

    Returns:
        ``(optimizer, parameters)``.
    """
    oc = cfg.optimizer
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if not any(s in n for s in oc.no_decay)]
    no_decay = [p for n, p in named if any(s in n for s in oc.no_decay)]
    groups = [{"params": ps, "weight_decay": wd}
              for ps, wd in ((decay, oc.weight_decay), (no_decay, 0.0)) if ps]
    opt = torch.optim.AdamW(groups, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps)
    return opt, [p for _, p in named]


class Finisher:
    """The end of a torch step: clip with the global norm, sum the loss, AdamW, zero.

    An object (not a closure) so the breakdown can time :meth:`apply` alone.
    """

    def __init__(self, opt: torch.optim.Optimizer, params: list[Any], clip: float,
                 clip_on: bool = True) -> None:
        self.opt, self.params, self.clip, self.clip_on = opt, params, clip, clip_on
        self.keep_grads = False  # set for the first step: the check compares gradients
        self.kept: list[torch.Tensor] = []

    def __call__(self, local_loss: float) -> float:
        """Finish the step; returns the world loss (``local_loss`` summed over ranks)."""
        return self.apply(local_loss)

    def apply(self, local_loss: float) -> float:
        """:meth:`__call__`'s work (an instance attribute the breakdown can wrap)."""
        if not self.clip_on:  # the old comparison: no clipping, no world reduction
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return local_loss
        with_grads = [p for p in self.params if p.grad is not None]
        sums = torch.zeros(2, dtype=torch.float64)
        for p in with_grads:
            sums[0] += p.grad.double().pow(2).sum()
        sums[1] = local_loss
        dist.all_reduce(sums)  # squared norm and loss, every rank
        norm = float(sums[0].sqrt())
        if self.clip > 0:
            # Takes the parameters (scales their .grad), as torch's clip_grad_norm_ does.
            torch.nn.utils.clip_grads_with_norm_(with_grads, self.clip, torch.tensor(norm))
        if self.keep_grads:
            self.kept = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                         for p in self.params]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(sums[1])


def assert_same_math(ours: torch.nn.Module, theirs: torch.nn.Module,
                     their_grads: list[torch.Tensor], what: str) -> int:
    """Both sides' clipped gradients and updated weights agree on this rank.

    Gradients: allclose everywhere. Weights: allclose where the gradient is above noise
    (``|g| > 1e-6``): AdamW's first update is ``lr * g / (|g| + eps)``, so a gradient at
    rounding level (``~eps``), e.g. exactly 0 on one side and 1e-9 on the other after a
    different summation order, moves its weight by up to ``lr`` either way.

    Returns:
        The number of weights left out of the comparison (noise-level gradients).

    Raises:
        AssertionError: a gradient or a weight differs.
    """
    a = [p for p in ours.parameters() if p.requires_grad]
    b = [p for p in theirs.parameters() if p.requires_grad]
    assert len(a) == len(b) == len(their_grads) and a, f"{what}: parameter lists differ"
    skipped = 0
    for i, (x, y, g) in enumerate(zip(a, b, their_grads, strict=True)):
        mine = torch.zeros_like(x) if x.grad is None else x.grad
        if not torch.allclose(mine, g, rtol=1e-4, atol=1e-7):
            raise AssertionError(f"{what}: gradient {i} differs after clipping (max abs "
                                 f"{float((mine - g).abs().max()):.3g}): not the same math")
        live = g.abs() > 1e-6
        skipped += int((~live).sum())
        if not torch.allclose(x.detach()[live], y.detach()[live], rtol=1e-4, atol=1e-6):
            err = float((x - y).detach()[live].abs().max())
            raise AssertionError(f"{what}: weight {i} differs after the first step "
                                 f"(max abs {err:.3g}): not the same math")
    return skipped


def first_step_check(ours_step: Callable[[], Any], torch_step: Callable[[], float],
                     finish: Finisher, ours: Any, theirs: Any, loss_rank: int,
                     what: str) -> tuple[float, float]:
    """Step both sides once; check gradients and weights; return both losses.

    Our loss lives on ``loss_rank``; torch's is the world sum every rank returns. The
    engine zeroes gradients at the start of a step, so ours are still there after it.
    """
    first = float(ours_step()["loss"])
    finish.keep_grads = True
    theirs_loss = torch_step()
    finish.keep_grads = False
    assert_same_math(ours.model, theirs.model, finish.kept, what)
    finish.kept = []
    ours_loss = torch.tensor([first if dist.get_rank() == loss_rank else 0.0])
    dist.all_reduce(ours_loss)
    return float(ours_loss), theirs_loss
