"""Which tar shards ``data.path`` names: a folder of ``.tar`` files, one ``.tar``, a
glob, or brace patterns (``shard-{000000..000009}.tar``, ``{a,b}``), in reading order.

Config validation needs the answer before any rank starts, and the WebDataset reader
(:mod:`mimotron.data.webdataset`) reads the same list. A brace range is counted before it
is expanded, so a pattern naming a billion shards is refused in one line instead of
filling the memory.
"""

from __future__ import annotations

import glob
import math
import re
from pathlib import Path

_GLOB_CHARS = re.compile(r"[*?\[]")
_BRACES = re.compile(r"\{([^{}]*)\}")
MAX_BRACE_NAMES = 100_000
"""The most paths ``data.path``'s brace ranges may name (counted before expanding)."""


def is_shard_path(path: str | Path) -> bool:
    """Whether ``data.path`` names tar shards (a folder, a ``.tar``, a glob or brace pattern)."""
    text = str(path)
    return (Path(text).is_dir() or text.endswith(".tar") or bool(_GLOB_CHARS.search(text))
            or bool(_BRACES.search(text)))  # fmt: skip


def shard_paths(path: str | Path) -> list[Path]:
    """The shards ``data.path`` names, in reading order (rules in the module docstring).

    Raises:
        ValueError: no shard found, a shard a brace range names is missing, or brace
            ranges naming more than :data:`MAX_BRACE_NAMES` paths.
    """
    text = str(path)
    found: list[Path] = []
    for pattern in _expand_braces(text):
        if Path(pattern).is_dir():
            found += sorted(Path(pattern).glob("*.tar"))
        elif _GLOB_CHARS.search(pattern):
            found += sorted(Path(p) for p in glob.glob(pattern) if p.endswith(".tar"))
        elif Path(pattern).is_file():
            found.append(Path(pattern))
        else:
            raise ValueError(f"data.path={text!r} names the shard {pattern!r}, which does not "
                             "exist")  # fmt: skip
    if not found:
        raise ValueError(f"data.path={text!r} is invalid: no .tar shard found (expected a "
                         "folder of shards, a .tar file, a glob or a {000000..000009} range)")
    return found


def _expand_braces(text: str) -> list[str]:
    """``a{1..3}b`` -> ``a1b a2b a3b`` (zero padding kept), ``a{x,y}`` -> ``ax ay``.

    Raises:
        ValueError: the braces name more than :data:`MAX_BRACE_NAMES` paths (counted
            before expanding: a range's size is its bounds' difference).
    """
    count = math.prod(_option_count(m.group(1)) for m in _BRACES.finditer(text))
    out, done = [text], []
    while out:  # one brace group of every name at a time (nested groups appear later)
        count = max(count, len(done) + sum(_count_first(name) for name in out))
        if count > MAX_BRACE_NAMES:
            raise ValueError(f"data.path={text!r} names {count} shards by its brace ranges: "
                             f"at most {MAX_BRACE_NAMES} are accepted (name a folder or a "
                             "glob of the shards instead)")  # fmt: skip
        pending = []
        for name in out:
            match = _BRACES.search(name)
            if match is None:
                done.append(name)
                continue
            head, tail = name[:match.start()], name[match.end():]
            pending += [head + option + tail for option in _options(match.group(1))]
        out = pending
    return done


def _count_first(name: str) -> int:
    """Names the first brace group of ``name`` expands into (1 without braces)."""
    match = _BRACES.search(name)
    return 1 if match is None else _option_count(match.group(1))


def _option_count(body: str) -> int:
    """How many options a brace body holds, without listing them."""
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span:
        return max(0, int(span.group(2)) - int(span.group(1)) + 1)
    return body.count(",") + 1


def _options(body: str) -> list[str]:
    """A brace body's options: a numeric range (zero padding kept) or a comma list."""
    span = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if span is None:
        return body.split(",")
    first, last = span.groups()
    width = len(first) if first.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
