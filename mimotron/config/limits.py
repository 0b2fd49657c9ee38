"""Size limits a config must fit before anything is built, allocated or launched.

Three checks that the per-field rules of :mod:`mimotron.config` cannot make alone:

* **Model size.** :func:`check_model_size` counts every module's parameters
  analytically (from the sizes, never by building the model: ten million layers built
  on the meta device is a hang) and refuses a model of more than :data:`MAX_PARAMS`
  parameters, or one whose weights, gradients and optimizer state need more than
  :data:`MAX_RANK_BYTES` on one rank; no device holds that, and trying would allocate
  until the machine gives up.
* **Timeouts.** torch takes a process-group timeout as a C ``int`` of milliseconds:
  :func:`check_timeouts` refuses one above ``2**31 - 1`` ms by its key, instead of an
  ``OverflowError`` in every rank after launch.
* **Local ranks.** :func:`check_local_ranks` warns (one line) when the launcher would
  start more ranks than the machine has cores, and refuses more than
  :func:`max_local_ranks` unless ``MIMOTRON_FORCE_LOCAL_RANKS=1`` is set. Under
  ``torchrun`` the ranks are not started by mimotron, so nothing is checked there.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from mimotron.config.hf_folder import HFConfigs
from mimotron.config.hf_resolve import language_spec, part_config
from mimotron.config.hf_specs import LlamaFamilySpec, mlp_matrices
from mimotron.config.schema import MimoConfig, ModuleConfig, default_ffn_hidden_size

MAX_PARAMS = 10**13
"""Parameters of the whole model beyond which a plan is refused (no machine trains it)."""
MAX_RANK_BYTES = 16 * 2**40
"""Bytes of weights + gradients + optimizer state one rank may need (16 TiB)."""
MAX_TIMEOUT_MS = 2**31 - 1
"""torch converts a timeout to a C ``int`` of milliseconds."""
FORCE_LOCAL_RANKS_ENV = "MIMOTRON_FORCE_LOCAL_RANKS"
"""Set to 1 to start more local ranks than :func:`max_local_ranks`."""

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_limits(cfg: MimoConfig, hf: HFConfigs | None = None) -> None:
    """Every check of this module that needs only the config (see the module docstring).

    Args:
        cfg: the config.
        hf: the config.json reader of this load (``None``: files are read).

    Raises:
        ValueError: one line naming the key (or module) and the limit.
    """
    check_timeouts(cfg)
    check_model_size(cfg, hf)


def check_timeouts(obj: Any, prefix: str = "") -> None:
    """Every ``*timeout*`` number of a config dataclass fits torch's milliseconds.

    Args:
        obj: a config dataclass (``MimoConfig`` or a section), walked recursively.
        prefix: the dotted path of ``obj``.

    Raises:
        ValueError: ``<key>=<value> is invalid: expected ...`` for the first too large.
    """
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_timeouts(value, f"{name}.")
        elif "timeout" in f.name and isinstance(value, int | float) \
                and not isinstance(value, bool):
            scale = 1000 if f.name.endswith("_s") else 1
            if value * scale > MAX_TIMEOUT_MS:
                limit = MAX_TIMEOUT_MS / scale
                raise ValueError(f"{name}={value!r} is invalid: expected a number <= "
                                 f"{limit} (torch takes timeouts as a C int of "
                                 "milliseconds, about 24.8 days)")


def _attention_params(mod: ModuleConfig, spec: LlamaFamilySpec | None) -> int:
    """Per-layer attention parameters (biases and norms left out: a bound, not a count);
    ``spec``: a Hugging Face decoder's (grouped-query heads, a head_dim of its own)."""
    h = mod.hidden_size
    if spec is not None:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return 2 * h * q + 2 * h * kv
    return 4 * h * h


def module_parameters(mod: ModuleConfig, hf: HFConfigs | None = None) -> tuple[int, int]:
    """``(dense, routed expert)`` parameters of a module, from its sizes alone.

    Biases and norm weights are left out, and the toy models' vocabulary is unknown here
    (the tokenizer sizes it); a Hugging Face decoder's is counted. An MoE module's
    routed experts are counted as if every layer had them.

    Args:
        mod: a validated module config (sizes filled from ``hf_path``).
        hf: the config.json reader of this load (``None``: the file is read).

    Returns:
        The two counts (Python ints: never overflow).
    """
    h, layers = mod.hidden_size, mod.num_layers
    f = mod.ffn_hidden_size or default_ffn_hidden_size(h)
    mlp = mlp_matrices(mod) * h * f
    ends = 0
    experts = 0
    spec = None
    if mod.is_language and mod.hf_path:
        spec = language_spec(mod, part_config(hf.read(mod.hf_path), mod.kind)
                             if hf is not None else None)
        ends = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
        if spec.moe is not None:
            experts = layers * spec.moe.num_experts * 3 * h * spec.moe.ffn_hidden_size
            mlp = 3 * h * spec.moe.shared_ffn_hidden_size + h * spec.moe.num_experts
    elif mod.num_experts:
        e_ffn = mod.moe_ffn_hidden_size or f
        experts = layers * mod.num_experts * 3 * h * e_ffn
        mlp = 3 * h * e_ffn * mod.num_shared_experts + h * mod.num_experts
    return ends + layers * (_attention_params(mod, spec) + mlp), experts


def rank_state_bytes(cfg: MimoConfig, name: str, dense: int, experts: int) -> int:
    """Weights + gradients + optimizer state one rank of module ``name`` holds.

    The same accounting as :func:`mimotron.estimate.memory.estimate_memory` (fp32 master
    weights, a compute copy under 16-bit precision, fp32 gradients, two Adam moments),
    with the layers split evenly over the pipeline.
    """
    mod = cfg.modules[name]
    par = mod.parallel
    n = dense // (par.tensor * par.pipeline) + experts // (
        par.pipeline * par.expert * par.expert_tensor)
    compute = _BYTES[cfg.train.precision] if cfg.train.precision != "fp32" else 0
    if mod.freeze:  # a frozen tower's projector is too small to matter to this bound
        return n * (4 + compute)
    shard = par.data * par.context if par.shard_optimizer else 1
    return n * (4 + compute + 4) + n * 8 // shard


def check_model_size(cfg: MimoConfig, hf: HFConfigs | None = None) -> None:
    """Refuse a model no machine could hold (see the module docstring; ``hf``: the
    config.json reader of this load).

    Raises:
        ValueError: the total parameter count or one module's per-rank bytes, with the
            limit, in one line.
    """
    total = 0
    for name, mod in cfg.modules.items():
        dense, experts = module_parameters(mod, hf)
        total += dense + experts
        need = rank_state_bytes(cfg, name, dense, experts)
        if need > MAX_RANK_BYTES:
            raise ValueError(
                f"modules.{name}: about {dense + experts:.3g} parameters need {need / 2**40:.3g} "
                f"TiB of weights, gradients and optimizer state per rank (hidden_size="
                f"{mod.hidden_size}, num_layers={mod.num_layers}); no device holds more than "
                f"{MAX_RANK_BYTES // 2**40} TiB: reduce the model or raise parallel.tensor / "
                "parallel.pipeline")
    if total > MAX_PARAMS:
        raise ValueError(f"the model has about {total:.3g} parameters, more than the "
                         f"{MAX_PARAMS:.0e} any plan may hold: reduce the modules' sizes")


def usable_cores() -> int:
    """Cores this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_local_ranks(cores: int | None = None) -> int:
    """The most local ranks started without ``MIMOTRON_FORCE_LOCAL_RANKS=1``."""
    return max(64, 4 * (cores or usable_cores()))


def check_local_ranks(world_size: int, launched: bool, cores: int | None = None) -> None:
    """Warn about, or refuse, a launch of more local ranks than the machine runs well.

    Args:
        world_size: ranks the layout needs.
        launched: whether mimotron's launcher would start them (False under torchrun,
            where the launcher is not involved: nothing is checked).
        cores: the cores to compare with (default: :func:`usable_cores`).

    Raises:
        ValueError: more than :func:`max_local_ranks` ranks without the environment
            variable ``MIMOTRON_FORCE_LOCAL_RANKS=1``.
    """
    if not launched or world_size <= 1:
        return
    cores = cores or usable_cores()
    limit = max_local_ranks(cores)
    forced = os.environ.get(FORCE_LOCAL_RANKS_ENV, "") not in ("", "0")
    if world_size > limit and not forced:
        raise ValueError(
            f"the layout needs {world_size} ranks, and this machine has {cores} cores: "
            f"more than {limit} local ranks are refused (each is a process with its own "
            f"memory); reduce modules.<name>.parallel, launch with torchrun on several "
            f"nodes, or set {FORCE_LOCAL_RANKS_ENV}=1")
    if world_size > cores:
        print(f"mimotron train: warning: starting {world_size} local ranks on {cores} "
              "cores; they will share the cores and run slowly", file=sys.stderr, flush=True)
