"""The ``metrics.jsonl`` format: how records are encoded, and read back strictly.

One JSON object per line, each with an integer ``iteration``. Non-finite numbers (a NaN
loss, an infinite gradient norm) are written as ``null``: bare ``NaN`` / ``Infinity`` are
not JSON and break other readers (``jq``, pandas' strict mode, browsers).

A crash while a line is being written (a full disk, a kill) can leave the *last* line
torn: readers that continue such a file (a resumed run, ``mimotron plot`` on a live run)
drop that one line and say so. Anything else that is not a record, anywhere in the
file, is an error naming the file and the line: it means the file was damaged or is not
a metrics file, and silently skipping it would hide lost data.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mimotron.run_files import write_atomic

METRICS_FILE = "metrics.jsonl"


class MetricsFileError(ValueError):
    """``metrics.jsonl`` holds something other than records (names the file and line)."""


def finite_or_null(value: Any) -> Any:
    """``value`` with every non-finite float (at any depth) replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    return value


def encode_record(record: dict[str, Any]) -> str:
    """One ``metrics.jsonl`` line (with its newline); non-finite numbers become ``null``.

    Raises:
        ValueError: a value JSON cannot hold (``allow_nan=False`` catches any non-finite
            number the conversion missed, e.g. a numpy scalar).
    """
    return json.dumps(finite_or_null(record), allow_nan=False) + "\n"


@dataclass
class MetricsContents:
    """What :func:`read_metrics_file` found.

    Attributes:
        records: the records, in file order.
        torn_line: the 1-based number of a torn final line that was dropped, or None.
        terminated: whether the file ends with a newline (or is empty); an appender must
            start a fresh line otherwise.
    """

    records: list[dict[str, Any]]
    torn_line: int | None
    terminated: bool


def _parse(path: Path, number: int, line: str) -> dict[str, Any]:
    """One line as a record; raises :class:`MetricsFileError` naming file and line."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise MetricsFileError(
            f"{path} line {number} is not JSON ({exc.msg} at column {exc.colno}): the "
            "file is damaged; fix or delete that line, or move the file aside") from None
    if not isinstance(record, dict):
        raise MetricsFileError(
            f"{path} line {number} is not a JSON object (found a {type(record).__name__}): "
            "every metrics line is one record; fix or delete that line")
    iteration = record.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool):
        raise MetricsFileError(
            f"{path} line {number} has no integer 'iteration' (found {iteration!r}): "
            "not a mimotron metrics record")
    return record


def read_metrics_file(path: Path) -> MetricsContents:
    """Read every record of a metrics file, dropping a torn final line.

    The final line counts as torn when it does not end with a newline and is not valid
    JSON: the writer writes each line whole, so only an interrupted write leaves that.

    Args:
        path: a ``metrics.jsonl`` file (must exist).

    Returns:
        The records, and whether a torn final line was dropped.

    Raises:
        MetricsFileError: any other line is not a record (names the file and line).
        OSError: the file cannot be read.
    """
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    # "a\nb\n" splits into [..., ""]: a terminated file has an empty last element.
    last = lines.pop()
    records, torn = [], None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            records.append(_parse(path, number, line))
    if last.strip():
        try:
            records.append(_parse(path, len(lines) + 1, last))
        except MetricsFileError:
            if _is_json(last):
                raise  # A whole line that is not a record: not a torn write.
            torn = len(lines) + 1
    return MetricsContents(records, torn, terminated=not last)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def rewrite_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records``, atomically (a crash keeps the old file whole).

    Lines are re-encoded, so values another writer stored as bare ``NaN`` become ``null``.

    Raises:
        RunFileError: the new file could not be written (a full disk; names ``path``).
    """
    write_atomic(path, "".join(encode_record(r) for r in records))
