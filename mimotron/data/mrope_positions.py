"""3-D rotary positions (M-RoPE) of Qwen2.5-VL and Qwen3-VL token rows, on the host.

The language models of Qwen2.5-VL and Qwen3-VL rotate every query and key by three
positions instead of one: temporal, height and width (``[3, B, S]``). A text token has
the same position on all three axes, one more than the token before it. The placeholder
tokens of an image or a video (one per merged patch, ``t * h * w / merge**2`` of them,
in ``(t, h, w)`` row-major order) take their patch's grid coordinates, offset by the
position where the run starts; the text after the run continues from that start plus
``max(h, w) / merge`` (the run's spatial extent, not its token count). So a long
sequence of patches costs the positions of its side, not of its area.

The two families differ in time:

* **Qwen2.5-VL** runs a whole video as one placeholder run; frame ``i`` of video ``v``
  sits at temporal offset ``int(i * tokens_per_second * second_per_grid_ts[v])`` (real
  seconds between frames, ``1`` when not given); an image's only frame is at 0.
* **Qwen3-VL** runs each frame of a video separately (timestamp text between them), so
  a ``(t, h, w)`` video grid is ``t`` grids of ``(1, h, w)``, each laid out like an image.

:func:`mrope_positions` computes the positions of a batch as ``transformers``'
``get_rope_index`` of each family does (``tests/test_mrope.py`` compares them), reading
the placeholder runs from the token ids and the grids in the order their runs appear
(row by row). Padding (``attention_mask`` 0, or ``doc_ids`` -1) gets position 0 and no
grid. **Packed rows** (``doc_ids``): positions restart at 0 for every document, as if each
document were alone in its row. It also returns ``rope_deltas``: what generation adds
to the cache position of every token generated after a row's (last document's) prompt
(:func:`decode_positions`).

Torch only, on whatever device the ids are on (normally the host: the data loader
computes positions per sample, before any device is involved).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MROPE_FAMILIES", "MRopeRule", "decode_positions", "mrope_positions"]

MROPE_FAMILIES: tuple[str, ...] = ("qwen2_5_vl", "qwen3_vl")
"""The ``model_type`` values of the full configs whose position rule is implemented."""

# transformers' config defaults of the keys a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {"image_token_id": 151655, "video_token_id": 151656,
                   "spatial_merge_size": 2, "tokens_per_second": 4},
    "qwen3_vl": {"image_token_id": 151655, "video_token_id": 151656,
                 "spatial_merge_size": 2, "tokens_per_second": 1},
}
_TEXT, _IMAGE, _VIDEO = 0, 1, 2


@dataclass(frozen=True)
class MRopeRule:
    """How one model family lays out the 3-D positions of its placeholder runs.

    Attributes:
        family: ``"qwen2_5_vl"`` or ``"qwen3_vl"`` (see the module docstring).
        image_token_id: the id of every image placeholder token.
        video_token_id: the id of every video placeholder token.
        spatial_merge_size: patches merged per side into one token (grids are in
            unmerged patches, as the image processor reports them).
        tokens_per_second: Qwen2.5-VL's temporal positions per second of video.

    Raises:
        ValueError: an unknown family or a merge size below 1.
    """

    family: str
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    tokens_per_second: float = 4

    def __post_init__(self) -> None:
        if self.family not in MROPE_FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; expected one of "
                             f"{list(MROPE_FAMILIES)}")
        if self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size={self.spatial_merge_size} is invalid: "
                             "expected an integer >= 1")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> MRopeRule:
        """The rule of a full ``qwen2_5_vl`` / ``qwen3_vl`` ``config.json`` dict.

        Raises:
            ValueError: another ``model_type``.
        """
        family = config.get("model_type")
        if family not in _DEFAULTS:
            raise ValueError(f"config.json model_type={family!r} has no M-RoPE position rule; "
                             f"expected one of {list(MROPE_FAMILIES)}")
        vision = config.get("vision_config") or {}
        get = {**_DEFAULTS[family], **{k: v for k, v in {**config, **vision}.items()
                                       if v is not None}}
        return cls(family, int(get["image_token_id"]), int(get["video_token_id"]),
                   int(get["spatial_merge_size"]), get["tokens_per_second"])


def _grids(rule: MRopeRule, image_grid_thw: torch.Tensor | None,
           video_grid_thw: torch.Tensor | None, second_per_grid_ts: torch.Tensor | None
           ) -> dict[int, list[tuple[int, int, int, Any]]]:
    """Per kind, the ``(t, h, w, time interval)`` of each placeholder run, in order."""
    images = [(*map(int, g), 1) for g in (image_grid_thw if image_grid_thw is not None else [])]
    num_videos = 0 if video_grid_thw is None else len(video_grid_thw)
    if second_per_grid_ts is not None and len(second_per_grid_ts) != num_videos:
        raise ValueError(f"second_per_grid_ts holds {len(second_per_grid_ts)} values for "
                         f"{num_videos} videos; expected one per video")
    videos = []
    for v, g in enumerate(video_grid_thw if video_grid_thw is not None else []):
        t, h, w = map(int, g)
        if rule.family == "qwen3_vl":
            videos += [(1, h, w, 1)] * t  # one run per frame
        else:
            # The product keeps the dtype of second_per_grid_ts, as transformers' does.
            second = 1 if second_per_grid_ts is None else second_per_grid_ts[v]
            videos.append((t, h, w, rule.tokens_per_second * second))
    merge = rule.spatial_merge_size
    for t, h, w, _ in images + videos:
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"grid_thw ({t}, {h}, {w}) is invalid: expected positive sizes "
                             f"with h and w divisible by spatial_merge_size={merge}")
    return {_IMAGE: images, _VIDEO: videos}


def _vision_block(grid: tuple[int, int, int, Any], start: int, merge: int) -> torch.Tensor:
    """``[3, t * h * w / merge**2]`` positions of one run starting at ``start``."""
    t, h, w, interval = grid
    h, w = h // merge, w // merge
    # Truncated after the (possibly fractional) time scaling, then offset.
    temporal = (torch.arange(t) * interval).long() + start
    return torch.stack([temporal.view(t, 1, 1).expand(t, h, w),
                        (torch.arange(h) + start).view(1, h, 1).expand(t, h, w),
                        (torch.arange(w) + start).view(1, 1, w).expand(t, h, w)]).reshape(3, -1)


def _document(kinds: list[int], queues: dict[int, list], taken: dict[int, int], merge: int,
              where: str) -> torch.Tensor:
    """``[3, n]`` positions of one document of token kinds; takes grids from ``queues``."""
    vision = [i for i, k in enumerate(kinds) if k != _TEXT]
    pieces, pos, i = [], 0, 0
    while i < len(kinds):
        if kinds[i] == _TEXT:
            end = vision[bisect_left(vision, i)] if vision and vision[-1] > i else len(kinds)
            pieces.append(torch.arange(pos, pos + end - i).expand(3, -1))
            pos, i = pos + end - i, end
            continue
        kind = kinds[i]
        name = "image" if kind == _IMAGE else "video"
        if taken[kind] == len(queues[kind]):
            raise ValueError(f"{where}: more {name} placeholder runs than {name} grids "
                             f"({len(queues[kind])})")
        grid = queues[kind][taken[kind]]
        taken[kind] += 1
        count = grid[0] * grid[1] * grid[2] // merge**2
        if kinds[i:i + count] != [kind] * count:
            raise ValueError(f"{where}: the {name} run at position {i} is shorter than its "
                             f"grid {tuple(grid[:3])}, which needs {count} placeholder tokens")
        pieces.append(_vision_block(grid, pos, merge))
        pos, i = pos + max(grid[1], grid[2]) // merge, i + count
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def _documents(mask: torch.Tensor, doc_ids: torch.Tensor | None) -> list[list[int]]:
    """The token indices of each document of one row (``mask``: the row's real tokens)."""
    if doc_ids is None:
        return [torch.nonzero(mask).flatten().tolist()]
    docs: list[list[int]] = []
    last = None
    for i, (d, real) in enumerate(zip(doc_ids.tolist(), mask.tolist(), strict=True)):
        if d < 0 or not real:
            continue
        if d != last or not docs:
            docs.append([])
        docs[-1].append(i)
        last = d
    return docs


def mrope_positions(
    input_ids: torch.Tensor,
    rule: MRopeRule,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D rotary positions of a batch of token rows, and its ``rope_deltas``.

    Args:
        input_ids: ``[B, S]`` token ids; each image (video) is a run of
            ``rule.image_token_id`` (``video_token_id``) tokens.
        rule: the family's layout (:class:`MRopeRule`).
        image_grid_thw: ``[num_images, 3]`` (t, h, w) patch grid of each image, in the
            order of their runs (row by row).
        video_grid_thw: ``[num_videos, 3]`` likewise for videos.
        second_per_grid_ts: ``[num_videos]`` seconds between temporal grid steps
            (Qwen2.5-VL only; ``None`` = 1 each).
        attention_mask: ``[B, S]``, 0 on padding (which gets position 0 and no grid).
        doc_ids: ``[B, S]`` packed rows: the document of each position (-1 = padding);
            positions restart at 0 for every document (a new one where the id changes).

    Returns:
        ``(positions, rope_deltas)``: int64 ``[3, B, S]`` (temporal, height, width) and
        int64 ``[B, 1]``: the largest position of the row's last document plus one,
        minus its token count (0 for text only; 0 for a row without tokens).

    Raises:
        ValueError: mismatched shapes, a grid that is not divisible by the merge size, a
            placeholder run that does not hold its grid's tokens, or grids and runs that
            do not pair up one to one (all named).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: expected [B, S]")
    for name, t in (("attention_mask", attention_mask), ("doc_ids", doc_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} of shape {tuple(t.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}")
    ids = input_ids.detach().cpu()
    kinds = torch.where(ids == rule.image_token_id, _IMAGE,
                        torch.where(ids == rule.video_token_id, _VIDEO, _TEXT))
    mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
            else attention_mask.detach().cpu().bool())
    docs_ids = None if doc_ids is None else doc_ids.detach().cpu()
    queues = _grids(rule, image_grid_thw, video_grid_thw, second_per_grid_ts)
    taken = {_IMAGE: 0, _VIDEO: 0}
    positions = torch.zeros(3, *ids.shape, dtype=torch.long)
    deltas = torch.zeros(ids.shape[0], 1, dtype=torch.long)
    for row in range(ids.shape[0]):
        row_kinds = kinds[row].tolist()
        docs = _documents(mask[row], None if docs_ids is None else docs_ids[row])
        for index in docs:
            doc = _document([row_kinds[i] for i in index], queues, taken,
                            rule.spatial_merge_size, f"row {row}")
            positions[:, row, index] = doc
            if doc.shape[1]:
                deltas[row, 0] = int(doc.max()) + 1 - doc.shape[1]
    for kind, name in ((_IMAGE, "image"), (_VIDEO, "video")):
        if taken[kind] != len(queues[kind]):
            raise ValueError(f"{len(queues[kind])} {name} grids for {taken[kind]} {name} "
                             "placeholder runs in the batch")
    return positions.to(input_ids.device), deltas.to(input_ids.device)


def decode_positions(rope_deltas: torch.Tensor, start: int, num: int) -> torch.Tensor:
    """``[3, B, num]`` positions of ``num`` text tokens after ``start`` cached ones.

    A token generated after an M-RoPE prompt is text: the same position on all three
    axes, its cache position shifted by the row's ``rope_deltas``.

    Args:
        rope_deltas: ``[B, 1]`` from :func:`mrope_positions` of the prompt.
        start: positions already in the cache (the prompt's length, then more).
        num: new positions.
    """
    steps = torch.arange(start, start + num, device=rope_deltas.device)
    return (steps.view(1, -1) + rope_deltas).unsqueeze(0).expand(3, -1, -1)
