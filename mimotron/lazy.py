"""Lazy package exports: a package's public names, imported on first use.

``mimotron``, ``mimotron.checkpoint`` and ``mimotron.models`` list their public names
with the module each lives in and import it only when the name is first read, so
``import mimotron`` (and the launcher's config checks) never pays for DTensor, DCP or
the model code it does not touch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that resolves ``exports`` lazily.

    Args:
        package: the package's ``__name__`` (named in the error for unknown names).
        exports: public name -> the module that defines it.

    Returns:
        The function to assign to the package's ``__getattr__``.
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
