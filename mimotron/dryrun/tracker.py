"""The dispatch mode of the fake-device dry run: device mixes, host reads, host data.

:class:`DeviceTracker` sits on top of ``FakeTensorMode`` and sees every aten and c10d op
the step runs. It does four things:

- **Device mixes fail, naming the culprit.** ``FakeTensorMode`` raises
  ``FakeTensorDeviceMismatchError`` when an op mixes devices; the tracker re-raises it as
  :class:`DeviceMixError` naming each operand's device and origin: a micro-batch key or
  a parameter name (registered by the harness), or the library line that created a
  host tensor. A collective on a host tensor fails too (NCCL takes device tensors only;
  the fake backend would accept it).
- **Host reads are counted and stood in.** Under ``FakeTensorMode`` no tensor has a
  value. A read named through :mod:`mimotron.host_sync` gets a stand-in by its name
  (:data:`STAND_INS`, else 0; MoE routing counts a balanced routing that adds up,
  :mod:`mimotron.dryrun.moe`); an unnamed ``.item()`` / ``.tolist()`` gets one too and is
  counted under the library line that made it. Each read of a device tensor is one
  device-to-host sync on a real accelerator.
- **Host data keeps its values.** Micro-batches start as real host tensors; the tracker
  keeps a real *shadow* of every tensor computed from them alone (masks, token counts,
  placeholder positions), so a data-dependent op on one (boolean indexing, ``nonzero``,
  a count read on the host) gets its true answer, and is counted as a sync when the
  tensor is on the device. Parameters have no values, so nothing computed from them is
  shadowed.
- **Gathers of batch data carry every rank's own.** A gather of a batch tensor (or a
  copy of one: the colocated bridge gathers its presence masks) gives each member the
  value that member's own batch holds, which the harness reads from every rank's data
  (:attr:`DeviceTracker.peers`); a gather of anything else assumes every member holds
  data like this rank's.
- **Host tensors created by the step are listed** with the line that created them
  (factory ops without ``device=`` land on the host), for the report.
"""

from __future__ import annotations

import sys
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorDeviceMismatchError,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from mimotron import host_sync
from mimotron.dryrun.moe import routing_counts

aten = torch.ops.aten

STAND_INS: dict[str, float] = {host_sync.TOKEN_COUNT: 1.0}
"""Stand-in values of named host reads; every other read stands in as 0 (no inf found,
zero norm and sums: a step that succeeds and clips nothing)."""

_SAME_VALUES = (aten._to_copy.default, aten.clone.default, aten.detach.default,
                aten.alias.default, aten.lift_fresh.default)
"""Ops whose output holds its input's values (batch data moved or copied)."""
DataKey = tuple[int, str, str]
"""A batch tensor: ``(micro-batch, module, key)``."""
PeerData = Callable[[int, DataKey], "torch.Tensor | None"]
"""``(rank, key) -> that rank's host value of key`` in the phase running, or ``None``."""
_SHADOW_LIMIT = 1 << 16  # elements: host data of a test-sized batch, never a bucket
_BOOL_INDEX_OPS = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                   aten._unsafe_index_put.default)


class Wire:
    """What each rank of a dry run sent to each other one, in order, for later ranks.

    The fake backend carries no data. Ranks of one dry run run in pipeline order, each
    after the ranks that feed it, so what a receiver would find in a message (a shape
    header, a broadcast of rows) is what the sender put on the wire: the host value of
    the sent tensor, or ``None`` when it had none (activations).

    A message from a rank that runs later (a gradient coming back) is taken to *mirror*
    what this rank sent that rank: the ``j``-th known message received from a later
    peer is the ``j``-th known one sent to it (a gradient has its activation's shape,
    and both directions go in micro-batch order).
    """

    def __init__(self) -> None:
        self._queues: dict[tuple[str, int, int], deque[torch.Tensor | None]] = {}
        self._sent: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self._mirrored: Counter[tuple[str, int, int]] = Counter()

    def put(self, kind: str, src: int, dst: int, value: torch.Tensor | None) -> None:
        """``src`` sent ``value`` to ``dst`` (``kind``: ``p2p`` or ``broadcast``)."""
        self._queues.setdefault((kind, src, dst), deque()).append(value)
        if value is not None:
            self._sent.setdefault((kind, src, dst), []).append(value)

    def mirror(self, kind: str, src: int, dst: int, like: torch.Tensor) -> torch.Tensor | None:
        """The next message ``dst`` sent ``src`` shaped like ``like``, if there is one."""
        sent = self._sent.get((kind, dst, src), [])
        j = self._mirrored[(kind, src, dst)]
        if j >= len(sent) or sent[j].shape != like.shape or sent[j].dtype != like.dtype:
            return None
        self._mirrored[(kind, src, dst)] += 1
        return sent[j]

    def take(self, kind: str, src: int, dst: int) -> tuple[bool, torch.Tensor | None]:
        """``(known, value)`` of the next message from ``src`` to ``dst``."""
        queue = self._queues.get((kind, src, dst))
        if not queue:
            return False, None
        return True, queue.popleft()


class DeviceMixError(RuntimeError):
    """An op mixed devices (or a collective got a host tensor) in the dry run."""


class DryRunError(RuntimeError):
    """The dry run cannot stand in for something the step does (named in the message)."""


def library_site() -> str:
    """``path:line`` of the innermost mimotron frame outside the dry run itself."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        # The step's weight-cast mode forwards every torch call: never the site itself.
        if "/mimotron/" in name and "/mimotron/dryrun/" not in name \
                and not name.endswith(("/mimotron/host_sync.py",
                                       "/mimotron/models/weight_casts.py")):
            return f"{name[name.rindex('/mimotron/') + 1:]}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside mimotron>"


class DeviceTracker(TorchDispatchMode):
    """Dispatch mode over ``FakeTensorMode``: see the module docstring.

    Args:
        device: the stand-in accelerator (``runtime.device``).
        wire: messages of the ranks run before this one (:class:`Wire`).
    """

    def __init__(self, device: torch.device, wire: Wire | None = None) -> None:
        super().__init__()
        self.device = device
        self.wire = wire if wire is not None else Wire()
        self.rank = dist.get_rank()
        self.shadows = WeakTensorKeyDictionary()
        self.origins = WeakTensorKeyDictionary()
        self.reads: Counter[str] = Counter()
        """Device-to-host reads, by name (or ``unnamed at <site>``)."""
        self.data_syncs: Counter[str] = Counter()
        """Data-dependent ops on device tensors answered from host data, by site."""
        self.host_tensors: Counter[str] = Counter()
        """Host tensors the step created with more than one element, by site and op."""
        self.data_keys = WeakTensorKeyDictionary()
        """Batch tensors (and their plain copies) by ``(micro-batch, module, key)``."""
        self.peers: PeerData | None = None
        """Every rank's batch data of the phase running (gathers carry each rank's own)."""

    # ---- the harness's registrations ---------------------------------------------------
    def name(self, tensor: torch.Tensor, origin: str) -> None:
        """Record where ``tensor`` comes from (a batch key, a parameter name)."""
        self.origins[tensor] = origin

    def name_data(self, tensor: torch.Tensor, key: DataKey) -> None:
        """Record that ``tensor`` is batch data ``key`` (a gather of it, or of a copy,
        then carries each peer's own value of ``key``: :attr:`peers`)."""
        self.data_keys[tensor] = key

    def reset_counts(self) -> None:
        """Start counting afresh (the harness counts per step)."""
        self.reads.clear()
        self.data_syncs.clear()
        self.host_tensors.clear()

    # ---- host reads ----------------------------------------------------------------------
    def host_read(self, tensor: torch.Tensor, what: str, total: int | None = None) -> Any:
        """:mod:`mimotron.host_sync`'s hook: the value (shadow or stand-in), counted."""
        shadow = self._shadow(tensor)
        self._check_known(tensor, what)
        if not _on_host(tensor):
            self.reads[what] += 1
        if shadow is not None:
            with unset_fake_temporarily():
                return shadow.tolist()
        if what == host_sync.EXPERT_COUNTS:  # sizes of exchanges: they must add up
            try:
                return routing_counts(tuple(tensor.shape), total)
            except ValueError as exc:
                raise DryRunError(f"{library_site()}: {exc}") from exc
        value = STAND_INS.get(what, 0.0)
        with unset_fake_temporarily():
            return torch.full(tuple(tensor.shape), value).to(tensor.dtype).tolist()

    def _scalar_read(self, tensor: torch.Tensor) -> Any:
        """An unnamed ``.item()`` (``_local_scalar_dense``)."""
        shadow = self._shadow(tensor)
        if shadow is not None:
            if not _on_host(tensor):
                self.data_syncs[f"read of host data at {library_site()}"] += 1
            with unset_fake_temporarily():
                return shadow.item()
        self._check_known(tensor, "a value")
        if not _on_host(tensor):
            self.reads[f"unnamed at {library_site()}"] += 1
        with unset_fake_temporarily():
            return torch.zeros((), dtype=tensor.dtype).item()

    def _check_known(self, tensor: torch.Tensor, what: str) -> None:
        origin = self.origins.get(tensor, "")
        if origin.startswith(_UNKNOWN):
            raise DryRunError(f"{library_site()} reads {what} {origin}: run that rank in the "
                              "same dry run, before this one")

    # ---- dispatch ------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self._scalar_read(args[0])
        if func.namespace in ("c10d", "_c10d_functional"):
            self._check_collective(func, args, kwargs)
            out = func(*args, **kwargs)
            if func.__name__.split(".")[0] not in ("send", "broadcast_"):
                # A reduction's result is the world's, not this rank's host data.
                for t in tree_flatten(_written(func, args, kwargs))[0]:
                    if isinstance(t, FakeTensor):
                        self._drop(t)
            self._carry(func, args)
            return out
        if func in (aten._to_copy.default, aten.copy_.default):
            self._count_copy(func, args, kwargs)
        if _static_shape(func, args, kwargs):  # FakeTensorMode knows the output shape
            return self._run(func, args, kwargs)
        if torch.Tag.dynamic_output_shape in func.tags or (
                func in _BOOL_INDEX_OPS and _has_bool_index(args)):
            return self._data_dependent(func, args, kwargs)
        return self._run(func, args, kwargs)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` under ``FakeTensorMode``; a device mix names its operands."""
        try:
            out = func(*args, **kwargs)
        except FakeTensorDeviceMismatchError as exc:
            raise DeviceMixError(self._describe(func, args, kwargs, exc)) from exc
        self._after(func, args, kwargs, out)
        return out

    def _count_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A copy from the device to the host is a sync too."""
        src = args[1] if func is aten.copy_.default else args[0]
        to_host = (_on_host(args[0]) if func is aten.copy_.default
                   else torch.device(kwargs.get("device") or src.device).type == "cpu")
        if to_host and not _on_host(src):
            table = self.data_syncs if self._shadow(src) is not None else self.reads
            table[f"copy to host at {library_site()}"] += 1

    def _carry(self, func: Any, args: tuple) -> None:
        """Messages carry host values between ranks (:class:`Wire`); gathers assume
        every rank holds data like this one's (the same masks, the same counts)."""
        name = func.__name__.split(".")[0]
        if name == "send":
            dst = _global(args[1], args[2])
            for t in args[0]:
                self.wire.put("p2p", self.rank, dst, self._shadow(t))
        elif name == "recv_":
            self._receive(args[0], "p2p", _global(args[1], args[2]))
        elif name == "broadcast_":
            root = _global(args[1], args[2])
            if root != self.rank:
                self._receive(args[0], "broadcast", root)
                return
            pg = _unbox(args[1])
            for member in dist.get_process_group_ranks(pg):
                if member != self.rank:
                    for t in args[0]:
                        self.wire.put("broadcast", root, member, self._shadow(t))
        elif name == "allgather_":
            members = dist.get_process_group_ranks(_unbox(args[2]))
            for outputs, source in zip(args[0], args[1], strict=True):
                shadow = self._shadow(source)
                key = self.data_keys.get(source)
                for member, out in zip(members, outputs, strict=True):
                    # Batch data: each member's own (colocated bridges gather presence
                    # masks); anything else is taken to be like this rank's.
                    peer = (self.peers(member, key) if key is not None
                            and self.peers is not None else None)
                    value = peer if peer is not None and peer.shape == out.shape else shadow
                    if value is not None:
                        self.shadows[out] = _copy(value)

    def _receive(self, tensors: list[torch.Tensor], kind: str, src: int) -> None:
        for t in tensors:
            known, value = self.wire.take(kind, src, self.rank)
            if not known:
                value = self.wire.mirror(kind, src, self.rank, t)
                known = value is not None
            if value is not None:
                self.shadows[t] = _copy(value)
            elif not known and not t.is_floating_point():  # a header, counts: host data
                self.origins[t] = f"{_UNKNOWN} {src} (not run before rank {self.rank})"

    def _after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Shadow the output of host data; follow and list host tensors."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if torch.Tag.nondeterministic_seeded in func.tags:
            self._forget_mutated(func, args, kwargs)
        elif func._schema.is_mutable:
            # In place on host data with host data: the shadow follows (views included).
            if any(not isinstance(t, FakeTensor) for t in _mutated(func, args, kwargs)) \
                    or self._on_shadows(func, args, kwargs, inputs) is None:
                self._forget_mutated(func, args, kwargs)
        elif _small(out):
            real = self._on_shadows(func, args, kwargs, inputs)
            if real is not None:
                _pair(out, real, self.shadows.__setitem__)
        if func in _SAME_VALUES and inputs and inputs[0] in self.data_keys:
            self.data_keys[out] = self.data_keys[inputs[0]]  # a copy of batch data
        if not inputs and isinstance(out, torch.Tensor) and _on_host(out) and out.numel() > 1:
            self.host_tensors[f"{func.__name__} at {library_site()}"] += 1
            self.origins[out] = f"host tensor from {func.__name__} at {library_site()}"
        elif isinstance(out, torch.Tensor):
            # Host tensors keep their origin; an unknown message's marker spreads to all.
            # A host output takes its origin from a host input (not a device parameter).
            origin = next((self.origins[t] for t in inputs if t in self.origins and (
                (_on_host(out) and _on_host(t)) or (self.origins[t].startswith(_UNKNOWN)
                                                    and not out.is_floating_point()))), None)
            if origin is not None:
                self.origins[out] = origin

    def _on_shadows(self, func: Any, args: tuple, kwargs: dict,
                    inputs: list[torch.Tensor]) -> Any:
        """``func`` on the inputs' real host values, or None when one has none."""
        shadows = [self._shadow(t) for t in inputs]
        if any(s is None for s in shadows):
            return None
        lookup = {id(t): s for t, s in zip(inputs, shadows, strict=True)}
        real_args, real_kwargs = tree_map(
            lambda a: lookup[id(a)] if isinstance(a, torch.Tensor) else _host_device(a),
            (args, kwargs))
        with unset_fake_temporarily():
            return func(*real_args, **real_kwargs)

    def _shadow(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real host value of ``tensor``, when the dry run knows it."""
        if not isinstance(tensor, FakeTensor):
            return tensor if tensor.device.type == "cpu" else None
        return self.shadows.get(tensor)

    def _forget_mutated(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A mutated fake tensor's shadow is stale: drop it."""
        for t in _mutated(func, args, kwargs):
            if isinstance(t, FakeTensor):
                self._drop(t)

    def _drop(self, tensor: torch.Tensor) -> None:
        """Forget a shadow, and its base's when ``tensor`` is a view (``vec[0] += x``)."""
        self.shadows.pop(tensor, None)
        if tensor._base is not None:
            self.shadows.pop(tensor._base, None)

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose output shape depends on values: answered from host data."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        site = library_site()
        real = self._on_shadows(func, args, kwargs, inputs)
        if real is None and func in _BOOL_INDEX_OPS:
            return self._long_index(func, args, kwargs, site)
        if real is None:
            raise DryRunError(f"{func} at {site}: an output shape that depends on computed "
                              "values (not host data), which the dry run cannot know")
        if not all(_on_host(t) for t in inputs):
            self.data_syncs[f"{func.__name__} at {site}"] += 1
        device = next(t.device for t in inputs)
        origin = next((self.origins[t] for t in inputs if t in self.origins and _on_host(t)),
                      None)
        out = tree_map(lambda r: self._fake_like(r, device) if isinstance(r, torch.Tensor)
                       else r, real)
        for t in tree_flatten(out)[0]:
            if origin is not None and isinstance(t, torch.Tensor):
                self.origins[t] = origin
        return out

    def _long_index(self, func: Any, args: tuple, kwargs: dict, site: str) -> Any:
        """Boolean indices with host data become long indices (their ``nonzero``)."""
        indices = []
        for idx in args[1]:
            if idx is not None and idx.dtype == torch.bool:
                shadow = self._shadow(idx)
                if shadow is None and func is not aten.index.Tensor:
                    return self._masked_put(func, args, site)
                if shadow is None:
                    raise DryRunError(f"{func} at {site}: a boolean index computed from "
                                      "values the dry run cannot know")
                with unset_fake_temporarily():
                    positions = shadow.nonzero(as_tuple=True)
                indices.extend(self._fake_like(p, idx.device) for p in positions)
            else:
                indices.append(idx)
        if not _on_host(args[1][0] if args[1][0] is not None else args[0]):
            self.data_syncs[f"boolean index at {site}"] += 1
        return self._run(func, (args[0], indices, *args[2:]), kwargs)

    def _masked_put(self, func: Any, args: tuple, site: str) -> Any:
        """``x[mask] = v`` with a computed mask keeps ``x``'s shape: only devices matter."""
        self._check_same_device(func, args, site)
        if not _on_host(args[0]):
            self.data_syncs[f"boolean index_put at {site}"] += 1
        self._forget_mutated(func, args, {})
        return args[0] if func._schema.is_mutable else self._run(aten.clone.default,
                                                                 (args[0],), {})

    def _check_same_device(self, func: Any, args: tuple, site: str) -> None:
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)
                   and (t.dim() > 0 or not _on_host(t))]
        if len({t.device for t in tensors}) > 1:
            raise DeviceMixError(self._describe(func, args, {}, RuntimeError(
                f"devices {sorted({str(t.device) for t in tensors})}")))

    def _fake_like(self, real: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A fake tensor on ``device`` shaped like ``real``, shadowed by it."""
        fake = torch.empty(real.shape, dtype=real.dtype, device=device)
        self.shadows[fake] = real
        return fake

    def _check_collective(self, func: Any, args: tuple, kwargs: dict) -> None:
        """NCCL takes device tensors only; the fake backend would take host ones."""
        if self.device.type == "cpu":
            return
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device != self.device and t.numel():
                raise DeviceMixError(
                    f"collective {func} at {library_site()} on a {t.device} tensor "
                    f"{tuple(t.shape)} ({self._origin(t)}); the accelerator backend needs "
                    f"{self.device} tensors")

    def _describe(self, func: Any, args: tuple, kwargs: dict, exc: Exception) -> str:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        parts = [f"  {t.device} {tuple(t.shape)} {t.dtype}: {self._origin(t)}" for t in tensors]
        return (f"device mix in {func} at {library_site()} ({exc}); operands:\n"
                + "\n".join(parts))

    def _origin(self, tensor: torch.Tensor) -> str:
        return self.origins.get(tensor, "origin unknown")


_UNKNOWN = "received from rank"


def _unbox(pg: Any) -> Any:
    return dist.ProcessGroup.unbox(pg) if isinstance(pg, torch.ScriptObject) else pg


def _global(pg: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in the (boxed) process group ``pg``."""
    return dist.get_process_group_ranks(_unbox(pg))[group_rank]


def _copy(real: torch.Tensor) -> torch.Tensor:
    """A real copy of a host value (outside ``FakeTensorMode``)."""
    with unset_fake_temporarily():
        return real.clone()


def _written(func: Any, args: tuple, kwargs: dict) -> Any:
    """What a collective writes: a ``c10d`` op its first argument (a gather's outputs,
    a reduction's tensors; its inputs keep their host values, which the gather carries
    to the outputs); a functional collective, for all the tracker knows, everything."""
    return args[0] if func.namespace == "c10d" and args else (args, kwargs)


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def _small(out: Any) -> bool:
    """Outputs small enough to shadow (host data of a test-sized batch, a header)."""
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(flat) and all(t.numel() <= _SHADOW_LIMIT for t in flat)


def _on_host(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def _host_device(value: Any) -> Any:
    """A device argument of an op replayed on host shadows becomes the CPU."""
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _static_shape(func: Any, args: tuple, kwargs: dict) -> bool:
    """Ops tagged dynamic whose output shape no value decides here (no sync either):
    ``repeat_interleave`` given its ``output_size``, indexing by long indices."""
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is not None
    return func is aten.index.Tensor and not _has_bool_index(args)


def _has_bool_index(args: tuple) -> bool:
    return len(args) > 1 and isinstance(args[1], (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _pair(fake: Any, real: Any, put: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Record ``real`` as the shadow of ``fake``, leaf by leaf."""
    fakes, reals = tree_flatten(fake)[0], tree_flatten(real)[0]
    for f, r in zip(fakes, reals, strict=False):
        if isinstance(f, FakeTensor) and isinstance(r, torch.Tensor):
            put(f, r)
