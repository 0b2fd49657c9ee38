"""Read into a module only the tensors, and only the slices, that this rank holds.

The checkpoint is first checked as a whole against the full model's expected tensor
names and shapes, from file headers alone: every rank runs the same check on the same
files and so fails the same way, with one error naming every missing, unexpected and
mis-shaped tensor, before it has read any data or joined any collective.

Then each parameter of the module (one pipeline stage, possibly TP-sharded) is filled
from ``safe_open(...).get_slice(name)[region]``, where ``region`` is the part of the
full tensor the parameter holds: everything for a plain tensor, this rank's chunk for a
DTensor sharded by its placements (DTensor's ``torch.chunk`` rule). So a TP rank reads,
and ever holds, only its shard, and a pipeline stage never touches other stages' layers.
Values are converted to the parameter's dtype on copy (a bf16 checkpoint loads into fp32
parameters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

_SHOWN = 8  # names listed per kind of problem before "... and N more"


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_checkpoint(
    files: Mapping[str, Path],
    expected: Mapping[str, tuple[int, ...]],
    optional: Iterable[str] = (),
    ignore: Callable[[str], bool] = lambda name: False,
    where: str = "checkpoint",
) -> None:
    """Compare a checkpoint's tensor names and shapes with the full model's.

    Args:
        files: tensor name -> file (see :func:`mimotron.models.hf.folder.tensor_files`).
        expected: tensor name -> full shape, for the whole model (all stages).
        optional: names that may be present or absent (e.g. a tied head).
        ignore: names in the checkpoint that are not weights and are skipped.
        where: the checkpoint, as named in the error.

    Raises:
        ValueError: one message naming every missing, unexpected and mis-shaped tensor.
    """
    optional = set(optional)
    present = set(files)
    missing = set(expected) - present - optional
    unexpected = {n for n in present - set(expected) - optional if not ignore(n)}
    wrong = []
    for file, names in _by_file(files, [n for n in expected if n in present]).items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    wrong.append(f"{name} {list(shape)} (expected {list(expected[name])})")
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if wrong:
        problems.append(f"wrong shapes: {_listing(wrong)}")
    if problems:
        raise ValueError(f"{where} does not match the model: " + "; ".join(problems))


def local_region(param: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full tensor that ``param`` holds on this rank, as slices.

    Args:
        param: a plain tensor (holds everything) or a DTensor with ``Shard``/``Replicate``
            placements.

    Returns:
        One slice per dimension of the full tensor.

    Raises:
        ValueError: on a placement other than ``Shard``/``Replicate``.
    """
    shape = list(param.shape)  # a DTensor's shape is the full (global) shape
    starts = [0] * len(shape)
    if isinstance(param, DTensor):
        coords = param.device_mesh.get_coordinate()
        assert coords is not None, "this rank is not part of the parameter's mesh"
        for mesh_dim, placement in enumerate(param.placements):
            if isinstance(placement, Replicate):
                continue
            if not isinstance(placement, Shard):
                raise ValueError(f"cannot load a parameter placed as {placement}")
            dim, parts = placement.dim, param.device_mesh.size(mesh_dim)
            chunk = -(-shape[dim] // parts)  # torch.chunk: equal chunks, the last shorter
            offset = min(coords[mesh_dim] * chunk, shape[dim])
            shape[dim] = max(0, min(chunk, shape[dim] - offset))
            starts[dim] += offset
    return tuple(slice(s, s + n) for s, n in zip(starts, shape, strict=True))


@torch.no_grad()
def load_parameters_(
    module: nn.Module, files: Mapping[str, Path], checkpoint_name: Mapping[str, str]
) -> None:
    """Fill every parameter of ``module`` with its region of the checkpoint tensor.

    Call :func:`check_checkpoint` first; this assumes names and full shapes agree.

    Args:
        module: the (stage of the, possibly TP-sharded) model; shared parameters are
            filled once, under their first name.
        files: tensor name -> file.
        checkpoint_name: parameter name in ``module`` -> tensor name in the checkpoint,
            for every parameter of ``module``.

    Raises:
        ValueError: a parameter of ``module`` has no checkpoint name.
    """
    params = dict(module.named_parameters())
    unnamed = sorted(set(params) - set(checkpoint_name))
    if unnamed:
        raise ValueError(f"no checkpoint tensor for parameters {_listing(unnamed)}")
    by_file = _by_file(files, [checkpoint_name[n] for n in params])
    ours_of = {checkpoint_name[n]: n for n in params}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for name in names:
                param = params[ours_of[name]]
                value = handle.get_slice(name)[local_region(param)]
                target = param.to_local() if isinstance(param, DTensor) else param
                if value.shape != target.shape:
                    raise RuntimeError(  # a bug in local_region, not a user error
                        f"{name}: read {tuple(value.shape)}, parameter holds "
                        f"{tuple(target.shape)}"
                    )
                target.copy_(value)


def _by_file(files: Mapping[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    """Group tensor names by the file holding them, so each file is opened once."""
    grouped: dict[Path, list[str]] = {}
    for name in names:
        grouped.setdefault(files[name], []).append(name)
    return grouped
