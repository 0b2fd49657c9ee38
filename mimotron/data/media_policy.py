"""Which media a rank decodes: only those it encodes.

A rank reads the samples of its modules' slices of each micro-batch, but an image or a
clip is decoded only where an encoder's first stage encodes it. Two policies, set on a
LLaVA task by :func:`~mimotron.data.run_data.restrict_to_rank` as ``task.parts_at``:

- **By position** (:func:`media_policy`): where micro-batches are cut by position and a
  rank's modules slice them differently (colocated: vision DP 4 beside a language model
  DP 2 reads the language slice, twice the vision one), the sample at a stream position
  loads an encoder's media only where it falls in that encoder's slice. The stream and
  the prefetching reader load each position once, with its parts.
- **Deferred** (:class:`DeferredMedia`): where micro-batches are cut by work
  (``data.balance_encoders`` deals items by cost, ``data.balance_tokens`` permutes each
  global batch by length) which items a rank encodes is known only once the step's
  samples are read: their presence flags and, for native-resolution towers, their grids
  (read from image headers, without decoding). Every position first loads without the
  encoded media; the data provider then decodes, in a second read, the media of the
  samples holding an item the rank encodes
  (:meth:`~mimotron.training.balanced_batches.BalancedSplit.encoded_media`). A sample
  whose items go to two replicas is decoded on both (the unit of a read is a sample).

Packed rows keep every medium of the rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mimotron.config.schema import MimoConfig

if TYPE_CHECKING:  # an annotation only: the layout is built above the data
    from mimotron.parallel.layout import Layout

__all__ = ["DeferredMedia", "media_policy"]


@dataclass(frozen=True)
class DeferredMedia:
    """``parts_at`` of a run whose micro-batches are cut by work: every position loads
    ``base``; the ``deferred`` modalities are decoded later, only for the samples whose
    items the rank encodes.

    Attributes:
        base: what every position loads (text and presence flags, media not encoded here).
        deferred: modalities this rank encodes, decoded in a second read.
    """

    base: frozenset[str]
    deferred: frozenset[str]

    def __call__(self, position: int) -> frozenset[str]:
        """The parts position ``position`` loads in the first read (``base``)."""
        return self.base


def media_policy(cfg: MimoConfig, layout: Layout, rank: int, parts: frozenset[str]
                 ) -> Callable[[int], frozenset[str]] | None:
    """Which parts the sample at a stream position loads on ``rank``.

    Args:
        cfg: the run's config (micro-batch size, balancing, packing).
        layout: the placement (this rank's modules and replicas).
        rank: this global rank.
        parts: what the rank loads at all (``"text"``, modalities).

    Returns:
        :class:`DeferredMedia` where micro-batches are cut by work; a function of the
        position where positions map to slices and the rank's modules slice differently;
        ``None`` where every sample read is encoded (one slice), and for packed rows.
    """
    data = cfg.data
    if data.packing:
        return None
    encoded = _encoded_modalities(cfg, layout, rank, parts)
    if data.balance_tokens or data.balance_encoders:
        return DeferredMedia(parts - encoded, encoded) if encoded else None
    mbs = cfg.train.micro_batch_size
    slices, media = set(), {}
    for role in layout.roles(rank):
        module = cfg.modules[role.module]
        per = mbs // module.parallel.data
        span = (role.dp * per, (role.dp + 1) * per)
        slices.add(span)
        if module.is_encoder and role.is_first_stage and str(module.modality) in encoded:
            media[str(module.modality)] = span
    if len(slices) < 2 or not media:
        return None
    base = parts - set(media)

    def parts_at(position: int) -> frozenset[str]:
        offset = position % mbs  # steps start at multiples of the global batch
        return base | {m for m, (lo, hi) in media.items() if lo <= offset < hi}

    return parts_at


def _encoded_modalities(cfg: MimoConfig, layout: Layout, rank: int, parts: frozenset[str]
                        ) -> frozenset[str]:
    """The modalities of ``parts`` that an encoder's first stage on ``rank`` encodes."""
    return frozenset(str(cfg.modules[r.module].modality) for r in layout.roles(rank)
                     if cfg.modules[r.module].is_encoder and r.is_first_stage
                     and str(cfg.modules[r.module].modality) in parts)
