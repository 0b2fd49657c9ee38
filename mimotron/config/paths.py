"""Where a run may write: ``name``, ``log.dir`` and ``checkpoint.dir`` rules.

A run writes ``metrics.jsonl``, ``tensorboard/``, ``profile/``, a lock file and
``iter_*`` folders straight into its log and checkpoint directories, and with
``train.overwrite`` it moves what it finds there. Pointed at ``/``, ``/etc`` or the home
folder itself it would litter (or rearrange) a system folder; a ``name`` with path
separators would put ``runs/<name>`` anywhere (``name = "../../../tmp/x"``). Both are
refused by config validation, before anything is created or launched.
"""

from __future__ import annotations

import os
from pathlib import Path

from mimotron.config.schema import MimoConfig

SYSTEM_FOLDERS = ("/", "/etc", "/usr", "/bin", "/sbin", "/proc", "/sys", "/dev", "/boot",
                  "/var")
"""Folders a run directory may not be (their subfolders are fine); also ``/lib*`` and
the home folder itself."""


def _system_folder(path: Path) -> bool:
    """Whether ``path`` is one of the system folders (``/lib*``: any top-level lib)."""
    text = str(path)
    if text in SYSTEM_FOLDERS:
        return True
    return path.parent == Path("/") and path.name.startswith("lib")


def _forbidden(directory: str) -> str | None:
    """The system folder ``directory`` names (as written or through symlinks), or None."""
    written = Path(os.path.abspath(os.path.expanduser(directory)))
    home = Path(os.path.expanduser("~"))
    for path in (written, written.resolve()):
        if _system_folder(path) or path in (home, home.resolve()):
            return str(path)
    return None


def check_run_dir(key: str, directory: str) -> None:
    """``directory`` (the value of ``key``) is not a system folder or the home folder.

    Raises:
        ValueError: one line naming the key, the value and what is valid.
    """
    if not directory:
        return  # The default, under runs/<name>.
    found = _forbidden(directory)
    if found is not None:
        raise ValueError(
            f"{key}={directory!r} is invalid: expected a run's own folder, not the system "
            f"or home folder {found} (/, /etc, /usr, /bin, /sbin, /lib*, /proc, /sys, /dev, "
            "/boot, /var and ~ itself are refused; a subfolder such as ~/runs/x is fine)")


def check_name(name: str) -> None:
    """``name`` is one folder name under ``runs/``.

    Raises:
        ValueError: one line naming ``name``, its value and what is valid.
    """
    separators = {"/", os.sep, *(os.altsep or "")}
    if not name or name in (".", "..") or any(s in name for s in separators) \
            or "\0" in name:
        raise ValueError(
            f"name={name!r} is invalid: expected a folder name for runs/<name> (not empty, "
            "no '/' and not '.' or '..'); set log.dir to write somewhere else")


def check_paths(cfg: MimoConfig) -> None:
    """Check ``name``, ``log.dir`` and ``checkpoint.dir`` (see the module docstring).

    Raises:
        ValueError: the first invalid one, naming the field and the value.
    """
    check_name(cfg.name)
    check_run_dir("log.dir", cfg.log.dir)
    check_run_dir("checkpoint.dir", cfg.checkpoint.dir)
