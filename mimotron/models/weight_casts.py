"""One 16-bit copy of each weight per step, with a fresh autograd node in every use.

Under autocast a matmul's fp32 weight is cast to the compute dtype. Keeping autocast's
own cast cache for the whole step (one copy per weight instead of one per micro-batch
in flight) would share one cast *node* between the micro-batches too: it is created in
the first micro-batch's forward, so in every later micro-batch's backward it is older
than the whole graph, and autograd, which runs ready nodes newest first, leaves it to
the very end. Each layer's 16-bit weight gradient then waits in its input buffer until
the micro-batch's backward is over: every layer's at once (2.2 GiB for the 11 layers of
a Llama-2-70B pipeline stage at TP 8).

:class:`StepWeightCasts` keeps the cast *values* for the step and hands each use its
own node instead: a ``TorchFunctionMode`` that, while autocast is on for its device,
gives ``F.linear`` and the convolutions a 16-bit weight (or bias) from
:class:`_CastWeight`, whose forward returns the step's copy and whose backward casts the
incoming 16-bit gradient to the weight's dtype, as autocast's cast would. The node is
made in the micro-batch's forward, next to the matmul that reads it, so it runs as soon
as that matmul's backward has, and the weight's gradient reaches its fp32 ``.grad``
(or ``main_grad``) layer by layer. The values are the ones autocast computes (the same
``.to``), so nothing changes in any number.

Autograd does not carry torch-function modes into the backward, where a recomputed
layer (:mod:`mimotron.models.recompute`) runs its forward again: the checkpoint enters
:func:`recompute_casts` around the recomputation, the step's casts again, so the
recomputed matmuls read the same copies (autocast would otherwise cast each weight a
second time and keep that copy in its own cache for the rest of the step).

What it casts is what autocast caches: fp32 parameters that require a gradient, on the
autocast device. Frozen weights (cast per use and never saved) and 16-bit parameters
(ZeRO-1's bf16 weights, FSDP2's unsharded ones) are left to autocast. Other ops that
read a parameter directly (an MoE expert's slice is not a leaf) are not cached by
autocast either.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

# Functions autocast runs in the compute dtype that take a module's weight (and bias) as
# they are: nn.Linear's and the convolutions'.
_CAST_FUNCTIONS = frozenset({F.linear, F.conv1d, F.conv2d, F.conv3d})


class _CastWeight(torch.autograd.Function):
    """The step's 16-bit copy of ``weight`` as a new node; backward: to ``weight``'s dtype."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, held: tuple[torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
        ctx.dtype = weight.dtype
        # A new tensor object over the copy's storage: autograd gives it this node.
        return held[0].detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad.to(ctx.dtype), None


class StepWeightCasts(TorchFunctionMode):
    """Within one training step: each weight cast to 16 bits once, a fresh node per use.

    Args:
        device_type: the autocast device type the forwards run under.
        dtype: the compute dtype (bf16 / fp16).
    """

    def __init__(self, device_type: str, dtype: torch.dtype,
                 copies: dict[int, tuple[nn.Parameter, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.device_type = device_type
        self.dtype = dtype
        # The step's scope owns the copies (drops them on exit); a recomputation's shares them.
        self._owner = copies is None
        # id(parameter) -> (parameter, its 16-bit copy); the parameter is held so that its
        # id is not reused during the step.
        self._copies: dict[int, tuple[nn.Parameter, torch.Tensor]] = {} if copies is None \
            else copies

    def shared(self) -> StepWeightCasts:
        """Another mode over the same copies, which leaves them alone on exit."""
        return StepWeightCasts(self.device_type, self.dtype, self._copies)

    def _eligible(self, t: Any) -> bool:
        """A parameter autocast would cast once and cache (see the module docstring)."""
        return (isinstance(t, nn.Parameter) and t.dtype == torch.float32 and t.requires_grad
                and t.is_leaf and t.device.type == self.device_type)

    def _cast(self, param: nn.Parameter) -> torch.Tensor:
        """``param`` in the compute dtype, behind a node of its own (module docstring)."""
        held = self._copies.get(id(param))
        if held is None:
            with torch.no_grad():
                held = (param, param.to(self.dtype))
            self._copies[id(param)] = held
        return _CastWeight.apply(param, (held[1],))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        # Every torch call of the step comes through here: the common case returns at once.
        if (func in _CAST_FUNCTIONS and torch.is_autocast_enabled(self.device_type)
                and torch.get_autocast_dtype(self.device_type) == self.dtype):
            args = tuple(self._cast(a) if self._eligible(a) else a for a in args)
            kwargs = {k: self._cast(v) if self._eligible(v) else v for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        # The copies go with the step, before the optimizer changes the weights.
        if self._owner:
            self._copies.clear()
        super().__exit__(*exc)


def recompute_casts() -> contextlib.AbstractContextManager:
    """For a checkpoint's recomputation: the step's casts active now, entered again then.

    Call it in the forward (a checkpoint's ``context_fn`` is called there); enter the
    result around the recomputation. A no-op context outside a step's casts.
    """
    from torch.overrides import _get_current_function_mode_stack

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, StepWeightCasts):
            return mode.shared()
    return contextlib.nullcontext()
