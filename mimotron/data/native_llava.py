"""LLaVA samples for a native-resolution vision module (Qwen2.5-VL, Qwen3-VL).

With a Qwen-VL folder's vision module (``modules.<m>.hf_native``,
:mod:`mimotron.config.native_vision`) every image keeps (about) its size, so its token
count is its own. :class:`NativeLlava` holds what turns a LLaVA sample into the
native-resolution sample keys (:mod:`mimotron.data.native_batch`):

* **text**: each ``<image>`` of the conversation (the LLaVA convention) is written as the
  model's own ``<|vision_start|><|image_pad|><|vision_end|>`` before the chat template
  renders it (the ids are the folder's ``config.json`` ``vision_start_token_id``,
  ``image_token_id``, ``vision_end_token_id``; ``<|image_pad|>`` is the tokenizer's image
  placeholder, no token is added), and the tokenised ``<|image_pad|>`` of image ``k``
  becomes as many copies as that image has merged tokens (:func:`~mimotron.data.chat.
  expand_runs`), as ``transformers``' processor expands it;
* **counts**: an image's grid and tokens come from its header size alone
  (:meth:`~mimotron.data.native_images.NativeImageProcessor.grid_for_size`), so the data
  check records every sample's length, and a rank that never decodes the image (the
  language model's) knows its grid;
* **keys**: ``image`` (the processor's patch rows in ``max_patches`` slots; ``[n, ...]``
  with several images), ``image_grid`` ``[3]`` (``[K, 3]``), ``image_tokens`` ``[]``
  (``[K]``) and ``position_ids`` ``[3, L]`` (:func:`~mimotron.data.mrope_positions.
  mrope_positions` of the sample's tokens and grids; ``[3, 0]`` on a rank that loads no
  text).

**Videos** (:mod:`~mimotron.data.native_video`): a sample's items are its images and
videos in the order of their placeholders (``<image>``, ``<video>``), each video one item
of grid ``(t, h, w)`` in the same slots, its patch rows the family's video patch rows.
Each ``<video>`` becomes the family's video text (Qwen3-VL: a timestamp per temporal
step), its ``<|video_pad|>`` runs expanded to the video's tokens; its sampled frames and
grid come from the file's header (:meth:`NativeLlava.video_plans`). ``position_ids`` are
those of the true ids (video runs of ``video_token_id``, Qwen2.5-VL's seconds per
temporal step); then :meth:`NativeLlava.image_placeholders` writes every
``video_token_id`` as ``image_token_id`` in the ids the engine reads, which merges every
item at the image placeholders in text order (placeholders are never trained).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mimotron.config.hf_folder import read_hf_config
from mimotron.data.chat import (
    EncodedConversation,
    expand_runs,
    placeholder_order,
    replace_placeholder,
)
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava_check import Media, open_image
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.data.native_images import Grid, NativeImageProcessor
from mimotron.data.native_video import NativeVideoProcessor, VideoPlan
from mimotron.data.webdataset import TarMember

__all__ = ["LLAVA_IMAGE", "LLAVA_VIDEO", "NativeLlava", "image_size", "native_image_id"]

LLAVA_IMAGE = "<image>"
"""Where LLaVA data puts an image in a conversation."""
LLAVA_VIDEO = "<video>"
"""Where LLaVA-Video / LLaMA-Factory data put a video in a conversation."""
# transformers' config defaults of both families (Qwen2_5_VLConfig, Qwen3VLConfig).
_DEFAULT_IDS = {"vision_start_token_id": 151652, "vision_end_token_id": 151653}


def native_image_id(hf_path: str | Path) -> int:
    """The image placeholder id of a Qwen-VL folder (``config.json`` ``image_token_id``)."""
    return MRopeRule.from_hf_config(read_hf_config(hf_path)).image_token_id


def image_size(file: Media) -> tuple[int, int]:
    """``(width, height)`` of an image file from its header (no pixel decoded).

    Raises:
        ValueError: not an image PIL can open.
    """
    from PIL import Image  # Deferred: only media-reading runs need PIL.

    try:
        with Image.open(file.open() if isinstance(file, TarMember) else file) as image:
            return int(image.size[0]), int(image.size[1])
    except Exception as exc:  # noqa: BLE001 - any decoding failure is an unreadable image
        raise ValueError(f"image file {str(file)!r} is unreadable: {exc}") from exc


@dataclass(frozen=True)
class NativeLlava:
    """How a LLaVA sample's images and videos become native-resolution keys (module
    docstring).

    Attributes:
        processor: the folder's image processor with the run's pixel bounds.
        rule: the folder's M-RoPE position rule.
        image_text: the model's text of one image (``<|vision_start|><|image_pad|>
            <|vision_end|>``).
        image_id: the placeholder id (``image_token_id``).
        video: the folder's video rule (``None`` where it cannot be built: ``video_error``).
        video_tokens: the texts of ``<|vision_start|>``, ``<|video_pad|>``,
            ``<|vision_end|>``.
        video_error: why a sample with a video is refused (``""``: it is not).
    """

    processor: NativeImageProcessor
    rule: MRopeRule
    image_text: str
    image_id: int
    video: NativeVideoProcessor | None = None
    video_tokens: tuple[str, str, str] = ("", "", "")
    video_error: str = ""

    @classmethod
    def from_folder(cls, hf_path: str | Path, vision: Any, tokenizer: HFTokenizer
                    ) -> NativeLlava:
        """The native image and video text of a Qwen-VL folder and the run's tokenizer.

        Args:
            hf_path: the folder (its ``config.json``, ``preprocessor_config.json`` and
                video processor file, :func:`~mimotron.data.native_video.read_video_config`).
            vision: the vision module's resolved ``hf_native`` (patching and bounds).
            tokenizer: the run's tokenizer, its image placeholder the folder's
                ``image_token_id`` (:func:`~mimotron.data.run_data.run_hf_tokenizer`).

        Raises:
            ValueError: one line: a tokenizer whose image placeholder is not the model's,
                or whose vision start/end/pad tokens do not encode to the config's ids.
                (A video processor file or a ``<|video_pad|>`` the tokenizer does not keep
                whole refuses the samples with a video only: ``video_error``.)
        """
        config = read_hf_config(hf_path)
        rule = MRopeRule.from_hf_config(config)
        if tokenizer.placeholder_id("image") != rule.image_token_id:
            raise ValueError(f"data.tokenizer={str(tokenizer.path)!r} has image placeholder id "
                             f"{tokenizer.placeholder_id('image')}, not the image_token_id="
                             f"{rule.image_token_id} of {str(hf_path)!r}")
        start, end = (int(config.get(k) or _DEFAULT_IDS[k]) for k in ("vision_start_token_id",
                                                                      "vision_end_token_id"))
        ids = [start, rule.image_token_id, end]
        text = "".join(str(tokenizer.tokenizer.convert_ids_to_tokens(i) or "") for i in ids)
        if tokenizer.encode(text) != ids:
            raise ValueError(f"data.tokenizer={str(tokenizer.path)!r} encodes {text!r} as "
                             f"{tokenizer.encode(text)}: expected the vision_start, image and "
                             f"vision_end ids {ids} of {str(hf_path)!r}'s config.json")
        processor = NativeImageProcessor.from_vision(hf_path, vision)
        return cls(processor, rule, text, rule.image_token_id,
                   *_video_rule(hf_path, processor, rule, tokenizer, (start, end)))

    def identity(self) -> dict[str, Any]:
        """What a sample's length and keys depend on (part of a data index's key)."""
        return {"processor": self.processor.identity(), "image_text": self.image_text,
                "image_id": self.image_id, "video_tokens": list(self.video_tokens),
                "video": None if self.video is None else self.video.identity()}

    # ---- text ---------------------------------------------------------------------------
    @staticmethod
    def item_kinds(messages: Sequence[dict[str, str]]) -> tuple[str, ...]:
        """``"image"`` / ``"video"`` for each ``<image>`` / ``<video>`` of the data's
        messages, in text order: the order of the sample's items."""
        return placeholder_order(messages, {"image": LLAVA_IMAGE, "video": LLAVA_VIDEO})

    def wrap(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with each ``<image>`` written as the model's image text."""
        return replace_placeholder(messages, LLAVA_IMAGE, self.image_text)

    def wrap_videos(self, messages: Sequence[dict[str, str]], plans: Sequence[VideoPlan]
                    ) -> list[dict[str, str]]:
        """``messages`` with the ``k``-th ``<video>`` written as video ``k``'s text.

        Raises:
            ValueError: one line: as many ``<video>`` as videos are not found, or one in
                an assistant turn.
        """
        count = sum(m["content"].count(LLAVA_VIDEO) for m in messages)
        if count != len(plans):
            raise ValueError(f"{count} {LLAVA_VIDEO} placeholder(s) in the conversation but "
                             f"{len(plans)} video file(s): expected one placeholder per file")
        if not plans:
            return list(messages)
        assert self.video is not None, "video_plans made the plans"
        texts = iter([self.video.text(p, *self.video_tokens) for p in plans])
        out = []
        for k, message in enumerate(messages):
            if LLAVA_VIDEO in message["content"] and message["role"] == "assistant":
                raise ValueError(f"message {k} (assistant) holds {LLAVA_VIDEO!r}: "
                                 "placeholders belong in 'human' turns")
            pieces = message["content"].split(LLAVA_VIDEO)
            content = pieces[0] + "".join(next(texts) + piece for piece in pieces[1:])
            out.append({**message, "content": content})
        return out

    def expand(self, encoded: EncodedConversation, counts: Sequence[int],
               videos: Sequence[VideoPlan] = ()) -> EncodedConversation:
        """Image ``k``'s one placeholder id -> ``counts[k]`` copies; each run of a video's
        text (:meth:`wrap_videos`) -> its tokens.

        Raises:
            ValueError: as :func:`~mimotron.data.chat.expand_runs` (a ``<|video_pad|>``
                of the text without its video among them).
        """
        encoded = expand_runs(encoded, self.image_id, counts)
        runs = [r for plan in videos for r in self._video().runs(plan)]
        return expand_runs(encoded, self.rule.video_token_id, runs)

    def image_placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` with every ``video_token_id`` written as ``image_token_id`` (what the
        engine reads: every item is merged at the image placeholders, in text order)."""
        return ids.masked_fill(ids == self.rule.video_token_id, self.image_id)

    # ---- counts -------------------------------------------------------------------------
    def header_grids(self, files: Sequence[Media]) -> list[Grid]:
        """Each image's grid from its header size (no pixel decoded).

        Raises:
            ValueError: an unreadable header, or a size the processor refuses.
        """
        grids = []
        for file in files:
            try:
                grids.append(self.processor.grid_for_size(*image_size(file)))
            except ValueError as exc:
                raise ValueError(f"image file {str(file)!r}: {exc}") from None
        return grids

    def video_plans(self, files: Sequence[Media]) -> list[VideoPlan]:
        """Each video's sampled frames and grid from its header (no frame decoded).

        Raises:
            ValueError: one line naming the file: not found, unreadable, no frames, too
                many frames for the slots, or the folder's video rule is unusable.
        """
        plans = []
        for file in files:
            if not isinstance(file, Path):
                raise ValueError(f"video {str(file)!r} is a tar shard member: videos are read "
                                 "from JSON / JSONL data only")
            if not file.exists():
                raise ValueError(f"video file {str(file)!r} not found")
            plans.append(self._video().plan_file(file))
        return plans

    def tokens_of(self, grids: Sequence[Grid]) -> list[int]:
        """Merged tokens of each grid."""
        return [t * h * w // self.processor.merge_size**2 for t, h, w in grids]

    def _video(self) -> NativeVideoProcessor:
        if self.video is None or self.video_error:
            raise ValueError(f"the sample has a video, which this run cannot read: "
                             f"{self.video_error}")
        return self.video

    # ---- a loaded sample's keys ---------------------------------------------------------
    def load_images(self, files: Sequence[Media], grids: Sequence[Grid]) -> torch.Tensor:
        """Float32 ``[n, max_patches, patch_dim]``: each image's patch rows in its slots.

        Raises:
            ValueError, OSError: a file that no longer decodes, or whose size changed
                since its header was read (``grids``).
        """
        slots = []
        for file, grid in zip(files, grids, strict=True):
            patches, got = self.processor(open_image(file, self.processor))
            if got != tuple(grid):
                raise ValueError(f"image file {str(file)!r} decodes to grid {got}, not the "
                                 f"{tuple(grid)} of its header: the file changed")
            slots.append(self.processor.padded(patches))
        return torch.stack(slots)

    def load_items(self, images: Sequence[Media], grids: Sequence[Grid],
                   videos: Sequence[Media], plans: Sequence[VideoPlan],
                   kinds: Sequence[str]) -> torch.Tensor:
        """Float32 ``[n, max_patches, patch_dim]``: each item's patch rows in its slots,
        images and videos in the order of their placeholders (``kinds``).

        Raises:
            ValueError, OSError: a file that no longer decodes as its header said.
        """
        if not videos:
            return self.load_images(images, grids)
        image_slots = list(self.load_images(images, grids)) if images else []
        video_slots = [self.processor.padded(self._video()(Path(str(f)), p))
                       for f, p in zip(videos, plans, strict=True)]
        return torch.stack(_in_text_order(image_slots, video_slots, kinds))

    def positions(self, tokens: torch.Tensor, grids: Sequence[Grid],
                  videos: Sequence[VideoPlan] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``([3, L], [1, 1])``: a sample's 3-D positions and its ``rope_deltas``
        (:func:`~mimotron.data.mrope_positions.mrope_positions` of its true ids: video runs
        take the video layout, time and Qwen3-VL's runs per step).

        Args:
            tokens: the sample's true token ids ``[L]``.
            grids: its images' grids, in the order of their placeholders.
            videos: its videos, in the order of their placeholders.
        """
        image_grid = torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)
        video_grid = torch.tensor([p.grid for p in videos], dtype=torch.long).reshape(-1, 3)
        seconds = (torch.tensor([p.seconds_per_step for p in videos], dtype=torch.float32)
                   if videos and self.rule.family == "qwen2_5_vl" else None)
        positions, deltas = mrope_positions(tokens[None], self.rule,
                                            image_grid if len(grids) else None,
                                            video_grid if len(videos) else None,
                                            second_per_grid_ts=seconds)
        return positions[:, 0], deltas

    def sample_keys(self, tokens: torch.Tensor, grids: Sequence[Grid], max_images: int,
                    videos: Sequence[VideoPlan] = (), kinds: Sequence[str] = ()
                    ) -> dict[str, torch.Tensor]:
        """``image_grid``, ``image_tokens`` and ``position_ids`` of one sample.

        Args:
            tokens: the sample's true token ids (empty where the text is not loaded).
            grids: its images' grids, in the order of their placeholders.
            max_images: ``data.max_images_per_sample`` (above 1: ``[K, ...]`` keys).
            videos: its videos, in the order of their placeholders.
            kinds: ``"image"`` / ``"video"`` per item in text order (empty: images only).
        """
        image_grid = torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)
        video_grid = torch.tensor([p.grid for p in videos], dtype=torch.long).reshape(-1, 3)
        items = _in_text_order(list(image_grid), list(video_grid), kinds)
        grid = torch.stack(items) if items else torch.zeros(0, 3, dtype=torch.long)
        positions = (self.positions(tokens, grids, videos)[0] if tokens.numel()
                     else torch.zeros(3, 0, dtype=torch.long))
        counts = grid.prod(dim=-1) // self.processor.merge_size**2
        if max_images > 1:
            pad = max_images - grid.shape[0]
            return {"image_grid": F.pad(grid, (0, 0, 0, pad)),
                    "image_tokens": F.pad(counts, (0, pad)), "position_ids": positions}
        assert grid.shape[0] <= 1, "the check allows one item"
        first = grid[0] if grid.shape[0] else torch.zeros(3, dtype=torch.long)
        return {"image_grid": first, "image_tokens": first.prod() // self.processor.merge_size**2,
                "position_ids": positions}


def _video_rule(hf_path: str | Path, processor: NativeImageProcessor, rule: MRopeRule,
                tokenizer: HFTokenizer, ends: tuple[int, int]
                ) -> tuple[NativeVideoProcessor | None, tuple[str, str, str], str]:
    """A folder's video processor, the texts of its vision start, video pad and vision end
    tokens, and why videos are refused (``""``: they are not; an image-only run on a
    folder without usable video settings still trains)."""
    ids = [ends[0], rule.video_token_id, ends[1]]
    pieces = [str(tokenizer.tokenizer.convert_ids_to_tokens(i) or "") for i in ids]
    error, video = "", None
    if tokenizer.encode("".join(pieces)) != ids:
        error = (f"data.tokenizer={str(tokenizer.path)!r} encodes {''.join(pieces)!r} as "
                 f"{tokenizer.encode(''.join(pieces))}: expected the vision_start, video and "
                 f"vision_end ids {ids} of {str(hf_path)!r}'s config.json")
    try:
        video = NativeVideoProcessor.from_folder(hf_path, processor, rule.family)
    except ValueError as exc:
        error = error or str(exc)
    return video, (pieces[0], pieces[1], pieces[2]), error


def _in_text_order(images: list[Any], videos: list[Any], kinds: Sequence[str]) -> list[Any]:
    """The items of images and videos in text order (``kinds``; empty: images only)."""
    picks = {"image": iter(images), "video": iter(videos)}
    items = [next(picks[k]) for k in kinds] if kinds else list(images)
    assert len(items) == len(images) + len(videos), "one kind per item"
    return items
