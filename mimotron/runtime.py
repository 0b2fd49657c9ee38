"""Device, backend and process-group set-up: the one place that names accelerators.

Library code asks this module for the device and backend, so CPU (gloo) and GPU (NCCL)
share every other line.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    """Where this process computes and how it talks to the others."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def accelerator_available() -> bool:
    """True when a CUDA device can be used (and MIMOTRON_DEVICE does not force cpu)."""
    if os.environ.get("MIMOTRON_DEVICE", "") == "cpu":
        return False
    return torch.cuda.is_available()


def default_backend() -> str:
    return "nccl" if accelerator_available() else "gloo"


def device_for(local_rank: int) -> torch.device:
    if accelerator_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def fake_accelerator() -> torch.device:
    """The accelerator the fake-device dry run (:mod:`mimotron.dryrun`) stands in for.

    ``cuda`` on a build with CUDA. On a CPU-only build ``FakeTensorMode`` cannot run an
    op on a fake ``cuda`` tensor (the device guard aborts the process), so the ``meta``
    device stands in: an accelerator-like device distinct from the CPU, on which every
    op runs shape-only and mixing with a CPU tensor raises, as on a GPU.
    """
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("meta")


def fake_backend() -> str:
    """The dry run's ``fake`` process-group backend, registered for its devices."""
    return f"cpu:fake,{fake_accelerator().type}:fake"


def pins_memory(device: torch.device) -> bool:
    """Whether host tensors bound for ``device`` should be pinned (page-locked).

    Pinned memory lets an accelerator copy run asynchronously (``non_blocking``); on the
    CPU it is pointless, and the stand-in ``meta`` device has nothing to copy to.
    """
    return device.type not in ("cpu", "meta") and accelerator_available()


def autocast_device_type(device: torch.device) -> str:
    """The ``torch.autocast`` device type for ``device``.

    The dry run's ``meta`` stand-in has no autocast; ``cpu`` autocast leaves its ops
    alone, so a bf16 dry run checks devices with fp32 compute.
    """
    return "cpu" if device.type == "meta" else device.type


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The accelerator generator's state (None on the CPU and the dry run's ``meta``)."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.get_device_module(device).get_rng_state(device)


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Undo :func:`device_rng_state` (nothing to do on the CPU and ``meta``)."""
    if device.type not in ("cpu", "meta"):
        torch.get_device_module(device).set_rng_state(state, device)


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribution plans; called before a world is
    created.

    DTensor caches its plans by device-mesh *equality*, which ignores process groups: a
    plan cached in an earlier world of this process (a dry run before this one, or the
    parent of a forked rank) hands back that world's mesh, whose collectives then run on
    destroyed groups ("Could not resolve the process group") or on the wrong ranks.
    """
    # Private torch names, each cleared where this torch has it (they move between
    # releases; the caches themselves came with the releases that have them).
    import torch.distributed.tensor.debug as debug
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    clear_all = getattr(debug, "_clear_sharding_prop_cache", None)  # Python and C++ caches
    caches = [getattr(propagator, "_propagate_tensor_meta_cached", None),
              getattr(_redistribute, "_gen_transform_infos", None)]
    if clear_all is not None:
        clear_all()
    else:
        caches.append(getattr(propagator, "propagate_op_sharding", None))
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


def init_runtime(timeout_s: float = 300.0) -> Runtime:
    """Join (or reuse) the default process group from the launcher's environment.

    Under ``torchrun`` (or the test harness) RANK/WORLD_SIZE/MASTER_* are set. Without
    them a single-process group is made over a private FileStore-free TCP-less store,
    so one-process runs take the same code path as many.
    """
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        return Runtime(rank, world, local, device_for(local), dist.get_backend())
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for(local)
    backend = default_backend()
    timeout = timedelta(seconds=timeout_s)
    forget_dtensor_plans()
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if device.type != "cpu" else None)
    else:
        assert world == 1, "WORLD_SIZE > 1 needs a launcher (torchrun or mimotron train)"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return Runtime(rank, world, local, device, backend)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (weights come from (seed, name), not from this)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def compute_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: device allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Dense peak FLOP/s of the device for MFU, when known (None on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    table = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
    for key, bf16_peak in table.items():
        if key in name:
            return bf16_peak if dtype in (torch.bfloat16, torch.float16) else bf16_peak / 2
    return None


def synchronize(device: torch.device) -> None:
    """Wait for the compute stream's queued work (timers must not measure launch time only).

    The current stream only, never the whole device: a device-wide sync would also wait
    for the point-to-point sends parked until the step's end, which complete only when
    their peer reaches the matching receive — in a pipeline plan that relies on sends
    not blocking, the peer may first wait for this rank (a hang). Received tensors are
    ``wait()``-ed before use, which orders them on the current stream.
    """
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
