"""Range checks every numeric config field gets from its type alone.

TOML accepts ``inf`` and ``nan`` literals and integers of any size, and so do ``key=value``
overrides; none of them is a meaningful setting. ``optimizer.eps = inf`` passes a
positivity check and trains a flat loss; ``train.seed = 99999999999999999999`` fails
inside torch after launch. So before the per-field rules of :mod:`mimotron.config` run,
:func:`check_numbers` walks the config's dataclasses by their type hints and rejects any
non-finite float and any integer outside int64 (the range torch and NumPy take),
naming the field. Because the walk is driven by the types, a field added later is
covered without being listed anywhere.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from mimotron.config.schema import OptimizerConfig, SchedulerConfig

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""The integer range every int field must fit (int64: torch seeds, tensor sizes)."""


def _base(hint: Any, value: Any = None) -> tuple[Any, bool]:
    """``(element type, is a list)`` of a field's type hint, ``Optional`` removed.

    A union of several types (``int | list[int]``) is read as the alternative the value
    has (its first one otherwise).
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        classes = [(a, typing.get_origin(a) or a) for a in args]
        chosen = next((a for a, c in classes if isinstance(c, type) and isinstance(value, c)),
                      args[0])
        return _base(chosen, value)
    if origin is list:
        (item,) = typing.get_args(hint)
        return item, True
    return hint, False


def _bad(kind: Any, value: Any) -> bool:
    if isinstance(value, bool):
        return False  # Not a number here; the parser checks types.
    if kind is float and isinstance(value, float | int):
        return not math.isfinite(value)
    if kind is int and isinstance(value, int):
        return not INT_MIN <= value <= INT_MAX
    return False


def check_value(hint: Any, value: Any, name: str) -> None:
    """Reject a non-finite float or an out-of-range int held by a field of type ``hint``.

    Args:
        hint: the field's type hint (``float``, ``int | None``, ``list[float]``, ...).
        value: the field's value.
        name: the dotted key, for the message.

    Raises:
        ValueError: ``<name>=<value> is invalid: expected ...`` (one line).
    """
    kind, is_list = _base(hint, value)
    if kind not in (int, float):
        return
    items = value if is_list and isinstance(value, list) else [value]
    if not any(_bad(kind, v) for v in items):
        return
    if kind is float:
        valid = "finite numbers (no inf or nan)" if is_list else "a finite number (not inf or nan)"
    else:
        valid = f"integers in [{INT_MIN}, {INT_MAX}]" if is_list else \
            f"an integer in [{INT_MIN}, {INT_MAX}]"
    raise ValueError(f"{name}={value!r} is invalid: expected {valid}")


def check_numbers(obj: Any, prefix: str = "") -> None:
    """Check every numeric field of a config dataclass, recursively (see the module doc).

    ``dict`` fields are walked too: ``modules`` holds ``ModuleConfig`` values, and a
    module's ``optimizer`` overrides are typed by the ``[optimizer]`` / ``[scheduler]``
    field of the same name.

    Args:
        obj: a config dataclass instance (``MimoConfig`` or any section).
        prefix: the dotted path of ``obj`` (``""`` for the whole config).

    Raises:
        ValueError: the first offending field, named in full.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_numbers(value, f"{name}.")
        elif isinstance(value, dict) and name.endswith("optimizer"):
            _check_overrides(value, f"{name}.")
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    check_numbers(item, f"{name}.{key}.")
        else:
            check_value(hints[f.name], value, name)


def _check_overrides(over: dict[str, Any], prefix: str) -> None:
    """A module's ``[optimizer]`` overrides, each typed by the table that owns its key."""
    optim = typing.get_type_hints(OptimizerConfig)
    sched = typing.get_type_hints(SchedulerConfig)
    for key, value in over.items():
        hint = optim.get(key, sched.get(key))
        if hint is not None:
            check_value(hint, value, f"{prefix}{key}")
