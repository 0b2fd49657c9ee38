"""Hugging Face checkpoint tensors <-> our parameters: names, checks, sharded reads, export.

One implementation for every family (Llama-style decoders, CLIP / SigLIP, Whisper):

- A :class:`WeightMap` translates between the names inside one of our modules
  (``layers.3.attn.wq.weight``) and the names ``transformers`` writes
  (``model.layers.3.self_attn.q_proj.weight``), both ways, from one table of prefix
  rules. A checkpoint may hold the module under a prefix (``vision_model.`` in a full
  ``CLIPModel``, ``model.encoder.`` in ``WhisperForConditionalGeneration``) next to parts
  that are not ours (a text tower, a decoder, stored RoPE frequencies): those are
  ignored, anything else that does not map is "unexpected".
- :func:`check_checkpoint` compares a checkpoint's tensor names and shapes with what a
  model expects, from file headers alone: every rank runs the same check on the same
  files and fails the same way, with one error naming every missing, unexpected and
  mis-shaped tensor, before it has read any data or joined any collective.
- :func:`load_hf_weights` then fills each parameter (and buffer) of a module (one
  pipeline stage, possibly TP-sharded) from ``safe_open(...).get_slice(name)[region]``,
  where ``region`` (:func:`local_region`) is the part of the full tensor this rank
  holds: everything for a plain tensor, this rank's chunk for a DTensor (DTensor's
  ``torch.chunk`` rule). So a TP rank reads, and ever holds, only its shard, and a
  pipeline stage never touches other stages' layers. Values are converted to the
  target's dtype on copy (a bf16 checkpoint loads into fp32 parameters); an integer,
  bool or 8-bit float tensor for a floating-point parameter is refused from its header,
  and every value read is checked for NaN and infinities
  (:mod:`mimotron.models.weight_checks`).
- :func:`to_hf_tensors` (a whole module) and :func:`hf_tensors_of` (one tensor; MoE experts
  split per expert) are the way back, for export.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from mimotron.config.hf_files import open_safetensors
from mimotron.config.hf_folder import tensor_files
from mimotron.models.hf.vocab import read_rows
from mimotron.models.weight_checks import capped, dtype_problem, nonfinite_problem

_SHOWN = 8  # names listed per kind of problem before "... and N more"


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)"))


@dataclass(frozen=True)
class WeightMap:
    """Prefix rules between our names and a family's Hugging Face names.

    Args:
        rules: ``(our_prefix, hf_prefix)`` pairs; ``{i}`` stands for a layer index.
            A name maps by the first rule whose prefix it starts with.
        prefixes: where the module may sit inside a checkpoint (``""`` = at the root),
            in order of preference.
        ignored: regular expressions of checkpoint names (full, with prefix) that are
            not weights of what we build (text tower, decoder, pooling head, stored RoPE
            frequencies): skipped, never "unexpected".
        reshaped: our names whose tensor is the HF tensor with a leading 1 added.
        stacked: ``(our_name, hf_name)`` templates of stacked parameters (MoE experts):
            our tensor's row ``e`` is the checkpoint tensor ``hf_name`` with ``{e}`` = e
            (``{i}`` = layer index in both).
    """

    rules: tuple[tuple[str, str], ...]
    prefixes: tuple[str, ...] = ("",)
    ignored: tuple[str, ...] = ()
    reshaped: frozenset[str] = frozenset()
    stacked: tuple[tuple[str, str], ...] = ()
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
        """The checkpoint name (without prefix) of our module-local ``name``.

        Raises:
            ValueError: ``name`` is not a parameter name of this family.
        """
        hf = self._translate(name, self._ours, [h for _, h in self.rules])
        if hf is None:
            raise ValueError(f"parameter {name!r} has no Hugging Face name in this family")
        return hf

    def from_hf(self, hf_name: str) -> str | None:
        """Our module-local name of checkpoint name ``hf_name`` (prefix removed), or None."""
        return self._translate(hf_name, self._hfs, [o for o, _ in self.rules])

    def hf_shapes(self, ours: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Checkpoint names (without prefix) and shapes of our tensor ``ours``.

        One name for a plain tensor; one per row of a stacked one (``stacked``).
        """
        for our_template, hf_template in self.stacked:
            match = re.fullmatch(re.escape(our_template).replace(r"\{i\}", r"(\d+)"), ours)
            if match:
                name = hf_template.replace("{i}", match.group(1)) if match.groups() \
                    else hf_template
                return {name.replace("{e}", str(e)): tuple(shape[1:]) for e in range(shape[0])}
        return {self.to_hf(ours): tuple(shape[1:]) if ours in self.reshaped else tuple(shape)}

    def is_ignored(self, hf_name: str) -> bool:
        """Whether a full checkpoint name is not a weight of what this family builds."""
        return any(re.match(p, hf_name) for p in self.ignored)

    def choose_prefix(self, names: Iterable[str]) -> str:
        """The candidate prefix under which most checkpoint names map to ours."""
        names = list(names)

        def hits(prefix: str) -> int:
            return sum(1 for n in names if n.startswith(prefix)
                       and self.from_hf(n[len(prefix):]) is not None)
        return max(self.prefixes, key=hits)  # max keeps the first of equal counts

    def knows(self, hf_name: str, prefix: str) -> bool:
        """Whether a full checkpoint name maps to ours under ``prefix`` or is ignored."""
        return self.is_ignored(hf_name) or (
            hf_name.startswith(prefix) and self.from_hf(hf_name[len(prefix):]) is not None)


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_checkpoint(
    files: Mapping[str, Path],
    expected: Mapping[str, tuple[int, ...]],
    *,
    optional: Iterable[str] = (),
    known: Callable[[str], bool] = lambda name: False,
    where: str = "checkpoint",
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> None:
    """Compare a checkpoint's tensor names, shapes and dtypes with a model's (headers only).

    Args:
        files: tensor name -> file (see :func:`mimotron.config.hf_folder.tensor_files`).
        expected: tensor name -> full shape, for every tensor that must be present.
        optional: names that may be present or absent (e.g. a tied head).
        known: names in the checkpoint that are fine although not expected (parts we
            do not build, layers of other pipeline stages).
        where: the checkpoint, as named in the error.
        dtypes: tensor name -> the dtype it loads into, for the tensors whose checkpoint
            dtype is checked (:func:`~mimotron.models.weight_checks.dtype_problem`).

    Raises:
        ValueError: one message naming every missing, unexpected, mis-shaped and
            wrongly typed tensor, or a damaged file (named).
    """
    optional = set(optional)
    present = set(files)
    missing = set(expected) - present - optional
    unexpected = {n for n in present - set(expected) - optional if not known(n)}
    wrong, typed = [], []
    for file, names in _by_file(files, [n for n in expected if n in present]).items():
        with open_safetensors(file) as handle:
            for name in names:
                header = handle.get_slice(name)
                shape = tuple(header.get_shape())
                if shape != tuple(expected[name]):
                    wrong.append(f"{name} {list(shape)} (expected {list(expected[name])})")
                if dtypes is not None and name in dtypes:
                    bad = dtype_problem(str(file), name, header.get_dtype(), dtypes[name])
                    typed += [bad] if bad else []
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_listing(wrong)}")
    if typed:
        problems.append(f"wrong dtypes: {'; '.join(capped(typed))}")
    if problems:
        raise ValueError(f"{where} does not match the model: " + "; ".join(problems))


def local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor that ``tensor`` holds on this rank, as slices.

    Args:
        tensor: a plain tensor (holds everything) or a DTensor with
            ``Shard``/``Replicate`` placements.

    Returns:
        One slice per dimension of the full tensor.

    Raises:
        ValueError: on a placement other than ``Shard``/``Replicate``.
    """
    shape = list(tensor.shape)  # a DTensor's shape is the full (global) shape
    starts = [0] * len(shape)
    if isinstance(tensor, DTensor):
        coords = tensor.device_mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the tensor's mesh"
        for mesh_dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Replicate):
                continue
            if not isinstance(placement, Shard):
                raise ValueError(f"cannot load a parameter placed as {placement}")
            dim, parts = placement.dim, tensor.device_mesh.size(mesh_dim)
            chunk = -(-shape[dim] // parts)  # torch.chunk: equal chunks, the last shorter
            offset = min(coords[mesh_dim] * chunk, shape[dim])
            shape[dim] = max(0, min(chunk, shape[dim] - offset))
            starts[dim] += offset
    return tuple(slice(s, s + n) for s, n in zip(starts, shape, strict=True))


def _targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Module-local name -> parameter or buffer to fill (tied tensors once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


@torch.no_grad()
def load_hf_weights(module: nn.Module, folder: str | Path, weight_map: WeightMap, *,
                    rows: Mapping[str, int] | None = None, seed: int = 0) -> list[str]:
    """Fill ``module``'s parameters and buffers from a local Hugging Face folder, in place.

    Call it after the module is built (and initialised) and after tensor parallelism is
    applied: a DTensor reads only its local slice. Only the tensors this instance holds
    (its pipeline stage's layers) are checked and read; other tensors the family names
    are left alone. It does no collective: a rank that finds a problem raises before
    any communication (ranks can disagree, each checking what it reads;
    :func:`mimotron.training.model_setup.build_rank_model` makes them agree).

    Args:
        module: the model instance (one pipeline stage or all of it).
        folder: the folder with ``config.json`` and the safetensors weights.
        weight_map: the family's names.
        rows: our name -> rows the checkpoint stores, for tables (embedding, output
            head) the model holds more rows of; rows past those get
            :mod:`mimotron.models.hf.vocab`'s deterministic values.
        seed: the run seed, for those rows.

    Returns:
        The checkpoint names read, sorted.

    Raises:
        ValueError: the folder is missing or unusable, a file is damaged, tensors are
            missing, unexpected, mis-shaped or of a dtype that does not load (all named
            in one message, from headers, before any data is read), or the values read
            hold NaN or infinities (one line per tensor: file, name, counts).
    """
    files = tensor_files(folder)
    prefix = weight_map.choose_prefix(files)
    targets = _targets(module)
    # hf name -> (our name, row of a stacked tensor or None); shapes are global (DTensor).
    expected: dict[str, tuple[int, ...]] = {}
    ours_of: dict[str, tuple[str, int | None]] = {}
    for ours, t in targets.items():
        stacked = _is_stacked(ours, weight_map)
        for e, (hf, shape) in enumerate(weight_map.hf_shapes(ours, tuple(t.shape)).items()):
            expected[prefix + hf] = shape
            ours_of[prefix + hf] = (ours, e if stacked else None)
    rows = {k: v for k, v in (rows or {}).items() if k in targets}
    for ours, count in rows.items():
        hf = prefix + weight_map.to_hf(ours)
        expected[hf] = (count, *expected[hf][1:])
    check_checkpoint(files, expected, known=lambda n: weight_map.knows(n, prefix),
                     where=f"hf_path {str(folder)!r}",
                     dtypes={hf: targets[ours].dtype for hf, (ours, _) in ours_of.items()})
    # A stacked tensor sharded over experts reads only the rows this rank holds.
    wanted = [hf for hf, (ours, e) in ours_of.items()
              if e is None or _holds_row(targets[ours], e)]
    problems = []
    for file, hf_names in _by_file(files, wanted).items():
        with open_safetensors(file) as handle:
            for hf in hf_names:
                value = _read(targets, ours_of[hf], handle.get_slice(hf), rows, seed,
                              weight_map)
                bad = nonfinite_problem(str(file), hf, value)
                problems += [bad] if bad else []
    if problems:
        raise ValueError(f"hf_path {str(folder)!r} holds weights that are not finite:\n  "
                         + "\n  ".join(capped(problems)))
    return sorted(ours_of)


def _read(targets: dict[str, torch.Tensor], where: tuple[str, int | None], hf_slice: object,
          rows: Mapping[str, int], seed: int, weight_map: WeightMap) -> torch.Tensor:
    """Read one checkpoint tensor into its target; the values written, to be checked."""
    ours, e = where
    if ours in rows:
        return _read_rows(targets[ours], hf_slice, rows[ours], seed)
    if e is not None:
        return _read_row(targets[ours], hf_slice, e)
    return _read_into(targets[ours], hf_slice, ours in weight_map.reshaped)


def _is_stacked(ours: str, weight_map: WeightMap) -> bool:
    return any(re.fullmatch(re.escape(o).replace(r"\{i\}", r"\d+"), ours)
               for o, _ in weight_map.stacked)


def _holds_row(target: torch.Tensor, row: int) -> bool:
    first = local_region(target)[0]
    return first.start <= row < first.stop


def _read_row(target: torch.Tensor, hf_slice: object, row: int) -> torch.Tensor:
    """Copy checkpoint tensor ``hf_slice`` into global row ``row`` of a stacked tensor."""
    region = local_region(target)
    local = target.to_local() if isinstance(target, DTensor) else target
    value = hf_slice[region[1:]]  # type: ignore[index]
    local[row - region[0].start].copy_(value)
    return value


def _read_into(target: torch.Tensor, hf_slice: object, reshaped: bool) -> torch.Tensor:
    """Copy this rank's region of the checkpoint tensor into ``target``; return it."""
    region = local_region(target)
    value = hf_slice[region[1:] if reshaped else region]  # type: ignore[index]
    local = target.to_local() if isinstance(target, DTensor) else target
    if reshaped:
        value = value.reshape(local.shape)
    if value.shape != local.shape:
        raise RuntimeError(  # a bug in local_region, not a user error
            f"read {tuple(value.shape)}, the tensor holds {tuple(local.shape)}")
    local.copy_(value)
    return value


def _read_rows(target: torch.Tensor, hf_slice: object, num_rows: int, seed: int
               ) -> torch.Tensor:
    """Fill a table with more rows than the checkpoint's (see :mod:`.vocab`); return
    this rank's rows (a non-finite checkpoint row also makes the new rows non-finite)."""
    region = local_region(target)
    local = target.to_local() if isinstance(target, DTensor) else target
    read_rows(local, region[0].start, hf_slice, num_rows, seed, region[1:])
    return local


def to_hf_tensors(
    module: nn.Module, weight_map: WeightMap, prefix: str = ""
) -> dict[str, torch.Tensor]:
    """The module's tensors under their checkpoint names (the way back, for export).

    Args:
        module: a whole (unsharded, single-stage) model.
        weight_map: the family's names.
        prefix: prepended to every name (``"vision_model."`` for a full ``CLIPModel``).

    Returns:
        Checkpoint name -> detached tensor in the checkpoint's shape.
    """
    out = {}
    for ours, tensor in _targets(module).items():
        out.update({prefix + hf: t for hf, t in
                    hf_tensors_of(ours, tensor.detach(), weight_map).items()})
    return out


def hf_tensors_of(
    ours: str, value: torch.Tensor, weight_map: WeightMap
) -> dict[str, torch.Tensor]:
    """One of our full tensors under its checkpoint name(s), without prefix.

    A stacked tensor (MoE experts, ``weight_map.stacked``) becomes one tensor per row,
    ``experts.{e}...``; a reshaped one loses its leading 1; any other keeps its shape.

    Raises:
        ValueError: ``ours`` is not a parameter name of this family.
    """
    names = list(weight_map.hf_shapes(ours, tuple(value.shape)))
    if _is_stacked(ours, weight_map):
        return {hf: value[e] for e, hf in enumerate(names)}
    return {names[0]: value[0] if ours in weight_map.reshaped else value}


def _by_file(files: Mapping[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    """Group tensor names by the file holding them, so each file is opened once."""
    grouped: dict[Path, list[str]] = {}
    for name in names:
        grouped.setdefault(files[name], []).append(name)
    return grouped
