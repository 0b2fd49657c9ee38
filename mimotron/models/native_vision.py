"""A native-resolution vision tower (Qwen2.5-VL, Qwen3-VL) as one of the engine's encoders.

The engine moves every encoder's output as ``[n, T, W]``: one block of ``T`` rows per
present image, ``T`` fixed for the run, so pipeline links, the bridges between layouts and
the dry run know their shapes. A native-resolution image has its own token count, so
the block is a set of **slots** (:mod:`mimotron.config.native_vision`):

* in: ``[n, max_patches, patch_dim]`` patch rows (each image's ``t * h * w`` rows first,
  then zero rows) and each image's grid ``[n, 3]`` (``(t, h, w)``, on the host);
* the tower runs once on the real rows of all ``n`` images, as one flat sequence with a
  segment per frame / window (nothing padded reaches attention);
* out: ``[n, max_tokens, W]``, image ``i``'s ``t * h * w / merge**2`` merged tokens in its
  first slots and zeros after them. The language side keeps the first
  ``<modality>_tokens`` slots of each image (:func:`slot_rows`), so the zero slots get no
  gradient and never reach the model.

Qwen3-VL's DeepStack features (one ``[tokens, W]`` tensor per listed tower layer) travel
in the same block, concatenated after the final features along the width:
``W = out_hidden_size * (1 + num_deepstack)``; :func:`split_deepstack` parts them on the
language side. So one tensor still crosses each bridge, whatever the family.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mimotron.host_sync import host_copy

__all__ = ["NativeVisionSubmodule", "grid_key", "native_context_embeddings", "native_embeddings",
           "real_rows", "slot_mask",
           "slot_rows", "split_deepstack", "tokens_key"]


def grid_key(modality: str) -> str:
    """The batch key of a native-resolution modality's patch grids (``image_grid``)."""
    return f"{modality}_grid"


def tokens_key(modality: str) -> str:
    """The batch key of a native-resolution modality's token counts (``image_tokens``)."""
    return f"{modality}_tokens"


def slot_mask(tokens: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Bool ``[*tokens.shape, num_slots]``: which slots of each item hold a real token.

    Args:
        tokens: each item's token count (any shape, on any device).
        num_slots: slots per item.
    """
    return torch.arange(num_slots, device=tokens.device) < tokens.unsqueeze(-1)


def slot_rows(blocks: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The real rows of slot blocks, items in order: ``[sum(tokens), W]``.

    Args:
        blocks: ``[n, slots, W]``.
        tokens: ``[n]`` each item's real token count (``<= slots``), on ``blocks``' device.

    Returns:
        Item 0's first ``tokens[0]`` rows, then item 1's, ...: row-major order, the order
        of their placeholders in the text.
    """
    mask = slot_mask(tokens, blocks.shape[1])
    return blocks[mask]


def real_rows(blocks: torch.Tensor, present: torch.Tensor, counts: torch.Tensor | None
              ) -> torch.Tensor | None:
    """Where the real rows of slot blocks sit in ``blocks.reshape(-1, W)``, in order.

    Args:
        blocks: ``[n, slots, W]``, one block per present item.
        present: the slice's presence mask (``[B]`` or ``[B, K]``, host).
        counts: the slice's item token counts, shaped like ``present`` (host), or
            ``None`` for an encoder whose blocks are all real.

    Returns:
        Long ``[sum(counts)]`` flat row indices (``None`` where ``counts`` is).
    """
    if counts is None:
        return None
    items = counts[present.bool()].long()
    return slot_mask(items, blocks.shape[1]).flatten().nonzero().flatten().to(blocks.device)


def split_deepstack(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(features, deepstack)``: a native block's width cut into ``hidden``-wide parts."""
    parts = list(rows.split(hidden, dim=-1))
    return parts[0], parts[1:]


def native_embeddings(model: nn.Module, batch: dict[str, torch.Tensor],
                      embeds: dict[str, torch.Tensor], hidden: int
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
    """The language side of native-resolution modules: slot blocks to real rows.

    Every module whose modality has ``<modality>_tokens`` in the batch and whose
    embeddings arrived as ``[n, slots, W]`` blocks gets its real rows (:func:`slot_rows`),
    cut into the final features and any DeepStack features (:func:`split_deepstack`).

    Args:
        model: the ``MimoModel`` (its ``modality_of`` and ``placeholder_ids``).
        batch: the language micro-batch.
        embeds: module name -> what arrived for it.
        hidden: the language model's width.

    Returns:
        ``(embeds, counts, visual)``: the embeddings with native modules' real rows
        ``[N, hidden]``, their items' token counts (host; for
        :meth:`~mimotron.models.mimo.MimoModel.merge_embeddings`) and the language
        model's DeepStack arguments (``{}`` without DeepStack).
    """
    out, counts, visual = dict(embeds), {}, {}
    for name, blocks in embeds.items():
        modality = model.modality_of[name]
        if tokens_key(modality) not in batch or blocks.dim() != 3:
            continue
        present = host_copy(batch, f"has_{modality}").bool()
        items = host_copy(batch, tokens_key(modality)).long()
        counts[name] = torch.where(present, items, 0)
        rows = slot_rows(blocks, items[present].to(blocks.device))
        out[name], deepstack = split_deepstack(rows, hidden)
        if deepstack:
            tokens = host_copy(batch, "tokens")
            visual = {"deepstack": deepstack,
                      "visual_mask": tokens == model.placeholder_ids[name]}
    return out, counts, visual


def native_context_embeddings(model: nn.Module, batch: dict[str, torch.Tensor],
                              embeds: dict[str, torch.Tensor], hidden: int, held: torch.Tensor
                              ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`native_embeddings` on a context-parallel rank, whose rows are already
    the real ones of its placeholders (``[n_local, W]``, row-major order).

    The features are the first ``hidden`` columns. DeepStack's other columns are placed
    at their rows among *all* the visual positions of the whole rows (zeros at those
    other CP ranks hold), which is what the language model indexes with its positions.

    Args:
        model: the ``MimoModel``.
        batch: the language micro-batch (whole rows).
        embeds: module name -> this rank's rows.
        hidden: the language model's width.
        held: this CP rank's positions (host).
    """
    out, visual = dict(embeds), {}
    for name, rows in embeds.items():
        if tokens_key(model.modality_of[name]) not in batch or rows.shape[-1] == hidden:
            continue
        out[name], deepstack = split_deepstack(rows, hidden)
        mask = host_copy(batch, "tokens") == model.placeholder_ids[name]
        order = mask.flatten().cumsum(0).view_as(mask) - 1  # row of each visual position
        local = order[:, held][mask[:, held]].to(rows.device)
        whole = [part.new_zeros((int(mask.sum()), hidden)).index_copy(0, local, part)
                 for part in deepstack]
        visual = {"deepstack": whole, "visual_mask": mask}
    return out, visual


class NativeVisionSubmodule(nn.Module):
    """A Qwen-VL tower (merger included) behind the engine's fixed slots.

    Args:
        tower: :class:`~mimotron.models.hf.qwen25_vision.Qwen25VisionTower` or
            :class:`~mimotron.models.hf.qwen3_vision.Qwen3VisionTower` (the ``encoder``
            child, as the other encoders' towers are).
        max_tokens: token slots per image.

    Attributes:
        takes_grid: the engine hands :meth:`forward` each image's grid.
    """

    takes_grid = True

    def __init__(self, tower: nn.Module, max_tokens: int) -> None:
        super().__init__()
        self.encoder = tower
        self.projector = None  # the merger is the tower's
        self.max_tokens = max_tokens
        self.merge_unit = int(tower.spatial_merge_size) ** 2

    @property
    def pre_process(self) -> bool:
        """Whether this instance takes raw patches (a whole tower always does)."""
        return True

    @property
    def post_process(self) -> bool:
        """Whether this instance emits language-model embeddings."""
        return True

    @property
    def num_tokens(self) -> int:
        """Token slots per image (placeholders of the largest image)."""
        return self.max_tokens

    def forward(self, patches: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Slot blocks of the images' patch rows (see the module docstring).

        Args:
            patches: ``[n, max_patches, patch_dim]``.
            grid: ``[n, 3]`` integer ``(t, h, w)`` per image, on the host.

        Returns:
            ``[n, max_tokens, W]``.

        Raises:
            ValueError: a grid with more patches or tokens than the slots hold.
        """
        grid = grid.reshape(-1, 3).cpu()  # host arithmetic; a host copy costs nothing
        counts = [int(t * h * w) for t, h, w in grid.tolist()]
        num = len(counts)
        if any(c > patches.shape[1] for c in counts) or \
                any(c // self.merge_unit > self.max_tokens for c in counts):
            raise ValueError(f"image grids {grid.tolist()} need up to {max(counts)} patches, "
                             f"but the slots hold {patches.shape[1]} patches / "
                             f"{self.max_tokens} tokens (modules.<m>.max_pixels)")
        if num == 0:  # no image here: an empty block, still on the tower's graph
            # In the dtype a tower's output has here (autocast's), as the other ranks' blocks.
            kind = patches.device.type
            autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
            dtype = torch.get_autocast_dtype(kind) if autocast else patches.dtype
            return self._on_graph(patches.new_zeros((0, self.max_tokens, self._width()),
                                                    dtype=dtype))
        real = slot_mask(torch.tensor(counts), patches.shape[1]).to(patches.device)
        out = self.encoder(patches[real], grid)
        if not isinstance(out, torch.Tensor):  # Qwen3-VL: (features, deepstack)
            out = torch.cat([out[0], *out[1]], dim=-1)
        tokens = torch.tensor([c // self.merge_unit for c in counts])
        slots = slot_mask(tokens, self.max_tokens).to(out.device)
        blocks = out.new_zeros((num, self.max_tokens, out.shape[-1]))
        return blocks.masked_scatter(slots.unsqueeze(-1), out)

    def _on_graph(self, empty: torch.Tensor) -> torch.Tensor:
        """``empty`` made part of the trainable tower's autograd graph.

        Other ranks' images may have reached the bridge: its backward (a collective) runs
        on every rank only if every rank's output needs a gradient, as a tower run on no
        rows gives (the Qwen towers cannot run on an empty grid).
        """
        trainable = next((p for p in self.parameters() if p.requires_grad), None)
        return empty if trainable is None else empty + 0 * trainable.flatten()[:1].sum()

    def _width(self) -> int:
        """The output width: the merger's, times 1 + DeepStack layers."""
        deepstack = len(getattr(self.encoder, "deepstack", ()))
        return int(self.encoder.output_size) * (1 + deepstack)
