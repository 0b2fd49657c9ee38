"""TensorBoard as a metrics sink beside ``metrics.jsonl`` (``log.tensorboard``).

The logging rank writes one TensorBoard event file under ``<log.dir>/tensorboard``:
each record's numbers become scalars against its ``iteration`` (nested values as
``a/b`` tags, see :func:`mimotron.training.metrics._scalars`).

The events are written here, in the training thread, and flushed with each record,
rather than by ``torch.utils.tensorboard.SummaryWriter``, whose background thread
reopens the file on every flush (following any link put there) and, when a write
fails, prints a thread traceback and raises the error later, at an unrelated call.
Here the file is created new (a random name, ``O_EXCL``, never through a link: see
:mod:`mimotron.run_files`) and kept open, and a failed write is caught where it happens.

**A write that fails mid-run** (a full disk, an I/O error, a folder gone bad) is one
line on stderr naming the folder, and training goes on without TensorBoard: the scalars
are a view of ``metrics.jsonl``, which keeps every record (``mimotron plot`` draws it),
so losing the view is no reason to lose the training still to come. A failure to
*start* (the folder cannot be made, or is a link) stops the run before it trains, since
a rerun then costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from mimotron.run_files import UnsafeRunFile, open_fd, write_error

TENSORBOARD_DIR = "tensorboard"


class TensorBoardSink:
    """One event file under ``folder`` (rules in the module docstring).

    Args:
        folder: ``<log.dir>/tensorboard`` (created if missing).

    Raises:
        UnsafeRunFile: ``folder`` is a link, or not a directory (names it).
        RunFileError: the folder or the event file cannot be created (names it).
    """

    def __init__(self, folder: Path) -> None:
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.folder = Path(folder)
        if self.folder.is_symlink() or (self.folder.exists() and not self.folder.is_dir()):
            what = "a symlink" if self.folder.is_symlink() else "not a directory"
            raise UnsafeRunFile(f"{self.folder} is {what}: log.tensorboard=true writes its "
                                "events into a folder of that name; remove or move it aside")
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{secrets.token_hex(4)}")
        self.path = self.folder / name
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(self.folder, exc) from None
        fd = open_fd(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        self._file: BinaryIO | None = os.fdopen(fd, "wb")
        self._records = RecordWriter(self._file)
        from tensorboard.compat.proto.event_pb2 import Event

        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: object) -> None:
        assert self._file is not None
        try:
            self._records.write(event.SerializeToString())  # type: ignore[attr-defined]
            self._file.flush()
        except OSError as exc:
            raise write_error(self.path, exc) from None

    def add_scalars(self, step: int, scalars: Iterable[tuple[str, float]]) -> bool:
        """Write one event holding ``scalars`` at ``step``.

        Returns:
            False when the write failed: the sink said so in one line on stderr and is
            closed (later calls do nothing); True otherwise.
        """
        if self._file is None:
            return False
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars]
        try:
            self._write(Event(wall_time=time.time(), step=step,
                              summary=Summary(value=values)))
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            print(f"metrics: TensorBoard cannot write into {self.folder} ({reason}); "
                  "training goes on without TensorBoard (metrics.jsonl keeps every record)",
                  file=sys.stderr, flush=True)
            self.close()
            return False
        return True

    @property
    def open(self) -> bool:
        """Whether events are still written (False after a failed write or :meth:`close`)."""
        return self._file is not None

    def close(self) -> None:
        """Close the event file (errors on close are moot: every event was flushed)."""
        file, self._file = self._file, None
        if file is not None:
            # Already reported by the write that failed, or nothing was pending.
            with contextlib.suppress(OSError):
                file.close()


__all__ = ["TENSORBOARD_DIR", "TensorBoardSink", "UnsafeRunFile"]
