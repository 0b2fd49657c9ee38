"""Names of Hugging Face checkpoint tensors <-> our parameter names, and reading them.

A :class:`WeightMap` translates between the names inside one of our towers
(``layers.3.attn.wq.weight``) and the names ``transformers`` writes
(``encoder.layers.3.self_attn.q_proj.weight``), both ways, from one table of prefix
rules. A checkpoint may hold the tower under a prefix (``vision_model.`` in a full
``CLIPModel``, ``model.encoder.`` in ``WhisperForConditionalGeneration``) next to parts
that are not ours (a text tower, a decoder): those are ignored, anything else that does
not map is "unexpected".

:func:`load_hf_weights` reads a local folder (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) with ``safetensors.safe_open(...).get_slice``: only the
tensors the module instance holds (one pipeline stage) and, for a DTensor parameter,
only this rank's slice, so no rank ever materialises a tensor it does not keep. It does
no collective, so a bad folder fails on every rank before any communication.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)"))


@dataclass(frozen=True)
class WeightMap:
    """Prefix rules between our names and a family's Hugging Face names.

    Args:
        rules: ``(our_prefix, hf_prefix)`` pairs; ``{i}`` stands for a layer index.
            A name maps by the first rule whose prefix it starts with.
        prefixes: where the tower may sit inside a checkpoint (``""`` = at the root),
            in order of preference.
        ignored: regular expressions of checkpoint names (full, with prefix) that belong
            to parts we do not build (text tower, decoder, pooling head).
        reshaped: our names whose tensor is the HF tensor with a leading 1 added.
    """

    rules: tuple[tuple[str, str], ...]
    prefixes: tuple[str, ...]
    ignored: tuple[str, ...] = ()
    reshaped: frozenset[str] = frozenset()
    _ours: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _hfs: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ours", tuple(_pattern(o) for o, _ in self.rules))
        object.__setattr__(self, "_hfs", tuple(_pattern(h) for _, h in self.rules))

    @staticmethod
    def _translate(
        name: str, patterns: tuple[re.Pattern[str], ...], targets: list[str]
    ) -> str | None:
        for pattern, target in zip(patterns, targets, strict=True):
            match = pattern.match(name)
            if match:
                head = target.replace("{i}", match.group(1)) if match.groups() else target
                return head + name[match.end():]
        return None

    def to_hf(self, name: str) -> str:
        """The checkpoint name (without prefix) of our tower-local ``name``.

        Raises:
            KeyError: ``name`` is not a name of this family's towers.
        """
        hf = self._translate(name, self._ours, [h for _, h in self.rules])
        if hf is None:
            raise KeyError(f"{name!r} has no Hugging Face name in this family")
        return hf

    def from_hf(self, hf_name: str) -> str | None:
        """Our tower-local name of checkpoint name ``hf_name`` (prefix removed), or None."""
        return self._translate(hf_name, self._hfs, [o for o, _ in self.rules])

    def is_ignored(self, hf_name: str) -> bool:
        """Whether a full checkpoint name belongs to a part this family does not build."""
        return any(re.match(p, hf_name) for p in self.ignored)


def _checkpoint_files(folder: Path) -> dict[str, Path]:
    """Checkpoint name -> file holding it; raises ``ValueError`` for an unusable folder."""
    if not folder.is_dir():
        raise ValueError(
            f"Hugging Face folder {str(folder)!r} does not exist (only local folders are "
            "read; nothing is downloaded)"
        )
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 - not a dict
    raise ValueError(
        f"Hugging Face folder {str(folder)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}"
    )


def _choose_prefix(names: list[str], weight_map: WeightMap) -> str:
    """The candidate prefix under which most checkpoint names map to ours."""
    def hits(prefix: str) -> int:
        return sum(
            1 for n in names if n.startswith(prefix) and weight_map.from_hf(n[len(prefix):])
        )
    return max(weight_map.prefixes, key=hits)  # max keeps the first of equal counts


def _targets(tower: nn.Module) -> dict[str, torch.Tensor]:
    """Tower-local name -> parameter or buffer to fill (tied tensors once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*tower.named_parameters(), *tower.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def _expected_hf_shape(name: str, tensor: torch.Tensor, weight_map: WeightMap) -> tuple[int, ...]:
    shape = tuple(tensor.shape)  # a DTensor reports its global shape
    return shape[1:] if name in weight_map.reshaped else shape


def check_checkpoint(
    tower: nn.Module, files: dict[str, Path], weight_map: WeightMap
) -> dict[str, str]:
    """Match a tower instance against a checkpoint; one ``ValueError`` names every fault.

    Args:
        tower: the tower instance (one pipeline stage or all of it).
        files: checkpoint name -> file, from the folder.
        weight_map: the family's names.

    Returns:
        Our tower-local name -> full checkpoint name, for every tensor the tower holds.

    Raises:
        ValueError: tensors missing from the checkpoint, checkpoint tensors that map to
            nothing of the family, or tensors whose shape differs from ours.
    """
    prefix = _choose_prefix(list(files), weight_map)
    unexpected = sorted(
        n for n in files
        if not (n.startswith(prefix) and weight_map.from_hf(n[len(prefix):]))
        and not weight_map.is_ignored(n)
    )
    wanted = {ours: prefix + weight_map.to_hf(ours) for ours in _targets(tower)}
    missing = sorted(hf for hf in wanted.values() if hf not in files)
    misshaped = []
    targets = _targets(tower)
    by_file: dict[Path, list[str]] = {}
    for ours, hf in wanted.items():
        if hf in files:
            by_file.setdefault(files[hf], []).append(ours)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for ours in names:
                got = tuple(f.get_slice(wanted[ours]).get_shape())
                expected = _expected_hf_shape(ours, targets[ours], weight_map)
                if got != expected:
                    misshaped.append(f"{wanted[ours]} {list(got)} (expected {list(expected)})")
    faults = [
        f"{label}: {', '.join(items)}"
        for label, items in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", misshaped))
        if items
    ]
    if faults:
        raise ValueError("Hugging Face checkpoint does not match the model: " + "; ".join(faults))
    return wanted


def _local_index(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's slice of the global tensor (``None`` = all of it)."""
    if not isinstance(tensor, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


@torch.no_grad()
def load_hf_weights(tower: nn.Module, folder: str | Path, weight_map: WeightMap) -> list[str]:
    """Fill ``tower``'s parameters and buffers from a local Hugging Face folder, in place.

    Call it after the tower is built (and initialised) and after tensor parallelism is
    applied: a DTensor parameter reads only its local slice. Only the tensors this
    instance holds (its pipeline stage's layers) are read.

    Args:
        tower: the encoder tower instance (not the projector, which is ours).
        folder: the folder with ``config.json`` and the safetensors weights.
        weight_map: the family's names.

    Returns:
        The checkpoint names read, sorted.

    Raises:
        ValueError: the folder is missing or unusable, or tensors are missing,
            unexpected or mis-shaped (all named in one message).
    """
    files = _checkpoint_files(Path(folder))
    wanted = check_checkpoint(tower, files, weight_map)
    targets = _targets(tower)
    by_file: dict[Path, list[str]] = {}
    for ours, hf in wanted.items():
        by_file.setdefault(files[hf], []).append(ours)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for ours in names:
                _read_into(targets[ours], f.get_slice(wanted[ours]), ours in weight_map.reshaped)
    return sorted(wanted.values())


def to_hf_tensors(
    tower: nn.Module, weight_map: WeightMap, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The tower's tensors under their checkpoint names (the way back, for export).

    Args:
        tower: a whole (unsharded, single-stage) tower.
        weight_map: the family's names.
        prefix: prepended to every name (``"vision_model."`` for a full ``CLIPModel``).

    Returns:
        Checkpoint name -> detached tensor in the checkpoint's shape.
    """
    out = {}
    for ours, tensor in _targets(tower).items():
        value = tensor.detach()
        out[prefix + weight_map.to_hf(ours)] = value[0] if ours in weight_map.reshaped else value
    return out


def _read_into(target: torch.Tensor, hf_slice: object, reshaped: bool) -> None:
    """Copy the (rank-local part of the) checkpoint tensor into ``target``."""
    index = _local_index(target)
    value = hf_slice[:] if index is None else hf_slice[index]  # type: ignore[index]
    local = target.to_local() if isinstance(target, DTensor) else target
    if reshaped:
        value = value.reshape(local.shape)
    local.copy_(value.to(dtype=local.dtype, device=local.device))
