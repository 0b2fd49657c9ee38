"""The keys a LLaVA sample may hold: nothing in the data is dropped silently.

The loader reads a sample's ``id``, ``image``, ``audio`` and ``conversations``, and a
turn's ``from`` and ``value`` (:mod:`mimotron.data.llava_check`). Any other key would be
read by nobody: a ``video`` beside the conversation, a per-turn loss ``weight``. The
sample would then train as if the key were not there, with no word said. So such a key
makes the sample bad (one line naming the key; ``data.skip_bad_samples`` skips it),
unless ``data.ignore_keys`` lists it: that the run trains without it is then a choice.

A sample comes in one of two **layouts** (:class:`SampleLayout`): LLaVA's
(``conversations`` of ``from`` / ``value`` turns, ``image``, ``audio``) or the ``messages``
layout of LLaMA-Factory and ms-swift (``messages`` of ``role`` / ``content`` turns,
``images``, ``audios``). A sample holding ``messages`` uses the second, any other the
first; one holding both is bad. Each layout reads its own keys only: an ``images`` beside
``conversations`` is a key no reader takes, as a ``video`` is.

**Videos** (``video`` beside ``conversations``, ``videos`` beside ``messages``) are read
only with a native-resolution vision module (Qwen2.5-VL, Qwen3-VL:
:mod:`mimotron.data.native_video`); any other run refuses the key as before, unless
``data.ignore_keys`` lists it.

The keys themselves live in :mod:`mimotron.config.sample_keys`, where the config
validation refuses an ``ignore_keys`` entry naming a key the loader reads.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mimotron.data.llava_file import SampleError


@dataclass(frozen=True)
class SampleLayout:
    """The names a sample's keys have in one layout (module docstring).

    Attributes:
        turns: the list of turns (``"conversations"``).
        role: a turn's speaker (``"from"``).
        content: a turn's text (``"value"``).
        image: the image path or paths (``"image"``).
        audio: the audio clip's path (``"audio"``).
        roles: the speakers to name when a role is unknown (``"'human' or 'gpt'"``).
        video: the video path or paths (``"video"``; read with a native vision module).
    """

    turns: str
    role: str
    content: str
    image: str
    audio: str
    roles: str
    video: str = ""

    @property
    def sample_keys(self) -> tuple[str, ...]:
        """The sample's keys the loader reads, in the order messages list them."""
        return ("id", self.image, self.audio, self.turns)

    @property
    def turn_keys(self) -> tuple[str, str]:
        """A turn's keys the loader reads."""
        return (self.role, self.content)


# Their keys are those of mimotron.config.sample_keys (tests/test_llava_messages.py).
LLAVA_LAYOUT = SampleLayout("conversations", "from", "value", "image", "audio",
                            "'human' or 'gpt'", "video")  # fmt: skip
MESSAGES_LAYOUT = SampleLayout("messages", "role", "content", "images", "audios",
                               "'user' or 'assistant'", "videos")  # fmt: skip


def sample_layout(raw: Mapping[str, Any]) -> SampleLayout:
    """The layout of the sample ``raw`` (module docstring).

    Raises:
        SampleError: the sample holds both ``conversations`` and ``messages``.
    """
    if MESSAGES_LAYOUT.turns not in raw:
        return LLAVA_LAYOUT
    if LLAVA_LAYOUT.turns in raw:
        raise SampleError("holds both 'conversations' (the LLaVA layout) and 'messages' "
                          "(the LLaMA-Factory / ms-swift layout): expected one of them")
    return MESSAGES_LAYOUT


def check_sample_keys(raw: dict[str, Any], ignore: Collection[str], videos: bool = False
                      ) -> None:  # fmt: skip
    """Raise unless every key of ``raw`` and of its turns is read or ignored.

    Args:
        raw: the sample's JSON object (its turns not yet checked).
        ignore: ``data.ignore_keys``.
        videos: the layout's video key is read (a native-resolution vision module).

    Raises:
        SampleError: ``sample key 'video' is not read by the loader ...`` (the first
            unread key of the sample, else of its first turn that has one), or the
            sample holds both layouts.
    """
    layout = sample_layout(raw)
    read = (*layout.sample_keys, layout.video) if videos else layout.sample_keys
    unread = [k for k in raw if k not in read and k not in ignore]
    if unread:
        raise SampleError(f"sample key {unread[0]!r} is not read by the loader (it reads "
                          f"{', '.join(map(repr, read))}): the sample would train "
                          f"without it; list it in data.ignore_keys to train it so, or "
                          f"remove it from the data")  # fmt: skip
    turns = raw.get(layout.turns)
    for k, turn in enumerate(turns if isinstance(turns, list) else ()):
        if not isinstance(turn, dict):
            continue  # the turn's own check names it
        unread = [key for key in turn if key not in layout.turn_keys and key not in ignore]
        if unread:
            raise SampleError(f"{layout.turns}[{k}] key {unread[0]!r} is not read by the "
                              f"loader (a turn's keys read are "
                              f"{', '.join(map(repr, layout.turn_keys))}): the turn would "
                              f"train without it; list it in data.ignore_keys to train it "
                              f"so, or remove it from the data")  # fmt: skip


def check_shard_members(members: Collection[str], ignore: Collection[str]) -> None:
    """Raise unless every member of a shard sample that no reader takes is ignored.

    Args:
        members: the sample's unread members (``a/b.txt``, ``k.0.mp4``), in shard order.
        ignore: ``data.ignore_keys``; a member is ignored by its last extension (``txt``).

    Raises:
        SampleError: naming the first member not ignored and its extension.
    """
    for name in members:
        extension = name.rpartition("/")[2].rpartition(".")[2].lower()
        if extension not in ignore:
            raise SampleError(f"shard member {name!r} is not read by the loader (it reads "
                              f"the .json conversation, image files and .wav audio): the "
                              f"sample would train without it; list {extension!r} in "
                              f"data.ignore_keys to train it so, or remove it from the shard")
