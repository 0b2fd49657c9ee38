"""Colocated encoder batching: each encoder runs the whole step in one forward and one backward.

With ``train.encoder_batching = true`` in a colocated placement, a step's encoder work is
reordered (the idea of FlagScale's colocated MIMO scheduler):

* forward — before the first micro-batch, each encoder runs ONCE on the step's
  micro-batches concatenated along the batch dim (its modality input and presence mask;
  the encoder sees only present samples, so the output is the micro-batches' rows one
  after the other). The output is cut back into one piece per micro-batch, and each
  piece is detached into a *leaf* that requires grad;
* per micro-batch — the language side (colocated bridge, language forward, loss,
  backward) consumes micro-batch ``k``'s leaf exactly as it consumed ``encode(mb_k)``
  before; its backward stops at the leaf, which collects the gradient of its rows;
* backward — after the last micro-batch's backward, each encoder runs ONE backward from
  its output with the leaves' gradients concatenated (zeros for a leaf nothing reached).

Fewer, larger encoder kernels; the same mathematics (the encoder's parameter gradient
is the same sum over micro-batches, summed inside one matmul instead of across
backwards, so results agree to rounding, not bitwise). The cost is memory: the whole
step's encoder activations are alive at once (``mimotron plan`` multiplies the encoders'
activation estimate by the number of micro-batches).

Collectives stay in the same order on every rank: every rank batches the same encoders
at the same point (the first forward) and runs their backwards in the same (edge)
order after the same micro-batch, and ranks of one encoder TP group hold the same slice,
so they agree on every shape (an encoder slice without a sample of its modality runs a
zero-row forward and backward, as without batching).

With ``train.overlap_grad_reduce`` the step's grad sync is armed before the last micro-batch's
backward (:meth:`~mimotron.pipeline.schedules.StageRunner.backward`), which comes
before :meth:`BatchedEncoders.backward`: the encoders' gradients land once, after
arming, so each encoder bucket launches when the single encoder backward fills it
(beside a pipelined language model the encoders are not armed: their buckets wait for
the step's end, :mod:`mimotron.pipeline.colocated_pipeline`).
Frozen encoders produce outputs that need no gradient: no leaf, no backward. In
evaluation (``forward_only``) the forward is batched the same way under ``no_grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mimotron.host_sync import HOST, host_copy
from mimotron.models.native_vision import grid_key
from mimotron.pipeline.edges import Edge

Batch = dict[str, torch.Tensor]


def concat_encoder_inputs(batches: Sequence[Batch], modality: str) -> dict[str, Any]:
    """One encoder's inputs of all micro-batches as one batch (pure).

    Packed rows (``data.packing``) hold ``[B, K, ...]`` media with a ``[B, K]`` mask whose
    ``K`` (most items in a row) differs between micro-batches: each is padded to the
    largest ``K`` with absent items at the end of its rows, which keeps the present
    items in the same (row-major) order.

    Args:
        batches: the encoder's slice of each micro-batch, in micro-batch order.
        modality: the encoder's batch key (``"image"``); ``has_<modality>`` is its mask.

    Returns:
        ``{modality: ..., has_<modality>: ...}``, concatenated along dim 0; also the
        masks' host copies under :data:`~mimotron.host_sync.HOST` where every batch
        keeps one (the encoder then gathers its rows with no device sync).
    """
    key = f"has_{modality}"
    inputs = [b[modality] for b in batches]
    masks = [b[key] for b in batches]
    hosts = [host_copy(b, key) for b in batches]
    if not all(h is not m for h, m in zip(hosts, masks, strict=True)):
        hosts = []  # some batch keeps none: the encoder reads the device mask
    if masks and masks[0].dim() > 1:
        k = max(m.shape[1] for m in masks)
        inputs, masks = [_pad_items(x, k) for x in inputs], [_pad_items(m, k) for m in masks]
        hosts = [_pad_items(m, k) for m in hosts]
    out: dict[str, Any] = {modality: torch.cat(inputs), key: torch.cat(masks)}
    if hosts:
        out[HOST] = {key: torch.cat(hosts)}
    grid = grid_key(modality)  # native resolution: each image's patch grid, on the host
    if batches and grid in batches[0]:
        grids = [host_copy(b, grid) for b in batches]
        if masks[0].dim() > 1:
            grids = [_pad_items(g, masks[0].shape[1]) for g in grids]
        out[grid] = torch.cat(grids)
    return out


def _pad_items(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` with dim 1 zero-padded (absent, for a bool mask) to ``k``."""
    if t.shape[1] == k:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], k - t.shape[1], *t.shape[2:]))], 1)


def rows_per_microbatch(model: torch.nn.Module, name: str, batches: Sequence[Batch]
                        ) -> list[int]:
    """Encoder output rows of each micro-batch: its present samples (packed: items).

    Counted on the batches' host copies where they keep them (no sync); otherwise one
    host sync for all micro-batches (the split sizes are host ints anyway).
    """
    counts = [model.host_present_mask(name, b).sum() for b in batches]
    return [int(n) for n in torch.stack(counts).tolist()] if counts else []


class BatchedEncoders:
    """The step's encoder outputs, computed in one forward per encoder (see module docs).

    Args:
        model: the colocated ``MimoModel`` (every encoder on this rank).
        edges: the colocated edges, one per encoder, in the transport's order.
        microbatches: the step's micro-batches on this rank.
    """

    def __init__(self, model: torch.nn.Module, edges: Sequence[Edge],
                 microbatches: Sequence[dict[str, Batch]]) -> None:
        self.model = model
        self.edges = list(edges)
        self.microbatches = microbatches
        self._outputs: dict[str, torch.Tensor] = {}
        self._leaves: dict[str, list[torch.Tensor]] = {}

    @property
    def ran(self) -> bool:
        """Whether the batched forward has run this step."""
        return bool(self._leaves)

    def forward(self) -> None:
        """Run every encoder once on the concatenated micro-batches (under the caller's
        autocast and grad mode) and cut the output into per-micro-batch leaves."""
        for e in self.edges:
            batches = [mb[e.src] for mb in self.microbatches]
            out = self.model.encode(e.src, concat_encoder_inputs(batches, e.modality))
            pieces = out.split(rows_per_microbatch(self.model, e.src, batches))
            needs_grad = out.requires_grad
            self._leaves[e.src] = [p.detach().requires_grad_(needs_grad) for p in pieces]
            if needs_grad:
                self._outputs[e.src] = out  # keeps the encoder's graph for backward

    def rows(self, name: str, k: int) -> torch.Tensor:
        """Encoder ``name``'s output rows of micro-batch ``k`` (a leaf; forward first)."""
        if not self.ran:
            self.forward()
        return self._leaves[name][k]

    def backward(self) -> None:
        """One backward per trainable encoder with its leaves' gradients, in edge order.

        Called once, after the last micro-batch's backward; releases the step's graphs.
        """
        for e in self.edges:
            out = self._outputs.pop(e.src, None)
            leaves = self._leaves.pop(e.src)
            if out is None:  # frozen: nothing to do
                continue
            grad = torch.cat([leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                              for leaf in leaves])
            out.backward(grad)
        self._leaves.clear()
