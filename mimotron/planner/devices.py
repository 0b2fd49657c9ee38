"""Device constants for the planner's step-time model, and the table users extend.

Without a calibration (``mimotron plan --auto --calibrate``) the step-time model
(:mod:`mimotron.planner.cost`) turns FLOPs into seconds and bytes into transfer time
with the constants of one :class:`DeviceSpec`. The built-in table holds H100, H200,
A100 (80 and 40 GB) and the host CPU; a TOML file (``--device-table FILE``) adds
devices or overrides fields of built-in ones::

    [devices.h100]             # override one field of a built-in device
    flops_per_s = 5.5e14

    [devices.l40s]             # a new device: every field without a default
    flops_per_s = 1.8e14
    memory_bytes = 48e9
    devices_per_node = 8
    intra_node_bytes_per_s = 2.4e10
    inter_node_bytes_per_s = 1.2e10
    latency_s = 2e-5

The figures are sustained, not peak: each built-in entry's comment says which peak it
starts from and the efficiency applied (2026-12-02).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """What the step-time model needs to know about one accelerator (or CPU rank).

    Attributes:
        name: table key, e.g. ``"h100"``, ``"h200"``, ``"a100-80gb"``, ``"a100-40gb"``,
            ``"cpu"``.
        flops_per_s: sustained dense matmul FLOP/s of one device in the training
            precision: the datasheet's dense bf16 peak times a realistic efficiency
            (0.5 for the built-in GPUs, about what a 7B transformer layer reaches), so
            a compute term is model FLOPs / this, with no further MFU factor.
        memory_bytes: device memory (the default for ``--device-memory``).
        devices_per_node: ranks sharing the fast link (NVLink); ``cpu``: ranks per host.
        intra_node_bytes_per_s: per-rank collective ("bus") bandwidth inside a node.
        inter_node_bytes_per_s: per-rank bandwidth across nodes (one NIC per GPU).
        latency_s: fixed cost of one collective or point-to-point message.
        host_cores: ``cpu`` only: cores the ranks of a host share (0 = not shared);
            ranks computing at once then run at ``min(1, host_cores / busy ranks)``.
        layer_overhead_s: fixed seconds one layer's forward costs a rank per
            micro-batch whatever its size (kernel launches, Python dispatch, hooks):
            paid per layer, and once for the front end and once for the head or
            projector, on every micro-batch; a backward pays it again per
            backward-to-forward FLOPs ratio (twice for what trains). It is what makes
            many small micro-batches slower than a few large ones of the same FLOPs
            (0 = not priced). A calibration measures it instead (its
            ``module_fixed_seconds``).
    """

    name: str
    flops_per_s: float
    memory_bytes: int
    devices_per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float
    host_cores: int = 0
    layer_overhead_s: float = 0.0
    peak_flops_per_s: float = 0.0
    """The datasheet's dense peak in the training precision, what MFU divides by
    (0 = unknown: no MFU is predicted)."""


def _builtin() -> dict[str, DeviceSpec]:
    """The built-in devices (a fresh dict per call: no module-level mutable state)."""
    # H100 / H200 SXM: 989 TFLOP/s dense bf16 peak x 0.5; NVLink 4 (450 GB/s per
    # direction, ~360 GB/s achieved by NCCL's all-reduce bus bandwidth); one 400 Gb/s
    # NIC per GPU (~40 GB/s achieved).
    hopper = dict(flops_per_s=0.5 * 989e12, peak_flops_per_s=989e12, devices_per_node=8,
                  intra_node_bytes_per_s=360e9, inter_node_bytes_per_s=40e9,
                  latency_s=2e-5, layer_overhead_s=1e-4)
    # A100 SXM: 312 TFLOP/s dense bf16 peak x 0.5; NVLink 3 (300 GB/s per direction,
    # ~230 GB/s achieved); one 200 Gb/s NIC per GPU (~20 GB/s achieved).
    ampere = dict(flops_per_s=0.5 * 312e12, peak_flops_per_s=312e12, devices_per_node=8,
                  intra_node_bytes_per_s=230e9, inter_node_bytes_per_s=20e9,
                  latency_s=2.5e-5, layer_overhead_s=1e-4)
    # layer_overhead_s on the GPUs: eager PyTorch launches some 20 kernels per layer
    # forward at ~5 us each, exposed when the kernels are short (small micro-batches).
    cores = os.cpu_count() or 1
    return {
        "h100": DeviceSpec("h100", memory_bytes=80 * 10**9, **hopper),
        "h200": DeviceSpec("h200", memory_bytes=141 * 10**9, **hopper),
        "a100-80gb": DeviceSpec("a100-80gb", memory_bytes=80 * 10**9, **ampere),
        "a100-40gb": DeviceSpec("a100-40gb", memory_bytes=40 * 10**9, **ampere),
        # A CPU rank under gloo: ~2e10 FLOP/s of fp32 matmul on one core (small shapes
        # reach much less: calibrate); loopback TCP ~1 GB/s, ~100 us a message; the
        # ranks of the host share its cores. layer_overhead_s: the demo's calibration
        # (2026-12-02) measured 8-14 ms of fixed forward time per micro-batch for modules
        # of one or two layers plus their ends: about 5 ms per layer or end.
        "cpu": DeviceSpec("cpu", flops_per_s=2e10, memory_bytes=16 * 2**30,
                          devices_per_node=max(cores, 1), intra_node_bytes_per_s=1e9,
                          inter_node_bytes_per_s=1e9, latency_s=1e-4, host_cores=cores,
                          layer_overhead_s=5e-3),
    }


def device_table(extra: str | None = None) -> dict[str, DeviceSpec]:
    """The built-in devices, with a user's TOML file's ``[devices.NAME]`` tables applied.

    Args:
        extra: path of a TOML file whose ``[devices.NAME]`` tables override fields of a
            built-in device or define a new one (every field but ``host_cores``,
            ``layer_overhead_s`` and ``peak_flops_per_s`` required); ``None`` = the
            built-ins only.

    Returns:
        Device name -> :class:`DeviceSpec`.

    Raises:
        ValueError: the file cannot be read or parsed, or a table names an unknown
            field, misses a required one or gives a non-positive number.
    """
    table = _builtin()
    if extra is None:
        return table
    try:
        with open(extra, "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--device-table={extra!r} cannot be read: {exc}") from exc
    devices = doc.get("devices")
    if not isinstance(devices, dict) or not devices:
        raise ValueError(f"--device-table={extra!r} is invalid: expected [devices.NAME] "
                         "tables, e.g. [devices.h100] flops_per_s = 5e14")
    for name, values in devices.items():
        if not isinstance(values, dict):
            raise ValueError(f"--device-table={extra!r}: devices.{name} must be a table")
        table[name] = _device_from(extra, name, values, table.get(name))
    return table


_WHOLE_FIELDS = ("memory_bytes", "devices_per_node", "host_cores")
"""Fields that count something (bytes, devices, cores): whole numbers."""
_MAY_BE_ZERO = ("host_cores", "layer_overhead_s", "peak_flops_per_s")
"""Fields where 0 means "not shared" / "not priced"."""


def _valid_number(key: str, value: object) -> bool:
    """A finite, positive number (:data:`_MAY_BE_ZERO` fields may be 0), whole for a
    count: ``int()`` would round 0.5 devices per node down to 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not math.isfinite(value) or value < 0 or (value == 0 and key not in _MAY_BE_ZERO):
        return False
    return key not in _WHOLE_FIELDS or value == int(value)


def _device_from(path: str, name: str, values: dict[str, Any],
                 base: DeviceSpec | None) -> DeviceSpec:
    """One ``[devices.NAME]`` table over ``base`` (None: a new device, all fields given)."""
    known = {f.name: f for f in fields(DeviceSpec) if f.name != "name"}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"--device-table={path!r}: devices.{name}.{unknown[0]} is not a "
                         f"device field; valid: {', '.join(known)}")
    if base is None:
        missing = [k for k in known if k not in _MAY_BE_ZERO and k not in values]
        if missing:
            raise ValueError(f"--device-table={path!r}: devices.{name} is a new device and "
                             f"needs {', '.join(missing)}")
    converted: dict[str, Any] = {}
    for key, value in values.items():
        integral = key in _WHOLE_FIELDS
        if not _valid_number(key, value):
            kind = "whole number" if integral else "number"
            raise ValueError(f"--device-table={path!r}: devices.{name}.{key}={value!r} is "
                             f"invalid: expected a positive {kind}")
        converted[key] = int(value) if integral else float(value)
    if base is None:
        return DeviceSpec(name=name, **converted)
    return replace(base, **converted)
