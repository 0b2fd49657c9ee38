"""``MimoModel``: modality encoders whose outputs replace placeholder tokens in the LM input.

A sample's text holds, for each modality it carries, exactly ``T`` placeholder tokens
(``T`` = the encoder's output tokens); :meth:`MimoModel.merge_embeddings` overwrites
those positions, in order, with the projected encoder outputs. The pieces stay separate
(``encode`` / ``merge_embeddings`` / the language model) because the distributed engine
runs them on different ranks and moves tensors between them; ``forward`` strings them
together for the single-process reference.

A rank may hold only some modules (non-colocated layouts): ``language_model`` may be
``None`` and ``modality_submodules`` may lack entries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mimotron.host_sync import host_copy
from mimotron.models.attention import document_args
from mimotron.models.encoders import ModalitySubmodule
from mimotron.models.language import LanguageModel, language_loss
from mimotron.models.native_vision import grid_key, native_embeddings
from mimotron.names import LANGUAGE

Batch = dict[str, torch.Tensor]


class MimoModel(nn.Module):
    """Multi-module model: modality submodules plus a language model.

    Args:
        modality_submodules: module name (``"vision"``) -> encoder + projector present on
            this rank.
        language_model: the decoder, or ``None`` if this rank does not hold it.
        placeholder_ids: module name -> the token id of its placeholder, for EVERY
            encoder module of the model (also those held elsewhere).
        modality_of: module name -> batch key of its input (``"image"``, ``"audio"``).
        language_tp_group: the language model's tensor-parallel group when its logits
            are vocabulary-sharded (TP > 1), so the loss can combine the shards;
            ``None`` for TP 1 or where this rank holds no language model.

    Raises:
        ValueError: if a held module has no placeholder id or modality.
    """

    adapters_only: tuple[str, ...] = ()
    """Parameter prefixes of the LoRA modules whose base stays in their folder: their
    checkpoint entries are the adapters only (:mod:`mimotron.checkpoint.lora_base`)."""

    deepstack: tuple[str, int] | None = None
    """Qwen3-VL: ``(vision module, layers)`` whose DeepStack features the language model's
    first ``layers`` layers add; set by the engine's build, so a pipelined language model
    carries them across its stages (:mod:`mimotron.pipeline.deepstack_link`)."""

    def __init__(
        self,
        modality_submodules: dict[str, ModalitySubmodule],
        language_model: LanguageModel | None,
        placeholder_ids: dict[str, int],
        modality_of: dict[str, str],
        language_tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        missing = [
            n for n in modality_submodules if n not in placeholder_ids or n not in modality_of
        ]
        if missing:
            raise ValueError(
                f"modules {missing} need entries in placeholder_ids {placeholder_ids} and "
                f"modality_of {modality_of}"
            )
        self.modality_submodules = nn.ModuleDict(modality_submodules)
        self.language_model = language_model
        self.placeholder_ids = dict(placeholder_ids)
        self.modality_of = dict(modality_of)
        self.language_tp_group = language_tp_group

    def present_mask(self, name: str, batch: Batch) -> torch.Tensor:
        """Bool ``[B]``: which samples carry module ``name``'s modality."""
        return batch["has_" + self.modality_of[name]].bool()

    def host_present_mask(self, name: str, batch: Batch) -> torch.Tensor:
        """:meth:`present_mask` from the batch's host copy where it keeps one
        (:func:`~mimotron.host_sync.host_copy`): counts of it read no device value."""
        return host_copy(batch, "has_" + self.modality_of[name]).bool()

    def encode(self, name: str, batch: Batch, chunk: int | None = None) -> torch.Tensor:
        """Run module ``name`` on the samples that carry its modality.

        Args:
            name: module name, e.g. ``"vision"``.
            batch: a batch dict (see :mod:`mimotron.models`).
            chunk: interleaved pipelines: the model chunk to run (0 on the first stage).

        Returns:
            ``[n_present, T, lm_hidden]`` (``n_present`` may be 0).

        Raises:
            ValueError: if this rank does not hold the module.
        """
        if name not in self.modality_submodules:
            raise ValueError(
                f"module {name!r} is not held on this rank (have "
                f"{sorted(self.modality_submodules)})"
            )
        mask, host_mask = self.present_mask(name, batch), self.host_present_mask(name, batch)
        inputs = present_rows(batch[self.modality_of[name]], mask, host_mask)
        sub = self.modality_submodules[name]
        if getattr(sub, "takes_grid", False):  # native resolution: each image's patch grid
            grid = host_copy(batch, grid_key(self.modality_of[name]))
            return sub(inputs, present_rows(grid, host_mask, host_mask))
        if chunk is None:
            return sub(inputs)
        return sub(inputs, chunk=chunk)

    def merge_embeddings(
        self,
        tokens: torch.Tensor,
        token_embeds: torch.Tensor,
        modality_embeds: dict[str, torch.Tensor],
        present: dict[str, torch.Tensor],
        host_tokens: torch.Tensor | None = None,
        counts: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Replace each module's placeholder positions by its embeddings.

        Args:
            tokens: ``[B, S]`` token ids.
            token_embeds: ``[B, S, H]`` text embeddings.
            modality_embeds: module name -> ``[n_present, T, H]``, rows in batch order of
                the samples where ``present[name]`` is True (``[0, T, H]`` if none).
            present: module name -> bool ``[B]`` (``[B, K]`` for packed rows: several
                items per row, in the order of their placeholders).
            host_tokens: ``tokens`` on the host (the batch's host copy), if the caller
                has it: the checks then count placeholders there, with no device sync
                (give ``present`` on the host too).
            counts: native-resolution modules (:mod:`mimotron.models.native_vision`):
                module name -> each item's token count, shaped like ``present`` (on the
                host); that module's embeddings are then the real rows ``[N, H]`` of
                its items, in order (:func:`~mimotron.models.native_vision.slot_rows`).

        Returns:
            ``[B, S, H]``; gradients flow into both ``token_embeds`` and the modality
            embeddings.

        Raises:
            ValueError: if a sample's placeholder count is not ``T`` where present and 0
                where absent, if rows and present samples disagree, or if placeholders
                of a module without embeddings occur.
        """
        # The checks read values: on the host copy where there is one (no device sync).
        checked = tokens if host_tokens is None else host_tokens
        merged = token_embeds
        for name, pid in self.placeholder_ids.items():
            if name not in modality_embeds and bool((checked == pid).any()):
                raise ValueError(
                    f"tokens hold placeholders of module {name!r} (id {pid}) but no "
                    f"embeddings for it were given (have {sorted(modality_embeds)})"
                )
        for name, embeds in modality_embeds.items():
            if name not in self.placeholder_ids or name not in present:
                raise ValueError(
                    f"embeddings of module {name!r} need a placeholder id (have "
                    f"{sorted(self.placeholder_ids)}) and a present mask (have {sorted(present)})"
                )
            pid = self.placeholder_ids[name]
            if counts is not None and name in counts:
                self._check_rows(name, checked == pid, embeds, counts[name])
            else:
                self._check_counts(name, checked == pid, embeds, present[name])
            mask = tokens == pid
            # masked_scatter fills True positions in row-major order: sample by sample,
            # position by position, which is exactly the order of the flattened rows.
            merged = merged.masked_scatter(mask.unsqueeze(-1), embeds.to(merged.dtype))
        return merged

    def merge_context_embeddings(
        self,
        tokens: torch.Tensor,
        token_embeds: torch.Tensor,
        modality_rows: dict[str, torch.Tensor],
        host_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Context parallelism's merge: this CP rank's encoder rows at its placeholders.

        Args:
            tokens: ``[B, S / c]`` token ids at this rank's positions.
            token_embeds: ``[B, S / c, H]`` their embeddings.
            modality_rows: module name -> ``[n_local, H]``: the encoder rows of the
                placeholders among this rank's positions, in row-major order (the row
                contract of :mod:`mimotron.parallel.context_parallel`).
            host_tokens: ``tokens`` on the host, if the caller has them: the checks
                then count placeholders there, with no device sync.

        Returns:
            ``[B, S / c, H]``; gradients flow into both inputs.

        Raises:
            ValueError: if a module's row count differs from its local placeholder count,
                or placeholders of a module without rows occur.
        """
        checked = tokens if host_tokens is None else host_tokens  # reads: host copy
        merged = token_embeds
        for name, pid in self.placeholder_ids.items():
            rows = modality_rows.get(name)
            if rows is None:
                if bool((checked == pid).any()):
                    raise ValueError(
                        f"tokens hold placeholders of module {name!r} (id {pid}) but no "
                        f"embeddings for it were given (have {sorted(modality_rows)})")
                continue
            num_local = int((checked == pid).sum())
            if rows.dim() != 2 or rows.shape[0] != num_local:
                raise ValueError(
                    f"module {name!r}: expected [{num_local}, H] rows for this context-"
                    f"parallel rank's placeholders, got {tuple(rows.shape)}")
            # Row-major order of the local placeholders = the order of the rows.
            mask = tokens == pid
            merged = merged.masked_scatter(mask.unsqueeze(-1), rows.to(merged.dtype))
        return merged

    def _check_rows(self, name: str, mask: torch.Tensor, rows: torch.Tensor,
                    counts: torch.Tensor) -> None:
        """Raise ``ValueError`` unless each sample's placeholders number its items' tokens
        and ``rows`` holds them all (a native-resolution module's real rows)."""
        per_row = counts.long().to(mask.device)
        per_row = per_row if per_row.dim() == 1 else per_row.sum(dim=1)
        found = mask.sum(dim=1)
        if rows.dim() != 2 or rows.shape[0] != int(per_row.sum()):
            raise ValueError(f"module {name!r}: expected [{int(per_row.sum())}, H] rows for the "
                             f"batch's image tokens, got {tuple(rows.shape)}")
        bad = (found != per_row).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"sample {i}: {int(found[i])} placeholder tokens for module "
                             f"{name!r} but its media have {int(per_row[i])} tokens")

    def _check_counts(
        self, name: str, mask: torch.Tensor, embeds: torch.Tensor, present: torch.Tensor
    ) -> None:
        """Raise ``ValueError`` unless placeholders match the embeddings sample by sample."""
        present = present.bool().to(mask.device)  # a no-op when both are host copies
        modality = self.modality_of.get(name, "?")
        num_present = int(present.sum())
        if embeds.dim() != 3 or embeds.shape[0] != num_present:
            raise ValueError(
                f"module {name!r} (modality {modality!r}): expected embeddings "
                f"[{num_present}, T, H] for the {num_present} present samples, "
                f"got {tuple(embeds.shape)}"
            )
        counts = mask.sum(dim=1)
        # Packed rows (data.packing) carry a [B, K] mask: one entry per document's item.
        per_row = present.long() if present.dim() == 1 else present.long().sum(dim=1)
        expected = per_row * embeds.shape[1]
        bad = (counts != expected).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"sample {i}: {int(counts[i])} placeholder tokens for module {name!r} "
                f"(modality {modality!r}) but expected {int(expected[i])} "
                f"({'present' if bool(present[i].any()) else 'absent'}, {embeds.shape[1]} "
                "tokens per sample)"
            )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Single-process reference: encode, merge, run the LM, score.

        Args:
            batch: dict with ``tokens``, ``labels``, ``loss_mask`` and, per modality,
                ``<modality>`` and ``has_<modality>``.

        Returns:
            ``(loss_sum, num_tokens, correct)`` as from :func:`language_loss`.

        Raises:
            ValueError: if this instance does not hold every module.
        """
        if self.language_model is None or set(self.modality_submodules) != set(
            self.placeholder_ids
        ):
            raise ValueError(
                "MimoModel.forward needs every module on this rank; in a distributed "
                "layout call encode / merge_embeddings / language_model separately"
            )
        embeds = {name: self.encode(name, batch) for name in self.modality_submodules}
        present = {name: self.present_mask(name, batch) for name in self.modality_submodules}
        tokens = batch["tokens"]
        token_embeds = self.language_model.embed_tokens(tokens)
        embeds, counts, visual = native_embeddings(self, batch, embeds, token_embeds.shape[-1])
        hidden = self.merge_embeddings(tokens, token_embeds, embeds, present, counts=counts)
        # Packed rows (data.packing) carry their documents; see mimotron.data.packing.
        logits = self.language_model(hidden, **document_args(batch), **visual)
        return language_loss(logits, batch["labels"], batch["loss_mask"])


def present_rows(inputs: torch.Tensor, mask: torch.Tensor, host_mask: torch.Tensor
                 ) -> torch.Tensor:
    """``inputs[mask]``, without a device sync when ``host_mask`` is the mask on the host.

    Boolean indexing on an accelerator reads the mask back to size its output. With the
    host copy the row count is known on the host, and a stable sort of the device mask
    puts the present positions first, in their order (row-major for a ``[B, K]`` packed
    mask): the very rows, in the very order, boolean indexing takes.

    Args:
        inputs: ``[B, ...]`` (``[B, K, ...]`` for packed rows) modality inputs.
        mask: bool presence on ``inputs``' device, ``[B]`` or ``[B, K]``.
        host_mask: the same mask on the host, or ``mask`` itself where none is kept.

    Returns:
        ``[n_present, ...]``.
    """
    if host_mask.device == mask.device:  # on the host already, or no host copy: as before
        return inputs[mask]
    order = present_order(mask, int(host_mask.sum()))
    return inputs.flatten(0, mask.dim() - 1).index_select(0, order)


def present_order(mask: torch.Tensor, num_present: int) -> torch.Tensor:
    """``mask.flatten().nonzero().flatten()`` given its length: no device sync.

    A stable sort keeps equal keys in their order, so sorting ``~mask`` lists the True
    positions first, ascending.

    Args:
        mask: bool, any shape, on any device.
        num_present: its number of True entries (known on the host).

    Returns:
        Long ``[num_present]``: the flat positions of the True entries, ascending.
    """
    return torch.argsort((~mask).flatten().to(torch.uint8), stable=True)[:num_present]


def module_part(model: MimoModel, name: str) -> nn.Module | None:
    """Module ``name`` (an encoder or ``language``) as held by ``model`` on this rank.

    Args:
        model: a ``MimoModel`` (or anything with ``modality_submodules`` and
            ``language_model``).
        name: module name.

    Returns:
        The encoder submodule, the language model, or ``None`` where this rank does not
        hold it.
    """
    if name == LANGUAGE:
        return model.language_model
    subs = model.modality_submodules
    return subs[name] if name in subs else None  # noqa: SIM401 - ModuleDict has no get()
