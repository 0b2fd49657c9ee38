"""Qwen3-VL's DeepStack features across the language model's pipeline stages.

Decoder layer ``i < n`` adds DeepStack feature set ``i`` at the visual positions
(:mod:`mimotron.models.deepstack`). The features arrive with the tower's rows on the
first stage; a later stage whose layers include some of the first ``n`` gets them over
its stage link. The link into the (virtual) stage whose first layer is ``L`` carries,
after the hidden states, feature sets ``L .. n - 1``, each dense over the link's
positions with zeros off the visual ones: ``[B, S / c, H * (1 + max(0, n - L))]``.

Dense, not one row per visual position, because then:

* both ends know the link's shape from the config, so it keeps travelling without a
  shape header (:mod:`mimotron.pipeline.shapes`), whatever a micro-batch holds;
* context parallelism splits the features exactly as it splits the hidden states (each
  CP rank's link carries its own positions), and sequence parallelism needs nothing,
  since stages exchange whole sequences;
* the gradient of the features comes back over the same link, inside the gradient of
  the stage's input, down to the first stage and from there over the bridge.

The cost is ``(n - L) H`` values per position on the links before layer ``n`` and none
after it: with Qwen3-VL's three DeepStack layers a link carries at most 3 extra widths,
and only a pipeline whose first stage holds fewer than three layers pays anything.
A receiving stage turns its dense features back into the rows the language model takes
(:func:`feature_rows`), so the model has one DeepStack contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mimotron.host_sync import host_copy
from mimotron.models.deepstack import add_visual, visual_rows

__all__ = ["DeepStackLink", "carried", "deepstack_link", "dense_features", "feature_rows",
           "link_extras", "model_link_extras", "rank_chunks"]


def carried(num_deepstack: int, first_layer: int) -> int:
    """Feature sets the link into a stage whose first layer is ``first_layer`` carries."""
    return max(0, num_deepstack - first_layer)


def link_extras(num_deepstack: int, chunks: Sequence[Sequence[int]]
                ) -> dict[tuple[int, bool], int]:
    """``(chunk, downstream) -> feature sets`` of each stage link of one pipeline rank.

    Args:
        num_deepstack: the language layers that take DeepStack features.
        chunks: the global layer indices of each model chunk the rank holds (one chunk
            without interleaving).

    Returns:
        For chunk ``j``: its input link (``downstream=False``) carries the sets from its
        first layer on; its output link (``True``) those after its last layer.
    """
    out = {}
    for j, layers in enumerate(chunks):
        out[(j, False)] = carried(num_deepstack, layers[0])
        out[(j, True)] = carried(num_deepstack, layers[-1] + 1)
    return out


def dense_features(features: torch.Tensor, visual_mask: torch.Tensor,
                   held: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """One feature set ``[num visual, H]`` (row-major order) spread over ``like``'s
    ``[B, S_held, H]`` positions: its rows at the visual ones, zeros elsewhere.

    Args:
        features: the set's rows (under context parallelism, every visual position's,
            zeros at those other CP ranks hold).
        visual_mask: bool ``[B, S]`` of the visual positions, whole rows (host).
        held: the positions along dim 1 this rank holds (``None``: all of them).
        like: the hidden states whose shape, dtype and device the result takes.
    """
    rows = visual_rows(visual_mask, [features], tuple(visual_mask.shape), like.device, held)
    return add_visual(torch.zeros_like(like), features, rows)


def feature_rows(dense: torch.Tensor, visual_mask: torch.Tensor,
                 held: torch.Tensor | None) -> torch.Tensor:
    """The inverse of :func:`dense_features`: the ``[num visual, H]`` rows of one dense
    feature set (zeros at the visual positions other CP ranks hold)."""
    mask = visual_mask.bool()
    order = mask.flatten().cumsum(0).view_as(mask) - 1  # feature row of each position
    num_visual = int(mask.sum())
    if held is not None:
        held = held.to(mask.device)
        mask, order = mask[:, held], order[:, held]
    rows, cols = mask.nonzero(as_tuple=True)
    values = dense[rows.to(dense.device), cols.to(dense.device)]
    if held is None:  # every position here: already in row-major order
        return values
    which = order[rows, cols].to(dense.device)
    return dense.new_zeros(num_visual, dense.shape[-1]).index_put((which,), values)


class DeepStackLink:
    """What one language pipeline rank puts on and takes off its stage links.

    Args:
        num_deepstack: the language layers that take DeepStack features.
        placeholder_id: the token id of the visual positions (the tower's module).
        chunks: the global layer indices of each model chunk this rank holds.
    """

    def __init__(self, num_deepstack: int, placeholder_id: int,
                 chunks: Sequence[Sequence[int]]) -> None:
        self.num_deepstack, self.placeholder_id = num_deepstack, placeholder_id
        self.chunks = [list(c) for c in chunks]
        self.extras = link_extras(num_deepstack, self.chunks)

    def _mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return host_copy(batch, "tokens") == self.placeholder_id

    def stage_input(self, lm: nn.Module, batch: dict[str, torch.Tensor],
                    received: torch.Tensor, chunk: int
                    ) -> tuple[torch.Tensor, dict[str, Any], list[torch.Tensor | None]]:
        """``(hidden states, the model's DeepStack arguments, dense sets by layer)`` of a
        received stage input (a later stage's)."""
        extra = self.extras[(chunk, False)]
        dense: list[torch.Tensor | None] = [None] * self.num_deepstack
        if extra == 0:
            return received, {}, dense
        hidden, *sets = received.chunk(1 + extra, dim=-1)
        dense[self.num_deepstack - extra:] = sets
        mask = self._mask(batch)
        held = lm.context_positions(mask.shape[1], torch.device("cpu"))
        mine = set(self.chunks[chunk])
        rows = [None if i not in mine or d is None else feature_rows(d, mask, held)
                for i, d in enumerate(dense)]
        return hidden, {"deepstack": rows, "visual_mask": mask}, dense

    def stage_output(self, lm: nn.Module, out: torch.Tensor, visual: dict[str, Any],
                     dense: list[torch.Tensor | None], chunk: int) -> torch.Tensor:
        """A stage's output with the feature sets its output link carries appended:
        passed on as received, or spread from the rows (the first stage's) at the
        visual positions the stage's input came with; zeros for a micro-batch without
        visual positions."""
        extra = self.extras[(chunk, True)]
        if extra == 0:
            return out
        rows, mask = visual.get("deepstack") or [], visual.get("visual_mask")
        held = None if mask is None else lm.context_positions(mask.shape[1], torch.device("cpu"))
        sets = []
        for i in range(self.num_deepstack - extra, self.num_deepstack):
            passed = dense[i] if i < len(dense) else None
            if passed is not None:
                sets.append(passed.to(out.dtype))
            elif i < len(rows) and rows[i] is not None:
                sets.append(dense_features(rows[i], mask, held, out))
            else:
                sets.append(torch.zeros_like(out))
        return torch.cat([out, *sets], dim=-1)


def rank_chunks(lm: nn.Module) -> list[list[int]]:
    """The global layer indices of each model chunk a language model part holds."""
    return ([list(c) for c in lm.layer_chunks] if lm.layer_chunks is not None
            else [list(map(int, lm.layers))])


def deepstack_link(model: nn.Module) -> DeepStackLink | None:
    """The link of a pipelined language model part that takes DeepStack features
    (``MimoModel.deepstack``); ``None`` for any other, or a whole language model."""
    lm, source = model.language_model, getattr(model, "deepstack", None)
    if lm is None or source is None or (lm.pre_process and lm.post_process
                                          and lm.layer_chunks is None):
        return None
    name, num = source
    return DeepStackLink(num, model.placeholder_ids[name], rank_chunks(lm))


def model_link_extras(model: nn.Module) -> dict[tuple[int, bool], int] | None:
    """:func:`link_extras` of this rank's language model part (``None``: no DeepStack
    crosses its links), for the communicator's link shapes."""
    link = deepstack_link(model)
    return None if link is None else link.extras
