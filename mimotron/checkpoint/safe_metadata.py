"""Read DCP's ``.metadata`` without running code from it: a restricted unpickler.

DCP stores a checkpoint's index (keys, shapes, dtypes, which file holds which bytes) as
a pickle. Plain ``pickle.load`` calls whatever a pickle names, so a crafted
``.metadata`` runs arbitrary code on every rank that loads the checkpoint, and on
``mimotron export``. The manifest's SHA-256 does not prevent that: it detects damage
(truncation, bit rot), not tampering, since whoever can write ``.metadata`` can rewrite
``manifest.json`` too.

:class:`MetadataUnpickler` resolves only the globals a DCP metadata pickle needs (listed
from real checkpoints with ``pickletools``): DCP's metadata dataclasses, ``torch.Size``,
torch dtypes / layouts / memory formats, paths and plain containers. Anything else is
refused before it is looked up, with the file and the global named.
:class:`SafeFileSystemReader` is DCP's file-system reader with that unpickler, so
``dcp.load`` (which reads the metadata again itself) never falls back to ``pickle``.
The data files need nothing extra: DCP reads tensors with ``torch.load(weights_only=True)``
and :class:`~mimotron.checkpoint.load.SafeLoadPlanner` reads non-tensor entries so too.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mimotron.checkpoint.files import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a DCP metadata pickle may reference; every one of them only
# builds data (a dataclass, an enum member, a size, a path, a container).
_ALLOWED = frozenset({
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # torch.layout pickles as a call of this name -> layout lookup.
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("set", "frozenset", "bytearray")),
    *(("pathlib", name) for name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                     "PureWindowsPath")),
})
# torch.float32 and friends pickle as ("torch", "float32"): admitted when the name is a
# dtype, layout or memory format in torch's own namespace.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


# The only objects whose state a pickle may set (``BUILD``): instances of DCP's metadata
# dataclasses. ``BUILD`` on anything else would set attributes on whatever is on the
# stack, e.g. a class or function the allow-list admits, monkeypatching it for the whole
# process (``pathlib.Path.exists = frozenset``).
_BUILDABLE = (
    *((_DCP_METADATA, name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
)


def _buildable_types() -> tuple[type, ...]:
    import importlib

    return tuple(getattr(importlib.import_module(m), n) for m, n in _BUILDABLE)


class MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the Python one, see BUILD
    """An unpickler that resolves only DCP metadata classes and plain data.

    Every way a pickle can call something (``REDUCE``, ``NEWOBJ``, ``INST``, ``OBJ``,
    ``BUILD`` with ``__setstate__``, extension codes) first gets the callable from
    :meth:`find_class`, so refusing a global there refuses every call of it. ``BUILD``
    (set an object's state) is admitted only on instances of DCP's metadata dataclasses
    and only for plain attribute names, which needs the pure-Python unpickler (the C one
    has no hook for it); metadata files are small.
    """

    dispatch = dict(pickle._Unpickler.dispatch)  # noqa: SLF001

    def find_class(self, module: str, name: str) -> Any:
        """The global ``module.name`` if it is allowed; else refuse (names it).

        Raises:
            pickle.UnpicklingError: the global is not one DCP metadata uses.
        """
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), _TORCH_VALUE_TYPES):
            return vars(torch)[name]
        raise pickle.UnpicklingError(f"refusing to unpickle global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        """DCP metadata has no persistent ids; refuse any."""
        raise pickle.UnpicklingError(f"refusing persistent id {pid!r}")

    def _load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) not in _buildable_types():
            raise pickle.UnpicklingError(
                f"refusing to set the state of {type(inst).__name__} {inst!r:.60}")
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        names = [k for part in parts if isinstance(part, dict) for k in part]
        if any(not isinstance(k, str) or k.startswith("__") for k in names):
            raise pickle.UnpicklingError(
                f"refusing to set attributes {names!r:.80} of {type(inst).__name__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = _load_build


def load_metadata(file: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with :class:`MetadataUnpickler`.

    Raises:
        CheckpointError: the file names a global outside the allow-list (a crafted or
            foreign file), is damaged, or does not hold DCP metadata (names the file).
    """
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        if str(exc).startswith("refusing"):
            raise CheckpointError(
                f"checkpoint file {file} refused: {exc}, which DCP checkpoint metadata "
                "never holds (the file was crafted, or written by an incompatible "
                "torch)") from None
        raise CheckpointError(f"checkpoint file {file} is unreadable: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any other failure means a bad file
        raise CheckpointError(
            f"checkpoint file {file} is unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint file {file} is unreadable: it holds a "
                              f"{type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading ``.metadata`` with :func:`load_metadata`.

    Pass it to ``dcp.load(..., storage_reader=...)``: given a ``checkpoint_id`` alone,
    DCP builds a plain reader that unpickles the metadata without restriction.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (or rank ``kwargs["rank"]``'s), safely unpickled."""
        metadata = load_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # As FileSystemReader does.
        return metadata
