"""The per-rank state dict of a checkpoint: what each rank writes, and what it reads back.

One flat dict per rank; DCP matches entries by key, so keys never depend on the layout:

========================================  ==============================================
``model.<name inside MimoModel>``         parameter / buffer (tensor or DTensor), for
                                          the modules (and layers) this rank holds
``optimizer.<m>.state.<param>.<key>``     optimizer state (``MimoOptimizer``'s names)
``optimizer.<m>.loss_scaler``             JSON text (every module, on every rank)
``scheduler.<m>``                         JSON text, where module ``m`` has a schedule
``meta``                                  JSON text: iteration, train state, config,
                                          ``vocab_size_unpadded`` (when known)
``rng.<rank>.state|torch|device``         this rank's RNG state (per-rank keys)
========================================  ==============================================

Replicated entries (a module's weights on each of its DP replicas, ``meta``) are
offered by several ranks under one key; DCP's save planner keeps one writer per key, so
each is stored once. A DTensor entry is stored as its shards and re-cut on load, which is
what lets a checkpoint move between TP/PP/DP layouts. Non-tensor values are JSON text:
DCP stores them with ``torch.save`` and :class:`~mimotron.checkpoint.load.SafeLoadPlanner`
reads them with ``weights_only=True``, so loading never unpickles arbitrary objects.

The optimizer's param groups are not stored: their hyperparameters come from the config
and their lr / weight decay from the restored schedules, and a group's parameter list is
different on every pipeline stage (one key cannot hold them all). A module that had no
optimizer (frozen) when the checkpoint was written has no ``optimizer.<m>.has_state`` and
no ``scheduler.<m>``: if it trains now, it starts with fresh optimizer state and schedule
(``MimoOptimizer.load_state_dict`` / ``load_schedulers_state_dict`` semantics), and the
loader says so.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from mimotron.checkpoint.lora_base import BASE_KEY, base_record
from mimotron.models.lora import is_lora_parameter
from mimotron.optim.scheduler import OptimizerParamScheduler, load_schedulers_state_dict
from mimotron.runtime import device_rng_state, seed_everything, set_device_rng_state

if TYPE_CHECKING:
    from mimotron.optim.mimo_optimizer import MimoOptimizer
    from mimotron.training.infra import MimoModelInfra
    from mimotron.training.state import GlobalState


MODEL = "model."
OPTIMIZER = "optimizer."
SCHEDULER = "scheduler."
META = "meta"
VOCAB_SIZE_UNPADDED = "vocab_size_unpadded"
"""Key of ``meta``: the language model's real vocabulary (its embedding's rows past it are
padding); written when the run knows it (``GlobalState.vocab_size_unpadded``)."""
RNG = "rng."
# Wrapper modules (torch.compile, activation checkpointing, FSDP1) add these name parts;
# dropping them keeps names identical whether or not a module is wrapped.
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_MAX_LISTED = 5


def canonical_name(name: str) -> str:
    """A parameter name without wrapper-module parts."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def model_state(model: nn.Module, optimizer: MimoOptimizer | None = None
                ) -> dict[str, torch.Tensor]:
    """``{"model.<name>": tensor}`` for this rank's parameters and buffers.

    The tensors share storage with the model, so DCP loads into it in place. The base
    of a module in ``model.adapters_only`` is left out (:mod:`mimotron.checkpoint.
    lora_base`: it stays in its folder, and only its adapters are saved). A ZeRO-1
    module with 16-bit weights is represented by its fp32 masters
    (:meth:`MimoOptimizer.master_weights`: this rank's rows as DTensors of the full
    shape): a checkpoint always holds fp32 weights, whatever the layout and precision
    that wrote it, and loading writes the masters (the 16-bit weights are cast from them
    by :func:`apply_loaded`).
    """
    # A LoRA module whose base stays in its folder: its adapters only (checkpoint/lora_base).
    base = getattr(model, "adapters_only", ())
    state = {MODEL + canonical_name(k): v for k, v in model.state_dict().items()
             if not (base and k.startswith(base) and not is_lora_parameter(k))}
    masters = optimizer.master_weights() if optimizer is not None else {}
    if masters:
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in masters:
                state[MODEL + canonical_name(name)] = masters[id(p)]
    return state


def layout_signature(infra: Any, device: torch.device) -> dict[str, Any]:
    """Rank map + device kind: per-rank state (RNG) maps only between equal signatures."""
    ranks = [[asdict(role) for role in roles] for roles in infra.layout.rank_map()]
    return {"world_size": infra.layout.world_size, "device": device.type, "ranks": ranks}


def describe_layout(sig: dict[str, Any]) -> str:
    """One line per layout, e.g. ``5 cpu ranks: vision 0-1 (tp1 pp1 dp2), language 3-4 ...``."""
    blocks: dict[str, list[dict[str, Any]]] = {}
    for roles in sig["ranks"]:
        for role in roles:
            blocks.setdefault(role["module"], []).append(role)
    parts = []
    for module, roles in blocks.items():
        ranks = [r["rank"] for r in roles]
        sizes = {d: max(r.get(d, 0) for r in roles) + 1 for d in ("tp", "cp", "pp", "dp")}
        # cp only where it is > 1, so layouts without CP read as before.
        degrees = " ".join(f"{d}{n}" for d, n in sizes.items() if d != "cp" or n > 1)
        parts.append(f"{module} {min(ranks)}-{max(ranks)} ({degrees})")
    return f"{sig['world_size']} {sig['device']} ranks: " + ", ".join(parts)


# ---- RNG --------------------------------------------------------------------------------


def capture_rng(device: torch.device) -> dict[str, Any]:
    """Python, NumPy and torch RNG state of this process (plus the device generator)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    text = json.dumps(
        {
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        }
    )
    out: dict[str, Any] = {"state": text, "torch": torch.get_rng_state()}
    state = device_rng_state(device)
    if state is not None:
        out["device"] = state
    return out


def restore_rng(saved: dict[str, Any], device: torch.device) -> None:
    """Undo :func:`capture_rng`."""
    state = json.loads(saved["state"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(saved["torch"])
    if "device" in saved:
        set_device_rng_state(saved["device"], device)


def rederive_rng(seed: int, iteration: int, rank: int) -> None:
    """Seed every generator from ``(seed, iteration, rank)``: deterministic, no saved state."""
    digest = hashlib.sha256(f"{seed}:{iteration}:{rank}".encode()).digest()
    seed_everything(int.from_bytes(digest[:8], "little") >> 1)


# ---- save -------------------------------------------------------------------------------


def optimizer_save_state(optimizer: MimoOptimizer) -> dict[str, Any]:
    """``MimoOptimizer.sharded_state_dict()`` minus param groups, objects as JSON text."""
    out: dict[str, Any] = {}
    for key, value in optimizer.sharded_state_dict().items():
        if _optimizer_part(key) == "param_groups":
            continue
        out[key] = value if isinstance(value, torch.Tensor) else json.dumps(value)
    return out


def _optimizer_part(key: str) -> str:
    """``param_groups``, ``loss_scaler``, ``has_state`` or ``state`` (``optimizer.<m>.*``)."""
    rest = key.split(".", 2)[2]
    return rest if rest in ("param_groups", "loss_scaler", "has_state") else "state"


def build_save_state(
    model: nn.Module, optimizer: MimoOptimizer, schedulers: dict[str, OptimizerParamScheduler],
    global_state: GlobalState, infra: MimoModelInfra,
) -> dict[str, Any]:
    """The flat dict this rank hands to ``dcp.save`` (see the module docstring)."""
    cfg, ts, runtime = global_state.cfg, global_state.train_state, global_state.runtime
    optimizer.finish_param_gather()  # train.overlap_param_gather: the rows must be in
    state: dict[str, Any] = model_state(model, optimizer)
    state.update(optimizer_save_state(optimizer))
    for name, scheduler in schedulers.items():
        state[SCHEDULER + name] = json.dumps(scheduler.state_dict())
    meta: dict[str, Any] = {
        "iteration": ts.iteration,
        "train_state": ts.state_dict(),
        "config": cfg.to_dict(),
        "torch_version": torch.__version__,
    }
    if global_state.vocab_size_unpadded is not None:
        meta[VOCAB_SIZE_UNPADDED] = int(global_state.vocab_size_unpadded)
    if getattr(model, "adapters_only", ()):
        meta[BASE_KEY] = base_record(cfg)  # which base the adapters belong to
    state[META] = json.dumps(meta)
    for key, value in capture_rng(runtime.device).items():
        state[f"{RNG}{runtime.rank}.{key}"] = value
    return state


# ---- load -------------------------------------------------------------------------------


@dataclass
class LoadRequest:
    """What this rank asks DCP for, and how to apply it afterwards.

    Attributes:
        state: the template DCP fills in place (tensors) or replaces (JSON text).
        passthrough: optimizer entries handed over as they are: the current param
            groups, and ``has_state = False`` of modules the checkpoint has no state for.
        errors: mismatches with the checkpoint found before reading anything.
        stateless: optimizer entries with no state in the checkpoint (params that never
            had a gradient when it was written); they start without state again.
        optimizer_state: the optimizer's entries are asked for (loaded into it).
        schedule: the schedules and the train state (iteration, data position) are.
    """

    state: dict[str, Any] = field(default_factory=dict)
    passthrough: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    stateless: list[str] = field(default_factory=list)
    optimizer_state: bool = True
    schedule: bool = True


def build_load_request(
    model: nn.Module,
    optimizer: MimoOptimizer,
    schedulers: dict[str, OptimizerParamScheduler],
    global_state: Any,
    metadata: Metadata,
    restore_rng_state: bool,
    optimizer_state: bool = True,
    schedule: bool = True,
    fresh_adapters: bool = False,
) -> LoadRequest:
    """The template for ``dcp.load`` on this rank, checked against the checkpoint's keys.

    Args:
        model: this rank's ``MimoModel`` (its tensors are the template: loaded in place).
        optimizer: the ``MimoOptimizer`` (its state is materialised to load into).
        schedulers: per-module schedulers on this rank.
        global_state: runtime (rank, device) of this rank.
        metadata: the checkpoint's DCP metadata (keys, global shapes).
        restore_rng_state: ask for this rank's RNG entries (same layout only).
        optimizer_state: ask for the optimizer's entries; without them the optimizer is
            not touched (no state is materialised: it stays fresh).
        schedule: ask for the schedules (``meta``, holding the train state, always).
        fresh_adapters: LoRA adapters the checkpoint lacks keep their initial values (a
            new run's adapters on a model trained without them: ``checkpoint.pretrained``).

    Returns:
        The request; ``errors`` lists what does not fit (nothing has been read yet).
    """
    req = LoadRequest(state=model_state(model, optimizer), optimizer_state=optimizer_state,
                      schedule=schedule)
    saved = metadata.state_dict_metadata
    # A param whose state is absent as a whole never had a gradient when saved.
    saved_params = {
        k.rsplit(".", 1)[0]
        for k in saved
        if k.startswith(OPTIMIZER) and _optimizer_part(k) == "state"
    }
    loading = optimizer.sharded_state_dict(is_loading=True) if optimizer_state else {}
    for key, value in loading.items():
        part = _optimizer_part(key)
        if part == "param_groups" or (part == "has_state" and key not in saved):
            req.passthrough[key] = value
        elif part == "state" and key.rsplit(".", 1)[0] not in saved_params:
            req.stateless.append(key)
        else:
            req.state[key] = value if isinstance(value, torch.Tensor) else ""
    for name in schedulers if schedule else ():
        if SCHEDULER + name in saved:  # Absent: no schedule when saved (frozen).
            req.state[SCHEDULER + name] = ""
    req.state[META] = ""
    if restore_rng_state:
        rank, device = global_state.runtime.rank, global_state.runtime.device
        req.state[f"{RNG}{rank}.state"] = ""
        for key in ("torch", "device") if device.type != "cpu" else ("torch",):
            md = saved.get(f"{RNG}{rank}.{key}")
            # Generator states are byte tensors whose size only the checkpoint knows.
            size = tuple(md.size) if isinstance(md, TensorStorageMetadata) else (0,)
            req.state[f"{RNG}{rank}.{key}"] = torch.empty(size, dtype=torch.uint8)
    if fresh_adapters:
        for key in [k for k in req.state if k.startswith(MODEL) and k not in saved
                    and is_lora_parameter(k)]:
            del req.state[key]
    req.errors = _check_against(req.state, saved)
    return req


def _check_against(template: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """Missing keys and shape / kind mismatches, summarised (a few names each)."""
    missing, shape, kind = [], [], []
    for key, value in template.items():
        md = saved.get(key)
        if md is None:
            missing.append(key)
        elif isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                kind.append(key)
            elif tuple(md.size) != tuple(value.shape):
                shape.append(f"{key} {tuple(md.size)} vs {tuple(value.shape)} here")
        elif not isinstance(md, BytesStorageMetadata):
            kind.append(key)
    out = []
    for what, items in (
        (
            "entries missing from the checkpoint (saved with another model or optimizer config?)",
            missing,
        ),
        ("shape mismatches (saved vs this run)", shape),
        ("entries stored as a different kind", kind),
    ):
        if items:
            listed = ", ".join(items[:_MAX_LISTED])
            more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            out.append(f"{len(items)} {what}: {listed}{more}")
    return out


def apply_loaded(
    req: LoadRequest, optimizer: MimoOptimizer, schedulers: dict[str, OptimizerParamScheduler],
    global_state: GlobalState,
) -> tuple[dict[str, Any], list[str]]:
    """Hand what DCP read to the optimizer, schedulers, train state and RNG.

    DCP wrote into the model's tensors, and into the fp32 masters of ZeRO-1 modules
    with 16-bit weights, which are cast into the model here (a collective over each
    such module's DP group). What the request did not ask for (``optimizer_state``,
    ``schedule``) is left as it is.

    Returns:
        The checkpoint's ``meta`` (iteration, train state, config), and the modules
        whose schedule starts fresh (they had none in the checkpoint).
    """
    flat = {
        k: json.loads(v) if isinstance(v, str) else v
        for k, v in req.state.items()
        if k.startswith(OPTIMIZER)
    }
    flat.update(req.passthrough)
    if req.optimizer_state:
        optimizer.load_state_dict(flat)
    optimizer.load_master_weights()
    meta = json.loads(req.state[META])
    if not req.schedule:
        return meta, []
    saved_schedules = {
        k[len(SCHEDULER) :]: json.loads(v) for k, v in req.state.items() if k.startswith(SCHEDULER)
    }
    fresh = load_schedulers_state_dict(schedulers, saved_schedules)
    global_state.train_state.load_state_dict(meta["train_state"])
    rank, device = global_state.runtime.rank, global_state.runtime.device
    prefix = f"{RNG}{rank}."
    rng = {k[len(prefix) :]: v for k, v in req.state.items() if k.startswith(prefix)}
    if rng:
        restore_rng(rng, device)
    return meta, fresh
