"""One module's candidate settings and how a config takes them (overrides).

A :class:`ModuleOption` is what the search varies for one module: its parallel degrees
(tensor, context, data, pipeline, expert, virtual pipeline), sequence parallelism,
recompute and the optimizer's sharding (none, ZeRO-1 or FSDP2). :func:`degree_options`
lists the degrees a module may take on a block of ranks, before the validator;
:func:`overrides` writes a whole layout as the ``key=value`` overrides ``load_config``
reads, so every candidate is checked by the same code as ``mimotron train``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, ModuleConfig

SHARDINGS = ("none", "zero1", "fsdp")
"""Optimizer sharding: none, ZeRO-1 (``shard_optimizer``), FSDP2 (``fsdp``)."""
RECOMPUTES = ("none", "selective", "full")
MAX_CONTEXT = 8
"""Largest context-parallel degree tried (long sequences need more: set it by hand)."""


@dataclass(frozen=True)
class ModuleOption:
    """One module's settings in a candidate layout (``rank_offset`` set when composed)."""

    tensor: int = 1
    context: int = 1
    data: int = 1
    pipeline: int = 1
    expert: int = 1
    virtual: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"
    sharding: str = "none"

    @property
    def size(self) -> int:
        """Ranks the module occupies."""
        return self.tensor * self.context * self.data * self.pipeline

    def describe(self) -> str:
        """A short summary: ``tp2 pp3 dp1 [cp2] [ep2] [vp2] [sp] [zero1|fsdp] [rc=full]``."""
        parts = [f"tp{self.tensor}", f"pp{self.pipeline}", f"dp{self.data}"]
        parts += [f"cp{self.context}"] if self.context > 1 else []
        parts += [f"ep{self.expert}"] if self.expert > 1 else []
        parts += [f"vp{self.virtual}"] if self.virtual > 1 else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += [self.sharding] if self.sharding != "none" else []
        parts += [f"rc={self.recompute}"] if self.recompute != "none" else []
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_degrees(mod: ModuleConfig, max_tensor: int) -> list[int]:
    """TP degrees dividing the heads and the width (the validator checks the rest)."""
    out, t = [], 1
    while t <= max_tensor:
        if mod.num_heads % t == 0 and mod.hidden_size % t == 0:
            out.append(t)
        t *= 2
    return out


def degree_options(cfg: MimoConfig, name: str, max_size: int, micro_batch: int,
                   max_tensor: int, pipelined: bool) -> Iterator[ModuleOption]:
    """Degrees module ``name`` may take on at most ``max_size`` ranks (before validation).

    Args:
        cfg: the base config (module shapes, sequence length).
        name: the module.
        max_size: the most ranks it may occupy.
        micro_batch: ``train.micro_batch_size`` (the data-parallel degree divides it).
        max_tensor: the largest TP degree (ranks sharing a node's fast link).
        pipelined: pipeline stages allowed (split layouts, and the language model of a
            colocated one).

    Yields:
        Options with recompute none and no sharding (set later).
    """
    mod = cfg.modules[name]
    language = not mod.is_encoder
    moe = moe_options(mod) if language else None
    seq = cfg.data.seq_length
    contexts = [c for c in (1, 2, 4, 8) if c <= MAX_CONTEXT and seq % (2 * c) == 0
                ] if language and moe is None else [1]
    experts = _divisors(moe.num_experts) if moe is not None else [1]
    # Balanced stages only (the layers divide evenly), or up to 8 uneven ones: an uneven
    # split leaves its short stages idle (layers_per_stage can place them by hand).
    pipelines = [p for p in range(1, min(mod.num_layers, max_size) + 1)
                 if mod.num_layers % p == 0 or p <= 8] if pipelined else [1]
    for t in _tensor_degrees(mod, max_tensor):
        for c in contexts:
            for d in _divisors(micro_batch):
                for p in pipelines:
                    if t * c * d * p > max_size:
                        continue
                    for e in experts:
                        if (t * c * d * p) % (e * p):
                            continue
                        yield ModuleOption(t, c, d, p, e)


def memory_ladder(option: ModuleOption, module: ModuleConfig) -> list[ModuleOption]:
    """The option's variants from fastest to leanest: recompute and optimizer sharding.

    ZeRO-1 replaces no sharding wherever there is more than one replica (the same
    traffic, less memory), sequence parallelism is on wherever TP is (the same bytes,
    less memory); FSDP2 (more traffic) comes after recompute ``full`` without it.
    """
    replicas = option.data * option.context
    base = "zero1" if replicas > 1 and not module.freeze else "none"
    sp = option.tensor > 1 and not module.is_encoder and not module.num_experts
    out = [ModuleOption(option.tensor, option.context, option.data, option.pipeline,
                        option.expert, option.virtual, sp, r, base) for r in RECOMPUTES]
    if option.data > 1 and not module.freeze and option.context == 1 and not module.num_experts:
        out += [ModuleOption(option.tensor, 1, option.data, option.pipeline, option.expert,
                             option.virtual, False, r, "fsdp") for r in RECOMPUTES]
    return out


def module_settings(option: ModuleOption, rank_offset: int) -> dict[str, object]:
    """One module's keys (relative to ``modules.<m>``) and values in a layout."""
    return {"parallel.tensor": option.tensor, "parallel.pipeline": option.pipeline,
            "parallel.data": option.data, "parallel.context": option.context,
            "parallel.expert": option.expert, "parallel.virtual_pipeline": option.virtual,
            "parallel.sequence_parallel": option.sequence_parallel,
            "parallel.shard_optimizer": option.sharding == "zero1",
            "parallel.fsdp": option.sharding == "fsdp",
            "parallel.rank_offset": rank_offset, "parallel.layers_per_stage": [],
            "recompute": option.recompute, "recompute_num_layers": 0}


def toml_value(value: object) -> str:
    """A value as TOML writes it (booleans lower case, strings quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return str(value).replace(" ", "")


def module_overrides(name: str, option: ModuleOption, rank_offset: int,
                     base: MimoConfig | None = None) -> list[str]:
    """``key=value`` overrides that set one module's layout in a config.

    With ``base``, only the keys whose value differs from ``base``'s.
    """
    out = []
    for key, value in module_settings(option, rank_offset).items():
        if base is not None:
            current: object = base.modules[name]
            for part in key.split("."):
                current = getattr(current, part)
            if current == value:
                continue
        text = value if isinstance(value, str) else toml_value(value)
        out.append(f"modules.{name}.{key}={text}")
    return out


def apply_option(cfg: MimoConfig, name: str, option: ModuleOption, rank_offset: int) -> None:
    """Set one module's layout on a config object in place (the search's fast path; the
    final candidates go through :func:`module_overrides` and ``load_config``)."""
    mod = cfg.modules[name]
    par = mod.parallel
    par.tensor, par.context, par.data = option.tensor, option.context, option.data
    par.pipeline, par.expert, par.virtual_pipeline = option.pipeline, option.expert, option.virtual
    par.sequence_parallel = option.sequence_parallel
    par.shard_optimizer, par.fsdp = option.sharding == "zero1", option.sharding == "fsdp"
    par.rank_offset, par.layers_per_stage = rank_offset, []
    mod.recompute = option.recompute  # type: ignore[assignment]
    mod.recompute_num_layers = 0  # every layer the rank holds
