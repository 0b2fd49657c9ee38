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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mimotron.config.hf_folder import read_hf_config
from mimotron.data.chat import EncodedConversation, expand_runs, replace_placeholder
from mimotron.data.hf_tokenizer import HFTokenizer
from mimotron.data.llava_check import Media, open_image
from mimotron.data.mrope_positions import MRopeRule, mrope_positions
from mimotron.data.native_images import Grid, NativeImageProcessor
from mimotron.data.webdataset import TarMember

__all__ = ["LLAVA_IMAGE", "NativeLlava", "image_size", "native_image_id"]

LLAVA_IMAGE = "<image>"
"""Where LLaVA data puts an image in a conversation."""
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
    """How a LLaVA sample's images become native-resolution keys (module docstring).

    Attributes:
        processor: the folder's image processor with the run's pixel bounds.
        rule: the folder's M-RoPE position rule.
        image_text: the model's text of one image (``<|vision_start|><|image_pad|>
            <|vision_end|>``).
        image_id: the placeholder id (``image_token_id``).
    """

    processor: NativeImageProcessor
    rule: MRopeRule
    image_text: str
    image_id: int

    @classmethod
    def from_folder(cls, hf_path: str | Path, vision: Any, tokenizer: HFTokenizer
                    ) -> NativeLlava:
        """The native image text of a Qwen-VL folder and the run's tokenizer.

        Args:
            hf_path: the folder (its ``config.json`` and ``preprocessor_config.json``).
            vision: the vision module's resolved ``hf_native`` (patching and bounds).
            tokenizer: the run's tokenizer, its image placeholder the folder's
                ``image_token_id`` (:func:`~mimotron.data.run_data.run_hf_tokenizer`).

        Raises:
            ValueError: one line: a tokenizer whose image placeholder is not the model's,
                or whose vision start/end/pad tokens do not encode to the config's ids.
        """
        config = read_hf_config(hf_path)
        rule = MRopeRule.from_hf_config(config)
        if tokenizer.placeholder_id("image") != rule.image_token_id:
            raise ValueError(f"data.tokenizer={str(tokenizer.path)!r} has image placeholder id "
                             f"{tokenizer.placeholder_id('image')}, not the image_token_id="
                             f"{rule.image_token_id} of {str(hf_path)!r}")
        ids = [int(config.get(k) or _DEFAULT_IDS[k]) for k in ("vision_start_token_id",
                                                               "vision_end_token_id")]
        ids.insert(1, rule.image_token_id)
        text = "".join(str(tokenizer.tokenizer.convert_ids_to_tokens(i) or "") for i in ids)
        if tokenizer.encode(text) != ids:
            raise ValueError(f"data.tokenizer={str(tokenizer.path)!r} encodes {text!r} as "
                             f"{tokenizer.encode(text)}: expected the vision_start, image and "
                             f"vision_end ids {ids} of {str(hf_path)!r}'s config.json")
        processor = NativeImageProcessor.from_vision(hf_path, vision)
        return cls(processor, rule, text, rule.image_token_id)

    def identity(self) -> dict[str, Any]:
        """What a sample's length and keys depend on (part of a data index's key)."""
        return {"processor": self.processor.identity(), "image_text": self.image_text,
                "image_id": self.image_id}

    # ---- text ---------------------------------------------------------------------------
    def wrap(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with each ``<image>`` written as the model's image text."""
        return replace_placeholder(messages, LLAVA_IMAGE, self.image_text)

    def expand(self, encoded: EncodedConversation, counts: Sequence[int]
               ) -> EncodedConversation:
        """Image ``k``'s one placeholder id -> ``counts[k]`` copies.

        Raises:
            ValueError: as :func:`~mimotron.data.chat.expand_runs`.
        """
        return expand_runs(encoded, self.image_id, counts)

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

    def tokens_of(self, grids: Sequence[Grid]) -> list[int]:
        """Merged tokens of each grid."""
        return [t * h * w // self.processor.merge_size**2 for t, h, w in grids]

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

    def sample_keys(self, tokens: torch.Tensor, grids: Sequence[Grid], max_images: int
                    ) -> dict[str, torch.Tensor]:
        """``image_grid``, ``image_tokens`` and ``position_ids`` of one sample.

        Args:
            tokens: the sample's token ids (empty where the text is not loaded).
            grids: its images' grids, in the order of their placeholders.
            max_images: ``data.max_images_per_sample`` (above 1: ``[K, ...]`` keys).
        """
        grid = torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)
        counts = grid.prod(dim=-1) // self.processor.merge_size**2
        if tokens.numel():
            positions = mrope_positions(tokens[None], self.rule,
                                        grid if len(grids) else None)[0][:, 0]
        else:
            positions = torch.zeros(3, 0, dtype=torch.long)
        if max_images > 1:
            pad = max_images - grid.shape[0]
            return {"image_grid": F.pad(grid, (0, 0, 0, pad)),
                    "image_tokens": F.pad(counts, (0, pad)), "position_ids": positions}
        assert grid.shape[0] <= 1, "the check allows one image"
        first = grid[0] if len(grids) else torch.zeros(3, dtype=torch.long)
        return {"image_grid": first, "image_tokens": first.prod() // self.processor.merge_size**2,
                "position_ids": positions}

