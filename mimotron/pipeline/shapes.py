"""Transfer shapes both sides of a pipeline link know in advance (pure functions).

A tensor whose shape and dtype the receiver can derive from the config, exactly as the
sender does, travels without a shape header (:mod:`mimotron.pipeline.p2p`):

* the language model's stage links: every stage sees the same padded batch geometry,
  so a link carries ``[micro_batch_size / data, seq_length / context, hidden]`` in the
  residual stream's dtype forward, and the same (the gradient of that input) backward;
  a Qwen3-VL link before the last DeepStack layer is wider by the feature sets it
  carries (:mod:`mimotron.pipeline.deepstack_link`), a count both ends derive from the
  layer split;
* the bridge of an encoder whose modality *every* sample carries, by the data config
  (the digits task with no weight on kinds without it, unpacked): a replica pair then
  exchanges one ``[tokens, hidden]`` row per sample of its intersection, fp32 (under
  ``train.precision = "fp32"``; the projector's autocast dtype is not assumed) and into
  a language model without context parallelism.

Everything else depends on the data and keeps its header: encoder stage links and other
bridges carry one row per sample *present* in the slice, and a context-parallel bridge
the rows of the placeholders each CP rank holds.

The decision uses nothing but the layout and the batch geometry, which are identical on
every rank, so both ends of a link agree without a collective; the sender checks every
tensor against the same shape before sending (a batch of another geometry is a
``ValueError`` there, not a hang or a silently mismatched message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mimotron.data.digits import modality_kind_map
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout
from mimotron.runtime import compute_dtype

if TYPE_CHECKING:
    from mimotron.config.schema import MimoConfig

# Digits sample kinds and the modalities each carries (after the encoder remapping).
_CARRIES = {"image": {"image"}, "audio": {"audio"}, "both": {"image", "audio"}, "text": set()}


@dataclass(frozen=True)
class LinkShape:
    """The tensor a link carries (forward, and its gradient back), known to both ends."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    origin: str
    """The config values the shape comes from, for error messages."""
    need: str
    """What the data must be for the shape to hold, for error messages."""

    def check(self, t: torch.Tensor, what: str) -> None:
        """Raise if ``t`` does not match (before anything is sent).

        Raises:
            ValueError: ``t``'s shape or dtype differs; the message names the geometry.
        """
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise ValueError(
                f"{what} is {list(t.shape)} {t.dtype}, but {self.origin}: {self.need}")


def stage_link_shape(layout: Layout, micro_batch_size: int, seq_length: int | None,
                     hidden_size: int | None, dtype: torch.dtype = torch.float32,
                     deepstack: int = 0) -> LinkShape | None:
    """The language model's stage-link tensor, or ``None`` if it is not known in advance.

    Args:
        layout: the placement of every module.
        micro_batch_size: the global micro-batch size.
        seq_length: every micro-batch's padded sequence length (``data.seq_length``);
            ``None``: unknown (the links keep their headers).
        hidden_size: the language model's hidden size; ``None``: unknown.
        dtype: the residual stream's dtype (:func:`residual_dtype`).
        deepstack: the DeepStack feature sets the link carries after the hidden
            states, each ``hidden_size`` wide (:mod:`mimotron.pipeline.deepstack_link`).

    Returns:
        ``None`` where the language model has one stage or a value is unknown.
    """
    if LANGUAGE not in layout.modules or seq_length is None or hidden_size is None:
        return None
    par = layout.modules[LANGUAGE].parallel
    if par.pipeline == 1:
        return None
    shape = (micro_batch_size // par.data, seq_length // par.context,
             hidden_size * (1 + deepstack))
    width = (f"hidden_size={hidden_size}" if not deepstack else
             f"hidden_size={hidden_size} x (1 + {deepstack} DeepStack feature sets)")
    origin = (f"the language model's stage link carries {list(shape)} {dtype} "
              f"(train.micro_batch_size={micro_batch_size} / data={par.data}, "
              f"data.seq_length={seq_length} / context={par.context}, {width})")
    need = f"every micro-batch must hold {[shape[0], seq_length]} tokens per language DP rank"
    return LinkShape(shape, dtype, origin, need)


def residual_dtype(cfg: MimoConfig, device: torch.device | None = None) -> torch.dtype:
    """The dtype of the residual stream, hence of the language model's stage links.

    The compute dtype under bf16/fp16 (the stack casts its input to autocast's dtype,
    :func:`~mimotron.models.blocks.to_residual_dtype`), fp32 under fp32 or with
    ``train.fp32_residual_connection``, and fp32 on a device without autocast (the
    dry run's ``meta`` stand-in computes in fp32, so its stream stays fp32).
    """

    if cfg.train.fp32_residual_connection:
        return torch.float32
    if device is not None and not torch.amp.is_autocast_available(device.type):
        return torch.float32
    return compute_dtype(cfg.train.precision)


def always_present(cfg: MimoConfig) -> set[str]:
    """Encoders whose modality every sample carries, by the data config alone.

    Only the digits task guarantees it (a kind's weight of 0 means it never occurs;
    a modality without an encoder is remapped, :func:`~mimotron.data.digits.
    modality_kind_map`); packed rows may hold no item of a modality.
    """

    d = cfg.data
    if d.dataset != "digits" or d.packing:
        return set()
    modality = {n: cfg.modules[n].modality for n in cfg.encoder_names}
    kinds = modality_kind_map(list(modality.values()))
    weights = {"image": d.p_image, "audio": d.p_audio, "both": d.p_both, "text": d.p_text}
    return {n for n, m in modality.items()
            if all(w == 0 or m in _CARRIES[kinds[k]] for k, w in weights.items())}


def bridge_row_shapes(cfg: MimoConfig, layout: Layout) -> dict[str, tuple[int, int]]:
    """``encoder -> (tokens, hidden)`` of each bridge row, where the row count is fixed.

    A replica pair sharing ``n`` samples then exchanges ``[n, tokens, hidden]`` fp32.
    Empty (every bridge keeps its header) unless ``train.precision = "fp32"``, the
    language model has no context parallelism and no encoder's items are dealt by cost.
    """
    if (cfg.train.precision != "fp32" or layout.modules[LANGUAGE].parallel.context > 1
            or cfg.data.balance_encoders):  # balanced: a pair's rows vary per micro-batch
        return {}
    hidden = cfg.modules[LANGUAGE].hidden_size
    return {n: (cfg.modules[n].num_output_tokens, hidden) for n in sorted(always_present(cfg))}


def bridge_link(src: str, rows: int, row_shape: tuple[int, int], cfg_keys: str) -> LinkShape:
    """The bridge tensor of ``rows`` samples of encoder ``src`` (:func:`bridge_row_shapes`)."""
    shape = (rows, *row_shape)
    return LinkShape(shape, torch.float32,
                     f"the bridge from {src!r} carries {list(shape)} torch.float32 ({cfg_keys})",
                     f"every sample of the slice must carry {src!r}'s modality")
