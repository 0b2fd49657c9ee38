"""Schedules: run the micro-batches of one step through every module on this rank.

``forward_backward_no_pipelining`` runs micro-batch by micro-batch: the encoders this
rank holds, the bridge to the language module, the language forward and loss, the
backward, and the gradients back across the bridge. Every rank walks the same edges in
the same order, so point-to-point transfers pair up without a barrier.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mimotron.pipeline.communicator import MultiModulePipelineCommunicator

LANGUAGE = "language"

# (model, language batch, received embeddings by module) -> (loss sum, tokens, metrics)
ForwardStepFunc = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class MicrobatchOutput:
    """What the language module produced for one micro-batch (language ranks only)."""

    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _mask(mb: dict[str, dict[str, torch.Tensor]], module: str, modality: str
          ) -> torch.Tensor | None:
    batch = mb.get(module)
    return None if batch is None else batch[f"has_{modality}"]


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    microbatches: list[dict[str, dict[str, torch.Tensor]]],
    model: torch.nn.Module,
    communicator: MultiModulePipelineCommunicator,
    loss_divisor: float,
    loss_scale: float = 1.0,
    forward_only: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> list[MicrobatchOutput]:
    """Forward (and backward) every micro-batch through the modules of this rank.

    Args:
        forward_step_func: the language step, ``f(model, batch, embeddings)``.
        microbatches: per micro-batch, this rank's batch slice of each module it holds.
        model: the ``MimoModel`` (holding only this rank's modules).
        communicator: transports encoder outputs and their gradients.
        loss_divisor: the global loss-token count of the step; each micro-batch's loss
            sum is divided by it before backward, so gradients are the global token mean.
        loss_scale: multiplies the loss before backward (fp16 dynamic scaling).
        forward_only: evaluation: no backward, no gradient transfers.
        autocast: context manager factory for mixed-precision compute.

    Returns:
        The language outputs per micro-batch (empty on ranks without the language module).
    """
    outputs: list[MicrobatchOutput] = []
    grad_ctx = torch.no_grad if forward_only else contextlib.nullcontext
    for mb in microbatches:
        with grad_ctx():
            out = _run_microbatch(forward_step_func, mb, model, communicator, loss_divisor,
                                  loss_scale, forward_only, autocast)
        if out is not None:
            outputs.append(out)
    return outputs


def _run_microbatch(forward_step_func, mb, model, communicator, loss_divisor, loss_scale,
                    forward_only, autocast) -> MicrobatchOutput | None:  # noqa: ANN001
    edges = communicator.edges
    # Forward: encoders, then the bridge, then the language module and its loss.
    enc_out: dict[str, torch.Tensor] = {}
    with autocast():
        for e in edges:
            if e.src in mb:
                enc_out[e.src] = model.encode(e.src, mb[e.src])
    received: dict[str, torch.Tensor | None] = {}
    for e in edges:
        received[e.src] = communicator.forward(
            e, enc_out.get(e.src), _mask(mb, e.src, e.modality), _mask(mb, e.dst, e.modality))
    result = None
    if LANGUAGE in mb:
        with autocast():
            loss_sum, num_tokens, metrics = forward_step_func(model, mb[LANGUAGE], received)
        result = MicrobatchOutput(loss_sum.detach().float(), num_tokens.detach(),
                                  {k: v.detach() for k, v in metrics.items()})
        if not forward_only:
            (loss_sum.float() * (loss_scale / loss_divisor)).backward()
    if forward_only:
        return result
    # Backward across the bridge: gradients of the received embeddings go home.
    for e in edges:
        communicator.backward(e, enc_out.get(e.src), received.get(e.src),
                              _mask(mb, e.src, e.modality), _mask(mb, e.dst, e.modality))
    return result
