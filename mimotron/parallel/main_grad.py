"""16-bit model weights with fp32 gradient buffers (``main_grad``), as Megatron-Core.

A ZeRO-1 module trained in bf16 or fp16 (:class:`~mimotron.parallel.zero.ZeroShards`
with a ``param_dtype``) holds its parameters in that dtype, so autograd produces 16-bit
gradients. Summing micro-batches in 16 bits would round every partial sum; instead a
post-accumulate-grad hook adds each 16-bit ``.grad`` into an fp32 buffer kept on the
parameter as ``main_grad`` and releases the 16-bit one, so at most one 16-bit gradient
of a parameter is alive (the one autograd just accumulated) and the fp32 buffer holds
the exact fp32 sum of the micro-batches' 16-bit gradients.

Everything after the backward that reads a sharded module's gradients reads
:func:`grad_buffer`: the sequence-parallel all-reduce of norm weights, the ZeRO-1
reduce-scatter (which also flushes a ``.grad`` no hook has moved yet, so the order of
this hook and the overlapped reducer's hook on the same parameter does not matter).

A DTensor parameter's buffer is a DTensor of the same placements as the gradient it
was started from, in fp32 (its local tensor is the buffer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

MAIN_GRAD = "main_grad"
"""Attribute of a parameter holding its fp32 gradient buffer (``None`` when cleared)."""
_HOOKED = "_mimotron_main_grad_hook"
"""Attribute of a parameter holding its accumulation hook's handle (one per parameter)."""


def uses_main_grad(p: nn.Parameter) -> bool:
    """The parameter accumulates into an fp32 ``main_grad`` (see the module docstring)."""
    return _HOOKED in p.__dict__


def grad_buffer(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient the step reads: ``main_grad`` (after a flush) if used, else ``.grad``."""
    if not uses_main_grad(p):
        return p.grad
    accumulate_main_grad(p)
    return getattr(p, MAIN_GRAD, None)


def set_grad_buffer(p: nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient the step reads (``main_grad`` if used, else ``.grad``)."""
    if uses_main_grad(p):
        setattr(p, MAIN_GRAD, value)
    else:
        p.grad = value


def zeros_grad_buffer(p: nn.Parameter) -> torch.Tensor:
    """A zero gradient for a parameter that received none (fp32 for ``main_grad``)."""
    if uses_main_grad(p):
        return torch.zeros_like(p, dtype=torch.float32)
    return torch.zeros_like(p)


def accumulate_main_grad(p: nn.Parameter) -> None:
    """Add ``p.grad`` (16-bit) into ``p.main_grad`` (fp32) and release it; no-op without one.

    The first gradient of a step starts the buffer (a fresh fp32 copy); later ones are
    added in place when their placements match the buffer's (they do, except for a
    DTensor gradient of an empty input, which DTensor adds out of place as autograd's own
    accumulation would).
    """
    g = p.grad
    if g is None:
        return
    p.grad = None
    buf = getattr(p, MAIN_GRAD, None)
    if buf is None:
        setattr(p, MAIN_GRAD, g.to(torch.float32, copy=True))
    elif isinstance(buf, DTensor) and (not isinstance(g, DTensor)
                                       or tuple(buf.placements) != tuple(g.placements)):
        setattr(p, MAIN_GRAD, buf + g.to(torch.float32))
    else:
        buf.add_(g)  # in place: add_ promotes the 16-bit addend to fp32


def use_main_grad(p: nn.Parameter) -> None:
    """Make ``p`` accumulate into ``main_grad`` (idempotent: one hook per parameter)."""
    if uses_main_grad(p):
        return
    setattr(p, MAIN_GRAD, None)
    p.__dict__[_HOOKED] = p.register_post_accumulate_grad_hook(accumulate_main_grad)


def clear_main_grad(p: nn.Parameter) -> None:
    """Release the fp32 buffer (and a 16-bit ``.grad`` not yet moved into it)."""
    p.grad = None
    if uses_main_grad(p):
        setattr(p, MAIN_GRAD, None)


def cast_param_(p: nn.Parameter, dtype: torch.dtype) -> None:
    """Give ``p`` (a plain or DTensor parameter) storage of ``dtype``, keeping the object.

    The same ``Parameter`` object stays in the module, the optimizer's lists and every
    hook; its attributes (tensor-parallel marks) are kept. A DTensor parameter cannot
    take a ``.data`` of another dtype (its local tensor would keep the old one), so its
    contents are swapped with a converted copy, as ``nn.Module.to`` does.
    """
    if p.dtype == dtype:
        return
    if not isinstance(p, DTensor):
        p.data = p.data.to(dtype)
        return
    attrs = dict(p.__dict__)
    converted = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, converted)
    p.__dict__.update(attrs)
