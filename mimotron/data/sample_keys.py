"""The keys a LLaVA sample may hold: nothing in the data is dropped silently.

The loader reads a sample's ``id``, ``image``, ``audio`` and ``conversations``, and a
turn's ``from`` and ``value`` (:mod:`mimotron.data.llava_check`). Any other key would be
read by nobody: a ``video`` beside the conversation, a per-turn loss ``weight``. The
sample would then train as if the key were not there, with no word said. So such a key
makes the sample bad (one line naming the key; ``data.skip_bad_samples`` skips it),
unless ``data.ignore_keys`` lists it: that the run trains without it is then a choice.

The keys themselves live in :mod:`mimotron.config.sample_keys`, where the config
validation refuses an ``ignore_keys`` entry naming a key the loader reads.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from mimotron.config.sample_keys import SAMPLE_KEYS, TURN_KEYS
from mimotron.data.llava_file import SampleError


def check_sample_keys(raw: dict[str, Any], ignore: Collection[str]) -> None:
    """Raise unless every key of ``raw`` and of its turns is read or ignored.

    Args:
        raw: the sample's JSON object (its ``conversations`` not yet checked).
        ignore: ``data.ignore_keys``.

    Raises:
        SampleError: ``sample key 'video' is not read by the loader ...`` (the first
            unread key of the sample, else of its first turn that has one).
    """
    unread = [k for k in raw if k not in SAMPLE_KEYS and k not in ignore]
    if unread:
        raise SampleError(f"sample key {unread[0]!r} is not read by the loader (it reads "
                          f"{', '.join(map(repr, SAMPLE_KEYS))}): the sample would train "
                          f"without it; list it in data.ignore_keys to train it so, or "
                          f"remove it from the data")  # fmt: skip
    turns = raw.get("conversations")
    for k, turn in enumerate(turns if isinstance(turns, list) else ()):
        if not isinstance(turn, dict):
            continue  # the turn's own check names it
        unread = [key for key in turn if key not in TURN_KEYS and key not in ignore]
        if unread:
            raise SampleError(f"conversations[{k}] key {unread[0]!r} is not read by the loader "
                              f"(a turn's keys read are 'from', 'value'): the turn would train "
                              f"without it; list it in data.ignore_keys to train it so, or "
                              f"remove it from the data")  # fmt: skip


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
