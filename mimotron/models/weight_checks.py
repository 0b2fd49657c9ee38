"""Weights checked as they are loaded: the dtype rule and finiteness.

Pretrained weights reach a run three ways: a Hugging Face folder for one module
(:func:`mimotron.models.hf.weights.load_hf_weights`), a ``mimotron export`` folder and a
mimotron checkpoint (:mod:`mimotron.checkpoint.pretrained`, :mod:`mimotron.checkpoint.load`).
Each loader checks what it reads with these helpers, so a folder of the wrong dtype or
holding NaN is refused at load with one line naming the file and the tensor, instead of
training starting from weights that make every step's gradients non-finite.

**The dtype rule.** A floating-point checkpoint tensor of 16, 32 or 64 bits loads into a
floating-point parameter of any of those widths, cast on copy, as ``transformers``
casts each checkpoint tensor to its parameter's dtype. Anything else for a
floating-point parameter is refused: integer and bool tensors (a float parameter never
holds integer values as a trained weight; ``transformers`` would load them unscaled)
and 8-bit floats (quantized checkpoints, whose values mean something only with the
scales of a quantization config, which mimotron does not read). A tensor for a
parameter or buffer that is not floating-point must have that very dtype.

**Finiteness.** Every value a rank reads (its pipeline stage's tensors, its TP slice of
each) is checked in the one pass over memory that the copy already makes; a tensor with
NaN or infinite values is named with their counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Checkpoint dtypes a floating-point parameter accepts (cast to its own on copy).
LOADABLE_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
# The safetensors header's dtype names, as torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}
MAX_LISTED = 8
"""Problems listed in one error before ``... and N more``."""


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def dtype_problem(where: str, name: str, stored: torch.dtype | str,
                  target: torch.dtype) -> str | None:
    """Whether a checkpoint tensor of dtype ``stored`` may load into ``target`` (see above).

    Args:
        where: the file (or checkpoint) holding the tensor, as the message names it.
        name: the tensor's name in that file.
        stored: its dtype, a torch dtype or a safetensors header name (``"I64"``).
        target: the dtype of the parameter or buffer it loads into.

    Returns:
        None when it loads, else one line naming file, tensor and both dtypes.
    """
    dtype = SAFETENSORS_DTYPES.get(stored) if isinstance(stored, str) else stored
    if target.is_floating_point:
        if dtype in LOADABLE_FLOATS:
            return None
        want = "a 16-, 32- or 64-bit floating-point dtype"
    elif dtype == target:
        return None
    else:
        want = _dtype_name(target)
    return (f"{where}: tensor {name} has dtype {_dtype_name(stored)}, but it loads into a "
            f"{_dtype_name(target)} parameter, which needs {want}")


def _counts_message(where: str, name: str, nan: int, inf: int, numel: int) -> str:
    return (f"{where}: tensor {name} holds {nan} NaN and {inf} infinite values "
            f"(of {numel} read)")


def nonfinite_problem(where: str, name: str, value: torch.Tensor) -> str | None:
    """NaN and infinite values of one tensor just read, as one line (None: all finite).

    One pass over ``value`` when it is finite (the usual case); the counts are taken only
    when it is not.
    """
    if not value.is_floating_point() or value.numel() == 0:
        return None
    if bool(torch.isfinite(value).all()):
        return None
    nan = int(torch.isnan(value).sum())
    return _counts_message(where, name, nan, int(torch.isinf(value).sum()), value.numel())


def nonfinite_problems(where: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """:func:`nonfinite_problem` over many tensors with one device-to-host read.

    Args:
        where: the checkpoint, as the messages name it.
        tensors: name -> this rank's local part of a loaded tensor (any device).

    Returns:
        One line per tensor holding NaN or infinite values.
    """
    floats = {n: t for n, t in tensors.items() if t.is_floating_point() and t.numel()}
    if not floats:
        return []
    # One host read for all tensors: a non-finite count per tensor, on their device.
    counts = torch.stack([(~torch.isfinite(t)).sum() for t in floats.values()]).tolist()
    problems = []
    for (name, tensor), count in zip(floats.items(), counts, strict=True):
        if count:
            nan = int(torch.isnan(tensor).sum())
            problems.append(_counts_message(where, name, nan, count - nan, tensor.numel()))
    return problems


def capped(problems: Sequence[str]) -> list[str]:
    """At most :data:`MAX_LISTED` problems, then one line saying how many more."""
    more = len(problems) - MAX_LISTED
    return [*problems[:MAX_LISTED], *([f"... and {more} more"] if more > 0 else [])]
