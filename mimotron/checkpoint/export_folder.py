"""The folder an export writes into: only one it owns, never a training input.

``mimotron export`` (both formats) writes only into a folder it owns:

- a new or empty ``OUT_DIR``, or
- one that holds only a previous export of its own: every file in it is listed by the
  record :data:`MARKER` (``.mimotron-export.json``) the exporter writes there.

Anything else (a user's ``my_finetune.ckpt``, a file of the same name an export would
write, a symbolic link) is refused with one line naming the folder and what is in the
way, before any tensor is read and before anything is written. So is a folder that is,
or whose module subfolder ``OUT_DIR/<m>`` would be, a folder the run read (any
``modules.<m>.hf_path``, ``data.tokenizer``, ``data.root``, the folder of
``data.path``), symbolic links resolved.

The exporter never deletes a file it did not write: a re-export over its own previous
export replaces the listed files it writes again and removes the listed files it does
not (a stale file of the other format), and nothing else. The record lists a file
before the file is written, so an export that fails halfway leaves a folder that the
next export still owns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from mimotron.outputs import check_output_dir

MARKER = ".mimotron-export.json"
"""The record of what an export wrote, at the top of ``OUT_DIR``."""
_FORMAT = "mimotron-export"  # the record's "format" value: what makes it ours
_SHOWN = 6  # files named in a refusal before "... and N more"


def run_input_folders(run_config: Mapping[str, Any]) -> dict[str, Path]:
    """The folders a run read, by config key: export never writes into one of them.

    Args:
        run_config: the run config a checkpoint records (``cfg.to_dict()``).

    Returns:
        ``{"modules.<m>.hf_path": folder, "data.tokenizer": ..., "data.root": ...,
        "data.path's folder": ..., "data.valid_path's folder": ...}`` for the keys that
        are set.
    """
    found: dict[str, Path] = {}
    for name, module in (run_config.get("modules") or {}).items():
        if isinstance(module, Mapping) and module.get("hf_path"):
            found[f"modules.{name}.hf_path"] = Path(str(module["hf_path"]))
    data = run_config.get("data") or {}
    for key in ("tokenizer", "root"):
        if data.get(key):
            found[f"data.{key}"] = Path(str(data[key]))
    for key in ("path", "valid_path"):  # data files: their folders hold the media
        if data.get(key):
            found[f"data.{key}'s folder"] = Path(str(data[key])).parent
    return found


class ExportFolder:
    """An export's output folder: what it may write, replace and remove.

    Create it before the checkpoint is read (it checks that the folder can be written
    and lists what is there), call :meth:`check` before any tensor is read, take every
    output path from :meth:`file`, and call :meth:`finish` after the last write.
    """

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        """Check that ``out_dir`` can be written and read its previous export record.

        Raises:
            ValueError: the folder cannot be written, or holds a record that is not one.
        """
        self.root = Path(out_dir)
        check_output_dir(self.root)
        self._previous: set[str] = set()
        self._foreign: list[str] = []
        self._written: set[str] = set()
        if self.root.is_dir():
            self._previous = _read_marker(self.root)
            files, links = _scan(self.root)
            self._foreign = sorted(files - self._previous) + [f"{n} (a link)" for n in links]

    def check(self, run_config: Mapping[str, Any] | None = None,
              subfolders: Iterable[str] = ()) -> None:
        """Refuse a folder this export does not own or that a run read.

        Args:
            run_config: the run config the checkpoint records (its input folders).
            subfolders: the folders the export will create inside ``OUT_DIR``.

        Raises:
            ValueError: one line naming the folder and what is in the way.
        """
        where = f"output folder {str(self.root)!r}"
        targets = {self.root.resolve(): where}
        targets.update({(self.root / s).resolve(): f"{where} (its subfolder {s}/)"
                        for s in subfolders})
        for key, folder in run_input_folders(run_config or {}).items():
            what = targets.get(folder.resolve())
            if what is not None:
                raise ValueError(f"{what} is {key}={str(folder)!r}, a folder the run read; "
                                 "export never writes into a training input: choose a new "
                                 "or empty folder")
        if self._foreign:
            more = len(self._foreign) - _SHOWN
            shown = ", ".join(self._foreign[:_SHOWN]) + (f", ... and {more} more"
                                                         if more > 0 else "")
            raise ValueError(f"{where} holds files this export did not write: {shown}; "
                             f"export into a new or empty folder (or one a previous export "
                             f"wrote, listed by its {MARKER})")

    def file(self, relative: str) -> Path:
        """The path of output file ``relative`` (``"language/config.json"``), recorded first.

        Its folder is created. The record lists the file before the caller writes it.
        """
        name = _checked_name(relative, where="export output")
        self._written.add(name)
        self._write_marker(self._previous | self._written)
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def finish(self) -> None:
        """Remove the previous export's files this one did not write; final record."""
        for name in sorted(self._previous - self._written):
            path = self.root / name
            if path.is_file() and not path.is_symlink():
                path.unlink()
            _remove_empty_parents(path.parent, self.root)
        self._write_marker(self._written)

    def _write_marker(self, files: set[str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        temp = self.root / f"{MARKER}.tmp"
        temp.write_text(json.dumps({"format": _FORMAT, "files": sorted(files)}, indent=1) + "\n")
        os.replace(temp, self.root / MARKER)  # a crash leaves the old record or the new one


def _read_marker(root: Path) -> set[str]:
    """The files a previous export's record lists (none without a record).

    Raises:
        ValueError: the record is unreadable, not ours, or names a file outside ``root``.
    """
    path = root / MARKER
    if not path.exists() or path.is_symlink():
        return set()  # a link in the record's place is in the way (see _scan)
    problem = f"output folder {str(root)!r} holds a {MARKER} that is not an export record"
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{problem} ({exc}); remove it or choose another folder") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("format") != _FORMAT \
            or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ValueError(f"{problem}; remove it or choose another folder")
    return {_checked_name(f, where=f"{path} lists") for f in files}


def _checked_name(name: str, where: str) -> str:
    """A relative file name inside the folder (a forged record must not reach outside)."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or not pure.parts or ".." in pure.parts or name == MARKER:
        raise ValueError(f"{where} {name!r}: expected a file name inside the export folder")
    return pure.as_posix()


def _scan(root: Path) -> tuple[set[str], list[str]]:
    """``(files, links)`` under ``root`` as relative names; links are never followed."""
    files: set[str] = set()
    links: list[str] = []
    for folder, dirs, names in os.walk(root):
        base = Path(folder).relative_to(root)
        for name in list(dirs):
            if (Path(folder) / name).is_symlink():
                links.append((base / name).as_posix())
                dirs.remove(name)
        for name in names:
            relative = (base / name).as_posix()
            if (Path(folder) / name).is_symlink():
                links.append(relative)
            elif relative not in (MARKER, f"{MARKER}.tmp"):
                files.add(relative)
    return files, sorted(links)


def _remove_empty_parents(folder: Path, root: Path) -> None:
    """Remove ``folder`` and its parents below ``root`` while they are empty."""
    while folder != root and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
