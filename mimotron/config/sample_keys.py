"""The keys of a LLaVA sample the loader reads, and the rule on ``data.ignore_keys``.

Any other key of a sample makes it bad unless ``data.ignore_keys`` lists it
(:func:`mimotron.data.sample_keys.check_sample_keys`), so nothing in the data is dropped
silently; ``data.ignore_keys`` may not list a key the loader reads.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

SAMPLE_KEYS = ("id", "image", "audio", "conversations")
"""The keys of a sample the loader reads (a shard's ``image`` / ``audio`` fields are read
as the documented hint that the media are the sample's members, and so count as read)."""
TURN_KEYS = ("from", "value")
"""The keys of a conversation turn the loader reads."""
MESSAGES_SAMPLE_KEYS = ("id", "images", "audios", "messages")
"""The keys read of a sample in the ``messages`` layout (LLaMA-Factory, ms-swift)."""
MESSAGE_KEYS = ("role", "content")
"""The keys read of a turn of ``messages``."""
VIDEO_KEYS = ("video", "videos")
"""The video keys of the two layouts: read only with a native-resolution vision module
(Qwen2.5-VL, Qwen3-VL), so not in :data:`READ_KEYS`: a run without one may ignore them."""
READ_KEYS = frozenset(SAMPLE_KEYS + TURN_KEYS + MESSAGES_SAMPLE_KEYS + MESSAGE_KEYS)
"""Keys ``data.ignore_keys`` may not list: the loader reads them."""


def check_ignore_keys(keys: Collection[Any]) -> None:
    """Raise unless ``data.ignore_keys`` holds non-empty strings the loader does not read.

    Raises:
        ValueError: ``data.ignore_keys=[...] is invalid: ...``.
    """
    bad = [k for k in keys if not isinstance(k, str) or not k]
    read = sorted(k for k in keys if isinstance(k, str) and k in READ_KEYS)
    if bad or read:
        why = (f"{bad[0]!r} is not a non-empty string" if bad
               else f"the loader reads {read[0]!r}: it cannot be ignored")
        raise ValueError(f"data.ignore_keys={list(keys)!r} is invalid: {why} (expected keys "
                         "the loader does not read, e.g. ['video'])")  # fmt: skip
