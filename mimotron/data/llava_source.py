"""Where a LLaVA data set's samples are: a JSONL file, a JSON list, or tar shards.

A source turns ``data.path`` into samples two ways, both without holding the file:

* **for the check** (once per run, :mod:`~mimotron.data.sample_index`): :meth:`prepare`
  (JSONL: the line starts; a JSON list: converted into the index folder), :meth:`chunks`
  (line ranges, or one shard each, checked in parallel) and :meth:`items` (the raw
  samples of one chunk with their addresses);
* **for a load**: :meth:`read` of one index row: only that sample's bytes are read.

An index row (:data:`ROW_DTYPE`) is a kept sample's address and what every rank knows
about it without loading it: its token count and which media it holds, and the CRC-32
of the JSON bytes the check read: a load reading other bytes there (the file was edited
after the check, even to the same size) gets a :class:`SampleError` naming the sample,
never a sample the check did not see.

A source's :meth:`identity` (part of the index key) holds every data file's real path,
size, modification time and change time (``st_ctime_ns``): the system sets the change
time on every write and on every change of the modification time, so an edit that puts
the size and modification time back still changes the key, for the cost of one
``stat`` a file. It also changes on ``chmod``, ``chown`` or a new hard link (the data is
checked again), and a copy of the data differs from the original (each node's own copy
has its own index).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mimotron.config.shard_paths import is_shard_path, shard_paths
from mimotron.data.llava_check import RawItem
from mimotron.data.llava_file import (
    SampleError,
    changed_message,
    is_json_list,
    json_list_to_jsonl,
    jsonl_line_spans,
    parse_line,
    read_jsonl_sample,
)
from mimotron.data.webdataset import TarMember, scan_shard

ROW_DTYPE = np.dtype([
    ("shard", "<i4"),         # shard number (0 for a file)
    ("ordinal", "<i8"),       # JSONL line - 1, JSON list item, sample number in its shard
    ("offset", "<i8"), ("size", "<i8"),  # the sample's JSON bytes
    ("image_offset", "<i8"), ("image_size", "<i8"),  # a shard sample's image member
    ("audio_offset", "<i8"), ("audio_size", "<i8"),  # ... and audio member (-1: none)
    ("length", "<i4"),        # tokens, placeholders expanded
    ("has_image", "?"), ("has_audio", "?"),
    ("crc", "<u4"),           # CRC-32 of the JSON bytes the check read
])  # fmt: skip
CONVERTED = "samples.jsonl"
"""A JSON list's items, one per line, in the index folder."""
_LINES_PER_CHUNK = 2048  # Small enough that waiting ranks see progress every few seconds.
_BYTES_PER_CHUNK = 16 << 20  # ... and that a chunk of long lines is read in bounded pieces.

Progress = Callable[[], None]


def open_source(path: str | Path) -> JsonlSource | ShardSource:
    """The source ``data.path`` names (shards: see :mod:`mimotron.data.webdataset`).

    Raises:
        ValueError: no such file, or no shard.
    """
    if is_shard_path(path):
        return ShardSource(shard_paths(path))
    return JsonlSource(Path(path), json_list=is_json_list(path))


class JsonlSource:
    """A JSONL file read by line spans, or a JSON list read through its converted lines.

    Args:
        path: the data file.
        json_list: the file is a JSON list (locations are items from 0, not lines).
    """

    def __init__(self, path: Path, json_list: bool) -> None:
        self.path, self.json_list = path, json_list
        self.data_file = path  # what is read: the file, or the converted list
        self._spans = np.zeros((0, 2), np.int64)

    def identity(self) -> dict[str, Any]:
        """What the index is keyed by: the file's real path, size, modification and
        change time (module docstring)."""
        return {"kind": "json" if self.json_list else "jsonl",
                "files": [stat_identity(self.path)]}

    def location(self, ordinal: int) -> str:
        return f"item {ordinal}" if self.json_list else f"line {ordinal + 1}"

    def row_location(self, row: np.void, key: str | None = None) -> str:
        """Where an index row's sample is, for messages."""
        del key
        return self.location(int(row["ordinal"]))

    def attach(self, folder: Path) -> None:
        """Read from ``folder``'s converted list from now on (a JSON list's index)."""
        if self.json_list:
            self.data_file = folder / CONVERTED

    def prepare(self, folder: Path, progress: Progress | None) -> None:
        """Convert a JSON list into ``folder``; find the line spans to check."""
        if self.json_list:
            json_list_to_jsonl(self.path, folder / CONVERTED, progress)
            self.attach(folder)
        self._spans = jsonl_line_spans(self.data_file, progress)

    def chunks(self) -> list[tuple[int, int]]:
        """Ranges of line numbers (from 0) to check, in file order: at most
        ``_LINES_PER_CHUNK`` lines and about ``_BYTES_PER_CHUNK`` bytes each (a checking
        process reads its chunk in one piece)."""
        num = len(self._spans)
        if not num:
            return []
        ends = np.cumsum(self._spans[:, 1] - self._spans[:, 0] + 1)
        lines, blocks = np.arange(num) // _LINES_PER_CHUNK, ends // _BYTES_PER_CHUNK
        starts = np.flatnonzero((np.diff(lines) != 0) | (np.diff(blocks) != 0)) + 1
        bounds = [0, *starts.tolist(), num]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def items(self, chunk: tuple[int, int]) -> Iterator[tuple[np.ndarray, RawItem]]:
        """``(row, item)`` of every non-blank line of ``chunk`` (read in one piece)."""
        first, last = chunk
        if first == last:
            return
        start, stop = int(self._spans[first, 0]), int(self._spans[last - 1, 1])
        with open(self.data_file, "rb") as f:
            f.seek(start)
            data = f.read(stop - start)
        for k in range(first, last):
            a, b = (int(x) - start for x in self._spans[k])
            raw = parse_line(data[a:b], converted=self.json_list)
            if raw is None:  # a blank line
                continue
            row = _empty_row(0, k)
            row["offset"], row["size"] = a + start, b - a
            row["crc"] = zlib.crc32(data[a:b])
            yield row, RawItem(self.location(k), raw)

    def read(self, row: np.void, key: str | None = None) -> RawItem:
        """The sample of an index row: only its bytes are read (``key``: unused)."""
        del key
        raw = read_jsonl_sample(self.data_file, int(row["offset"]), int(row["size"]),
                                converted=self.json_list, crc=int(row["crc"]))  # fmt: skip
        return RawItem(self.row_location(row), raw if raw is not None else
                       SampleError("the line is blank now: the file changed after the check"))


class ShardSource:
    """Tar shards in the WebDataset layout, one chunk per shard.

    Args:
        shards: the shard files, in order.
    """

    def __init__(self, shards: list[Path]) -> None:
        self.shards = shards
        self.path = shards[0].parent

    def identity(self) -> dict[str, Any]:
        """The index key's part: every shard's real path, size, modification and change
        time (module docstring)."""
        return {"kind": "webdataset", "files": [stat_identity(s) for s in self.shards]}

    def attach(self, folder: Path) -> None:
        del folder  # shards are read where they are

    def prepare(self, folder: Path, progress: Progress | None) -> None:
        del folder, progress  # each shard is listed by its own chunk

    def chunks(self) -> list[int]:
        return list(range(len(self.shards)))

    def location(self, shard: int, key: str) -> str:
        return f"{self.shards[shard].name} key {key!r}"

    def row_location(self, row: np.void, key: str | None = None) -> str:
        """Where an index row's sample is, for messages."""
        return self.location(int(row["shard"]), str(key))

    def items(self, chunk: int) -> Iterator[tuple[np.ndarray, RawItem]]:
        """``(row, item)`` of every sample of shard ``chunk``; a cut shard's rest is one
        bad item."""
        samples, cut = scan_shard(self.shards[chunk])
        for sample in samples:
            row = _empty_row(chunk, sample.ordinal)
            location = self.location(chunk, sample.key)
            if sample.refused:
                raw: Any = SampleError(sample.refused)
            elif sample.conversation is None:
                raw = SampleError(f"no .json member with key {sample.key!r}: expected the "
                                       "sample's conversation in <key>.json")  # fmt: skip
            elif sample.duplicate:
                raw = SampleError(f"two .json members with key {sample.key!r} "
                                  f"({sample.duplicate!r} is the second)")  # fmt: skip
            else:
                row["offset"] = sample.conversation.offset
                row["size"] = sample.conversation.size
                data = _read_member(sample.conversation)
                if not isinstance(data, SampleError):
                    row["crc"] = zlib.crc32(data)
                raw = _parse_member(sample.conversation, data)
            media = {m: tuple(files) for m, files in sample.media.items()}
            for modality in ("image", "audio"):
                if len(media[modality]) == 1:
                    row[f"{modality}_offset"] = media[modality][0].offset
                    row[f"{modality}_size"] = media[modality][0].size
            yield row, RawItem(location, raw, media, sample.key, tuple(sample.unread))
        if cut:
            yield _empty_row(chunk, -1), RawItem(f"{self.shards[chunk].name} after key "
                                                 f"{samples[-1].key if samples else None!r}",
                                                 SampleError(cut))  # fmt: skip

    def read(self, row: np.void, key: str | None = None) -> RawItem:
        """The sample of an index row (its key from the index): only its members are read."""
        shard, key = int(row["shard"]), str(key)
        name = str(self.shards[shard])
        conversation = TarMember(name, int(row["offset"]), int(row["size"]), f"{key}.json")
        media: dict[str, tuple[TarMember, ...]] = {}
        for modality in ("image", "audio"):
            offset = int(row[f"{modality}_offset"])
            media[modality] = () if offset < 0 else (
                TarMember(name, offset, int(row[f"{modality}_size"]), f"{key}.{modality}"),)
        data = _read_member(conversation)
        if not isinstance(data, SampleError) and zlib.crc32(data) != int(row["crc"]):
            data = SampleError(changed_message(str(conversation)))
        return RawItem(self.location(shard, key), _parse_member(conversation, data), media,
                       key)  # fmt: skip


def _read_member(member: TarMember) -> bytes | SampleError:
    """A shard member's bytes, or the SampleError reading them gave."""
    try:
        return member.read()
    except OSError as exc:
        return SampleError(f"cannot read {member}: {exc}")


def _parse_member(member: TarMember, data: bytes | SampleError) -> Any:
    """A shard's JSON member parsed from its bytes ``data``, or the SampleError."""
    if isinstance(data, SampleError):
        return data
    raw = parse_line(data)
    return raw if raw is not None else SampleError(f"{member} is empty")


def _empty_row(shard: int, ordinal: int) -> np.ndarray:
    row = np.zeros((), ROW_DTYPE)
    row["shard"], row["ordinal"] = shard, ordinal
    for modality in ("image", "audio"):
        row[f"{modality}_offset"], row[f"{modality}_size"] = -1, 0
    return row


def stat_identity(path: Path) -> list[Any]:
    """``[real path, size, mtime, ctime]`` of a data file (module docstring)."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def file_identity(folder: Path) -> list[list[Any]]:
    """``[name, size, mtime, ctime]`` of every file directly in ``folder`` (a tokenizer's)."""
    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file():
            stat = entry.stat()
            out.append([entry.name, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns])
    return out
