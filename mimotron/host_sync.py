"""Reading device values on the host: the step's device-to-host syncs, in one place.

On an accelerator every read of a tensor's value by Python (``.item()``, ``.tolist()``)
waits for all work queued before it: a host sync. The step needs a few (the loss-token
count before the loss is scaled, the optimizer's found-inf flag and norms, the logged
sums); library code routes them through :func:`item` and :func:`to_host`, which name
what is read.

The names are what lets the fake-device dry run (:mod:`mimotron.dryrun`) stand in for
them: under ``FakeTensorMode`` no tensor has a value, so a read would raise. An active
dispatch mode that defines ``host_read(tensor, what)`` (the dry run's) answers instead,
with a stand-in value it chooses by name, and counts the read. Without such a mode these
functions are exactly ``tensor.item()`` / ``tensor.tolist()``.

Values that depend only on the batch (how many samples carry an image, where the
placeholders are) need no read at all: the batch was on the host before the step copied
it, and :func:`host_copy` finds that host tensor (kept under :data:`HOST`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

# Names of the step's reads, so the dry run's stand-ins and counts use one spelling.
TOKEN_COUNT = "global loss-token count"
FOUND_INF = "found-inf flag"
WORLD_SUMS = "optimizer world sums"
GRAD_NORM = "grad norm"
EVAL_SUMS = "evaluation sums"
# Per-expert (token, choice) counts of an MoE layer, from the router's output: the sizes
# of the expert-parallel exchange and of the grouped expert call (one read per layer).
EXPERT_COUNTS = "expert routing counts"

HOST = "host"
"""Key of a device micro-batch that holds the host tensors it was copied from (its
integer and boolean ones: tokens, presence masks), set by
:func:`~mimotron.training.data_provider.microbatches_to_device`."""


@runtime_checkable
class HostReadHook(Protocol):
    """What a dispatch mode defines to answer host reads (the dry run's mode)."""

    def host_read(self, tensor: torch.Tensor, what: str, total: int | None = None
                  ) -> list[Any] | Any:
        """The value ``tensor.tolist()`` would give (a stand-in), counted as one read."""
        ...


def _hook() -> HostReadHook | None:
    """The innermost active dispatch mode that answers host reads, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, HostReadHook):
            return mode
    return None


def to_host(tensor: torch.Tensor, what: str, *, total: int | None = None
            ) -> list[Any] | Any:
    """``tensor.tolist()``: one device-to-host sync, named for the dry run.

    Args:
        tensor: the device tensor to read.
        what: what the value is (one of this module's names where one fits); the dry run
            chooses its stand-in by it and reports reads by it.
        total: for :data:`EXPERT_COUNTS`, the (token, choice) pairs this rank routed
            (what its own counts sum to). Unused here; it lets a stand-in add up (the
            exchanges and the grouped expert call depend on the sums).

    Returns:
        A (nested) list of Python numbers, or a number for a 0-d tensor.
    """
    hook = _hook()
    if hook is not None:
        return hook.host_read(tensor, what, total)
    return tensor.tolist()


def item(tensor: torch.Tensor, what: str) -> Any:
    """``tensor.item()``: one device-to-host sync, named for the dry run.

    Args:
        tensor: a one-element device tensor.
        what: what the value is (see :func:`to_host`).

    Returns:
        The Python number.

    Raises:
        ValueError: ``tensor`` has more than one element.
    """
    if tensor.numel() != 1:
        raise ValueError(f"item({what!r}): expected one element, got shape {tuple(tensor.shape)}")
    value = to_host(tensor.reshape(()), what)
    return value


def host_copy(batch: Mapping[str, Any], key: str) -> torch.Tensor:
    """``batch[key]`` on the host when the batch keeps its host copy, else ``batch[key]``.

    Counts and indices that depend only on batch data (present samples, placeholder
    positions) are then computed on the host, with no device-to-host sync; the copy is
    the very tensor the device one was copied from, so both hold the same values. A
    batch without host copies (on the CPU, or built by hand) gives its own tensor, and
    a read of it is a sync as before.

    Args:
        batch: a micro-batch slice (``{key: tensor}``, maybe with :data:`HOST`).
        key: the batch key (``"tokens"``, ``"has_image"``).

    Returns:
        The host tensor, or ``batch[key]``.
    """
    host = batch.get(HOST)
    if host is not None and key in host:
        return host[key]
    return batch[key]
