"""Micro-batches cut by work instead of by position (``data.balance_tokens``,
``data.balance_encoders``): the data provider's side of :mod:`mimotron.data.balance`.

Without balancing a DP replica takes a contiguous slice of each micro-batch, whatever is
in it. With ``balance_tokens`` each global batch is read whole and permuted
(:func:`~mimotron.data.balance.balanced_order`) so that every language DP replica gets
even tokens over the step; the slices then cut the permuted order, the same on every
rank. With ``balance_encoders`` every rank collates whole micro-batches, deals each
encoder's items of the whole step to its DP replicas by cost (each item staying in its
micro-batch), hands an encoder rank the items of its replica and the
language rank the replica and row of each of its items, which the bridge and
:func:`~mimotron.data.balance.in_item_order` use to bring each item's rows back to its
sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mimotron.config.schema import MimoConfig
from mimotron.data.balance import balanced_order, deal_step, encoder_items, item_costs, owner_keys
from mimotron.data.collate import Batch, Sample, slice_batch
from mimotron.data.packing import sample_length
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout

__all__ = ["Balance", "BalancedSplit"]


@dataclass(frozen=True)
class Balance:
    """What the data provider deals out by work.

    Attributes:
        tokens: permute each global batch for even language tokens per DP replica.
        encoders: encoder module -> ``(modality, hidden size)``, for each encoder whose
            items go to its DP replicas by cost.
        batched: ``train.encoder_batching`` (the deal evens whole steps, not each
            micro-batch: :func:`~mimotron.data.balance.deal_step`).
    """

    tokens: bool = False
    encoders: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    batched: bool = False
    """``train.encoder_batching``: a colocated rank encodes its whole step at once."""

    @classmethod
    def from_config(cls, cfg: MimoConfig) -> Balance:
        """The run's balancing (``data.balance_tokens``, ``data.balance_encoders``)."""
        encoders = {n: (str(cfg.modules[n].modality), cfg.modules[n].hidden_size)
                    for n in cfg.encoder_names} if cfg.data.balance_encoders else {}
        return cls(cfg.data.balance_tokens, encoders, cfg.train.encoder_batching)


class BalancedSplit:
    """How one rank reads a step's samples and cuts its modules' slices.

    Args:
        layout: the placement (DP degrees, this rank's replicas).
        rank: this global rank.
        micro_batch_size: samples (or rows) per micro-batch.
        balance: what is balanced.
    """

    def __init__(self, layout: Layout, rank: int, micro_batch_size: int, balance: Balance
                 ) -> None:
        self.tokens = balance.tokens
        self.encoders = dict(balance.encoders)
        self.mbs = micro_batch_size
        self.language_dp = layout.modules[LANGUAGE].parallel.data
        self.dp = {m: layout.modules[m].parallel.data for m in self.encoders}
        self.replica = {role.module: role.dp for role in layout.roles(rank)}
        self.per_step = balance.batched and layout.colocated

    def order(self, lengths: list[int], num_microbatches: int) -> list[int] | None:
        """The step's permutation of its units by tokens, or ``None`` (stream order)."""
        if not self.tokens:
            return None
        return balanced_order(lengths, self.language_dp, num_microbatches)

    def reader(self, sample_at: Any, start: int, num_microbatches: int,
               span: tuple[int, int]) -> Callable[[int], tuple[list[int], list[Sample]]]:
        """``f(j)``: the stream positions and samples of micro-batch ``j``'s ``span`` of
        the step at ``start``.

        Balancing tokens reads the global batch at once (its lengths decide the order).
        """
        lo, hi = span
        if not self.tokens:
            def contiguous(j: int) -> tuple[list[int], list[Sample]]:
                first = start + j * self.mbs + lo
                return list(range(first, first + hi - lo)), list(sample_at(first, hi - lo))
            return contiguous
        samples = list(sample_at(start, num_microbatches * self.mbs))
        order = self.order([sample_length(s) for s in samples], num_microbatches)
        assert order is not None

        def permuted(j: int) -> tuple[list[int], list[Sample]]:
            picked = order[j * self.mbs + lo:j * self.mbs + hi]
            return [start + i for i in picked], [samples[i] for i in picked]
        return permuted

    def encoded_media(self, batch: Batch, slices: dict[str, tuple[int, int]], lo: int,
                      owners: dict[str, list[int]], modalities: dict[str, str]
                      ) -> dict[int, frozenset[str]]:
        """Which media of a collated micro-batch this rank encodes, per sample.

        Args:
            batch: the collated samples of this rank's span (first sample ``lo``).
            slices: module -> its sample slice in the micro-batch.
            lo: the span's first sample.
            owners: the micro-batch's part of :meth:`deal` (``{}`` without balancing).
            modalities: encoder module -> the modality whose media this rank decodes for
                it (its first stage's).

        Returns:
            ``{sample in the span: modalities}`` for the samples holding an item this
            rank encodes: dealt to its replica, or in its module's slice.
        """
        out: dict[int, set[str]] = {}
        for module, modality in modalities.items():
            mask = batch[f"has_{modality}"].bool()
            if module in self.encoders:
                items = torch.nonzero(mask)[:, 0]  # the sample of every present item
                mine = torch.tensor(owners[module], dtype=torch.long) == self.replica[module]
                samples = items[mine].unique().tolist()
            else:
                s, e = slices[module]
                samples = [k for k in range(s - lo, e - lo) if bool(mask[k].any())]
            for k in samples:
                out.setdefault(int(k), set()).add(modality)
        return {k: frozenset(v) for k, v in out.items()}

    def deal(self, batches: list[Batch]) -> list[dict[str, list[int]]]:
        """The encoder replica of every item of a step, per micro-batch and encoder
        (:func:`~mimotron.data.balance.deal_step`; a replica takes at most as many items
        of one micro-batch as its slice has item slots, so what a forward holds stays
        within what position would give it).

        Args:
            batches: the step's collated micro-batches (whole: ``lo = 0``).

        Returns:
            Per micro-batch, ``{encoder: replica of each of its items, in item order}``.
        """
        out: list[dict[str, list[int]]] = [{} for _ in batches]
        for module, (modality, hidden) in self.encoders.items():
            costs = [item_costs(b, modality, hidden) for b in batches]
            # a slice's item slots (packed rows: K per row, K per micro-batch)
            slots = [b[f"has_{modality}"].numel() // self.dp[module] for b in batches]
            for j, owners in enumerate(deal_step(costs, self.dp[module], slots, self.per_step)):
                out[j][module] = owners
        return out

    def split(self, batch: Batch, slices: dict[str, tuple[int, int]], lo: int,
              owners: dict[str, list[int]]) -> dict[str, Batch]:
        """This rank's module batches of one collated micro-batch (samples from ``lo``).

        Args:
            batch: the collated samples of this rank's span.
            slices: module -> its sample slice in the micro-batch.
            lo: the span's first sample (0 where encoders are balanced: the whole).
            owners: the micro-batch's part of :meth:`deal` (``{}`` without balancing).
        """
        out = {name: slice_batch(batch, s - lo, e - lo) for name, (s, e) in slices.items()
               if name not in self.encoders}
        for module, (modality, _) in self.encoders.items():
            assert lo == 0, "balanced encoders read whole micro-batches"
            if module in slices:
                out[module] = encoder_items(batch, modality, owners[module],
                                            self.replica[module])
            if LANGUAGE in slices:
                s, e = slices[LANGUAGE]
                keys = owner_keys(batch[f"has_{modality}"], owners[module], modality)
                out[LANGUAGE] = {**out[LANGUAGE], **slice_batch(keys, s, e)}
        return out
