"""LLaVA data as tar shards in the WebDataset layout: find the shards, list their samples.

A shard (``shard-000000.tar`` ...) holds samples as consecutive members sharing a
**key**: the member's path up to the first ``.`` of its file name (``a/b.0.json`` has key
``a/b`` and extension ``0.json``). Per sample:

* ``<key>.json``: the LLaVA sample (``conversations``, an optional ``id``: the key is the
  id when it has none; or ``messages``: :mod:`~mimotron.data.sample_keys`); its ``image``
  / ``audio`` fields (``images`` / ``audios``) are ignored (converted corpora keep the
  original paths there): the media are the sample's members;
* ``<key>.jpg`` / ``.jpeg`` / ``.png`` / ``.webp`` / ``.bmp`` / ``.gif`` / ``.tif`` /
  ``.tiff`` / ``.ppm``: its image; ``<key>.wav``: its audio clip. Any other member
  (``.txt``, ``.cls``, ``.mp4``, ...) would be read by nobody, so it makes the sample bad,
  naming it, unless ``data.ignore_keys`` lists its extension (``"txt"``): nothing in the
  data is dropped silently.

``data.path`` names the shards as a folder (every ``*.tar`` in it), one ``.tar`` file, a
glob pattern (``shards/*.tar``) or a brace range as WebDataset writes it
(``shards/shard-{000000..000099}.tar``); they are read in sorted order (brace ranges in
their own order; :mod:`mimotron.config.shard_paths` lists them). Brace ranges may name at
most :data:`~mimotron.config.shard_paths.MAX_BRACE_NAMES` paths (counted before any is
listed). Samples are read by byte offset (:class:`TarMember`), so shards must
be local or mounted files (no ``http://`` or ``pipe:`` URLs), and any sample can be read
alone: the run's global shuffle works as for a JSONL file.

:func:`write_shards` writes LLaVA samples with their media files in this layout (keys
are the samples' running numbers; the JSON keeps ``id`` and the conversation).

A shard that is not a tar file is an error naming it; one cut short keeps the samples
before the cut and reports the rest as one bad sample (``data.skip_bad_samples`` skips
it). Members are listed from the tar headers only (no data is read by the scan). A hard
link member is read through its target (a regular member earlier in the shard); a
sample with a GNU sparse member, a hard link to no earlier member or a member name that
is not UTF-8 is a bad sample naming the member.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mimotron.data.llava_file import SampleError
from mimotron.data.sample_keys import sample_layout

IMAGE_EXTENSIONS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm"})
AUDIO_EXTENSIONS = frozenset({"wav"})
_READ_EXTENSIONS = IMAGE_EXTENSIONS | AUDIO_EXTENSIONS | {"json"}  # others: see ShardSample


@dataclass(frozen=True)
class TarMember:
    """One member's bytes inside a shard: where they are, and a name for messages."""

    shard: str
    offset: int
    size: int
    name: str

    def read(self) -> bytes:
        """The member's bytes (one read at its offset).

        Raises:
            OSError: the shard is gone or shorter than the member (it changed).
        """
        with open(self.shard, "rb") as f:
            # Checked before reading: nothing is allocated for a size the shard lacks.
            end = os.fstat(f.fileno()).st_size
            if self.offset + self.size > end:
                raise OSError(f"{self} is cut short: it runs to byte {self.offset + self.size}"
                              f" of a {end}-byte shard")  # fmt: skip
            f.seek(self.offset)
            data = f.read(self.size)
        if len(data) != self.size:
            raise OSError(f"{self} is cut short: {len(data)} of {self.size} bytes")
        return data

    def open(self) -> io.BytesIO:
        """The member as a seekable stream named :meth:`__str__` (what decoders print)."""
        stream = io.BytesIO(self.read())
        stream.name = str(self)  # type: ignore[attr-defined]  # BytesIO takes attributes
        return stream

    def __str__(self) -> str:
        return f"{self.shard}:{self.name}"


@dataclass
class ShardSample:
    """The members of one sample of a shard, in shard order."""

    key: str
    ordinal: int
    conversation: TarMember | None = None
    media: dict[str, list[TarMember]] = field(default_factory=lambda: {"image": [],
                                                                        "audio": []})
    duplicate: str = ""  # a second member of the same extension, named
    refused: str = ""  # why a member makes the sample bad (sparse, link, name), or ""
    unread: list[str] = field(default_factory=list)  # members no reader takes, by name


def split_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name (WebDataset's rule: the first dot of the file)."""
    folder, _, file = name.rpartition("/")
    stem, _, extension = file.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension.lower()


def scan_shard(shard: Path) -> tuple[list[ShardSample], str]:
    """The samples of a shard, and why it could not be read to its end (``""``: it could).

    Raises:
        ValueError: the file is not a tar file at all (one line naming it).
    """
    samples: list[ShardSample] = []
    files: dict[str, tarfile.TarInfo] = {}  # regular members so far: hard links' targets
    try:
        archive = tarfile.open(shard, "r:")  # noqa: SIM115 - closed below
    except (tarfile.TarError, OSError) as exc:
        raise ValueError(f"data.path shard {str(shard)!r} is not a readable tar file: {exc} "
                         "(re-create it, or remove it from data.path)") from None
    try:
        for member in archive:
            if member.isfile() or member.islnk():
                _add_member(samples, shard, member, files)
        cut = _cut_short(shard, archive.offset)
    except (tarfile.TarError, OSError) as exc:
        cut = str(exc)
    finally:
        archive.close()
    if not cut:
        return samples, ""
    # Cut short: the last sample may be missing members; it goes with the rest.
    if samples:
        samples.pop()
    return samples, f"the shard is unreadable from here on: {cut}"


def _cut_short(shard: Path, end: int) -> str:
    """Why the shard does not end properly after its last member (``""``: it does).

    ``tarfile`` ends a listing quietly where the file ends (inside or before a header); a
    whole tar ends with zero blocks (the end-of-archive marker) after its last member.
    """
    size = shard.stat().st_size
    if size < end:
        return f"the file ends at byte {size}, inside a member that runs to byte {end}"
    with open(shard, "rb") as f:
        f.seek(end)
        tail = f.read(1 << 20)
    if tail.strip(b"\0"):
        return f"a partial or damaged header at byte {end}"
    if len(tail) < tarfile.BLOCKSIZE:
        return f"no end-of-archive marker after byte {end}: the file was cut there"
    return ""


def _add_member(samples: list[ShardSample], shard: Path, member: tarfile.TarInfo,
                files: dict[str, tarfile.TarInfo]) -> None:  # fmt: skip
    """File ``member`` (a regular member or a hard link) under its sample."""
    key, extension = split_name(member.name)
    if not samples or samples[-1].key != key:  # members of a sample are consecutive
        samples.append(ShardSample(key, len(samples)))
    sample = samples[-1]
    data = member
    if member.islnk():
        data = files.get(member.linkname, member)
    elif not member.issparse():
        files[member.name] = member
    last = extension.rpartition(".")[2]  # "0.json" is a json member too
    if last not in _READ_EXTENSIONS:
        sample.unread.append(member.name)  # the sample check names it (or data.ignore_keys)
        return
    refused = _refused(shard, member, data)
    if refused:
        sample.refused = sample.refused or refused
        return
    where = TarMember(str(shard), data.offset_data, data.size, member.name)
    if last == "json":
        if sample.conversation is not None:
            sample.duplicate = member.name
        sample.conversation = where
    elif last in IMAGE_EXTENSIONS:
        sample.media["image"].append(where)
    elif last in AUDIO_EXTENSIONS:
        sample.media["audio"].append(where)


def _refused(shard: Path, member: tarfile.TarInfo, data: tarfile.TarInfo) -> str:
    """Why ``member`` (whose bytes are ``data``'s) cannot be read by offset, or ``""``."""
    try:
        member.name.encode("utf-8")
    except UnicodeEncodeError:  # tarfile keeps undecodable bytes as lone surrogates
        raw = member.name.encode("utf-8", errors="surrogateescape")
        return (f"{str(shard)!r} holds the member {raw!r}, whose name is not UTF-8 "
                "(re-create the shard with UTF-8 names)")  # fmt: skip
    if member.issparse():
        return (f"{shard}:{member.name} is a GNU sparse member (claiming {member.size} "
                "bytes), which cannot be read by offset (re-create the shard without "
                "sparse files)")  # fmt: skip
    if data is member and member.islnk():
        return (f"{shard}:{member.name} is a hard link to {member.linkname!r}, which is not "
                "a file earlier in the shard")  # fmt: skip
    return ""


def write_shards(samples: Iterable[dict[str, Any]], root: str | Path, out: str | Path,
                 samples_per_shard: int = 1000) -> list[Path]:  # fmt: skip
    """Write LLaVA samples as ``out/shard-000000.tar``, ... (the layout above).

    Each sample's ``image`` / ``audio`` paths (``images`` / ``audios`` in the ``messages``
    layout; relative to ``root``) become members of
    the same key with the file's extension; the other fields go into ``<key>.json``.
    The members' metadata is fixed (mtime 0, mode 0644), so the same samples give the
    same bytes.

    Args:
        samples: LLaVA samples (one path per modality at most).
        root: the folder their media paths are relative to.
        out: the shard folder (created).
        samples_per_shard: samples per shard (>= 1).

    Returns:
        The shards written, in order.

    Raises:
        ValueError: ``samples_per_shard < 1``, a sample with more than one file of a
            modality, or one holding both ``conversations`` and ``messages``.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard!r} is invalid: expected >= 1")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[Path] = []
    archive = None
    try:
        for number, sample in enumerate(samples):
            if number % samples_per_shard == 0:
                if archive is not None:
                    archive.close()
                shards.append(folder / f"shard-{len(shards):06d}.tar")
                # Closed when the next shard starts, or at the end.
                archive = tarfile.open(shards[-1], "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
            assert archive is not None
            _write_sample(archive, f"{number:09d}", sample, Path(root))
    finally:
        if archive is not None:
            archive.close()
    return shards


def _write_sample(archive: tarfile.TarFile, key: str, sample: dict[str, Any], root: Path
                  ) -> None:  # fmt: skip
    members: list[tuple[str, bytes]] = []
    try:
        layout = sample_layout(sample)  # "images" / "audios" in the messages layout
    except SampleError as exc:
        raise ValueError(f"sample {sample.get('id')!r} {exc.reason}") from None
    for modality, field_name in (("image", layout.image), ("audio", layout.audio)):
        value = sample.get(field_name)
        paths = [] if value is None else [value] if isinstance(value, str) else list(value)
        if len(paths) > 1:
            raise ValueError(f"sample {sample.get('id')!r} has {len(paths)} {modality} files: "
                             "a shard sample holds at most one")  # fmt: skip
        for path in paths:
            extension = Path(path).suffix.lower().lstrip(".")
            members.append((f"{key}.{extension}", (root / path).read_bytes()))
    text = {k: v for k, v in sample.items() if k not in (layout.image, layout.audio)}
    members.insert(0, (f"{key}.json", json.dumps(text, ensure_ascii=False).encode("utf-8")))
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        archive.addfile(info, io.BytesIO(data))
