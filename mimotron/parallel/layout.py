"""Placement planning: which global rank holds which module, at which coordinates.

Pure functions over the config (no process group), so ``mimotron plan`` and every
validation run before any process starts. Three placements exist:

* **colocated** — every module spans the same ranks ``[0, world)`` (degrees may differ);
* **first stage** — the language model spans ``[0, world)`` with ``pipeline > 1`` and every
  encoder spans the ranks of its first pipeline stage, ``[0, world / pipeline)``
  (Megatron's LLaVA placement; a colocated layout whose encoders leave the later stages
  out, :mod:`mimotron.pipeline.colocated_pipeline`);
* **non-colocated** — modules occupy disjoint contiguous blocks that tile ``[0, world)``.

Coordinates follow the grid convention of :class:`~mimotron.parallel.grid.HyperCommGrid`:
base dims ``tp, cp, dp, pp`` with ``tp`` varying fastest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mimotron.config.hf_resolve import head_counts, tied_embeddings
from mimotron.config.schema import MimoConfig, ModuleConfig, ParallelConfig
from mimotron.config.setup_rules import check_setup_rules
from mimotron.data.run_data import check_vocab_split
from mimotron.names import GRID_AXES, LANGUAGE
from mimotron.parallel.context_parallel import check_context_parallel
from mimotron.parallel.expert_layout import check_expert_layout
from mimotron.parallel.fsdp import check_fsdp
from mimotron.parallel.sequence_parallel import check_sequence_parallel
from mimotron.parallel.virtual_pipeline import check_virtual_pipeline

GRID_DIMS = GRID_AXES
RANK_MAP_LIMIT = 64
"""Past this many ranks, ``mimotron plan`` shows each module's first and last ranks."""


@dataclass(frozen=True)
class ModulePlacement:
    """One module's block of ranks and its parallel degrees."""

    name: str
    parallel: ParallelConfig

    @property
    def rank_offset(self) -> int:
        return self.parallel.rank_offset

    @property
    def size(self) -> int:
        return self.parallel.size

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    @property
    def shape(self) -> list[int]:
        """Grid shape in ``GRID_DIMS`` order."""
        p = self.parallel
        return [p.tensor, p.context, p.data, p.pipeline]

    def coordinate(self, rank: int) -> dict[str, int] | None:
        """Grid coordinates of a global rank, or None if the rank is outside the block."""
        if rank not in self.ranks:
            return None
        local, coord = rank - self.rank_offset, {}
        for dim, size in zip(GRID_DIMS, self.shape, strict=True):
            coord[dim] = local % size
            local //= size
        return coord

    def rank_at(self, **coord: int) -> int:
        """Global rank at the given coordinates (missing dims = 0)."""
        rank, stride = self.rank_offset, 1
        for dim, size in zip(GRID_DIMS, self.shape, strict=True):
            rank += coord.get(dim, 0) * stride
            stride *= size
        return rank


@dataclass(frozen=True)
class RankRole:
    """What one global rank does for one module."""

    rank: int
    module: str
    tp: int
    cp: int
    dp: int
    pp: int
    is_first_stage: bool
    is_last_stage: bool


@dataclass
class Layout:
    """The placement of every module over the world."""

    world_size: int
    colocated: bool
    modules: dict[str, ModulePlacement]
    # Module DAG: source module -> destination modules (every encoder feeds language).
    topology: dict[str, list[str]] = field(default_factory=dict)
    ahead: frozenset[str] = frozenset()
    """Encoders that run ahead (:func:`runs_ahead`): a forward-only plan, no gradient
    sent back to them."""

    def roles(self, rank: int) -> list[RankRole]:
        """The roles of a rank, one per module it holds, in config order."""
        out = []
        for name, mod in self.modules.items():
            c = mod.coordinate(rank)
            if c is None:
                continue
            last = mod.parallel.pipeline - 1
            out.append(
                RankRole(
                    rank, name, c["tp"], c["cp"], c["dp"], c["pp"], c["pp"] == 0, c["pp"] == last
                )
            )
        return out

    def modules_on_rank(self, rank: int) -> list[str]:
        return [r.module for r in self.roles(rank)]

    def rank_map(self) -> list[list[RankRole]]:
        """Roles of every rank, indexed by global rank."""
        return [self.roles(r) for r in range(self.world_size)]

    def shown_ranks(self, limit: int = RANK_MAP_LIMIT) -> list[int]:
        """Every rank up to ``limit`` ranks; beyond, each module's first and last two.

        A plan of a million ranks would otherwise print a million rows; the rows left
        out repeat the shown ones' pattern (:func:`format_skipped` says how many).
        """
        if self.world_size <= limit:
            return list(range(self.world_size))
        shown: set[int] = set()
        for mod in self.modules.values():
            r = mod.ranks
            shown.update([*r[:2], *r[-2:]])
        return sorted(shown)

    def format_rank_map(self, limit: int = RANK_MAP_LIMIT) -> str:
        """A human-readable table of the rank map (summarised past ``limit`` ranks)."""
        lines = [
            f"placement: {placement_name(self)}, world size {self.world_size}",
            f"{'rank':>4}  {'module':<10} {'tp':>2} {'cp':>2} {'dp':>2} {'pp':>2}  stage",
        ]
        previous = -1
        for rank in self.shown_ranks(limit):
            if rank > previous + 1:
                lines.append(format_skipped(rank - previous - 1))
            previous = rank
            for i, r in enumerate(self.roles(rank)):
                stage = (
                    "first+last"
                    if r.is_first_stage and r.is_last_stage
                    else "first"
                    if r.is_first_stage
                    else "last"
                    if r.is_last_stage
                    else "middle"
                )
                label = f"{r.rank:>4}" if i == 0 else " " * 4
                lines.append(
                    f"{label}  {r.module:<10} {r.tp:>2} {r.cp:>2} {r.dp:>2} {r.pp:>2}  {stage}"
                )
        if previous < self.world_size - 1:
            lines.append(format_skipped(self.world_size - 1 - previous))
        return "\n".join(lines)


def format_skipped(count: int) -> str:
    """The line standing for ``count`` ranks a summarised table leaves out."""
    return f"{'...':>4}  ({count:,} ranks not shown)"


def check_layout(cfg: MimoConfig, env_world_size: int | None = None) -> Layout:
    """Derive and validate the layout of a config.

    Args:
        cfg: a config that passed :func:`mimotron.config.validation.validate_config`.
        env_world_size: the launcher's WORLD_SIZE, when running under torchrun; checked
            against the layout. ``None`` reads ``WORLD_SIZE`` only if ``TORCHELASTIC_RUN_ID``
            is set (i.e. under torchrun), else skips the check.

    Returns:
        The layout.

    Raises:
        ValueError: the first rule broken, naming the field and what would be valid;
            the rules a rank's set-up applies included
            (:func:`mimotron.config.setup_rules.check_setup_rules`), so ``mimotron plan`` and
            ``mimotron train`` accept the same configs.
    """
    modules = {n: ModulePlacement(n, m.parallel) for n, m in cfg.modules.items()}
    colocated, world_size = _check_placement(modules)
    topology = {n: [LANGUAGE] for n in cfg.encoder_names}
    for name in cfg.modules:
        _check_module_shape(cfg, name, colocated)
    for src, dsts in topology.items():
        for dst in dsts:
            _check_dp_compatible(modules[src], modules[dst])
    _check_batch(cfg, modules)
    _check_encoder_batching(cfg, colocated)
    check_setup_rules(cfg, world_size)  # What a rank's set-up would refuse, refused here.
    if any(m.lora.rank for m in cfg.modules.values()):
        # Here, not at the top: the launcher's checks import no model (DTensor) otherwise.
        from mimotron.models.lora_targets import check_lora_targets

        check_lora_targets(cfg)  # the names a build gives
    check_vocab_split(cfg)
    if env_world_size is None and os.environ.get("TORCHELASTIC_RUN_ID"):
        env_world_size = int(os.environ.get("WORLD_SIZE", "0"))
    if env_world_size is not None and env_world_size != world_size:
        raise ValueError(
            f"WORLD_SIZE={env_world_size} does not match the layout, which needs {world_size} "
            f"ranks ({_describe_blocks(modules)}); launch with --nproc-per-node={world_size} "
            "or change modules.<name>.parallel"
        )
    return Layout(world_size, colocated, modules, topology, runs_ahead(cfg, modules, colocated))


def encoders_on_first_stage(layout: Layout) -> bool:
    """Whether every encoder of ``layout`` spans only the language model's first pipeline
    stage (the *first stage* placement, module docs)."""
    language = layout.modules.get(LANGUAGE)
    return (layout.colocated and language is not None
            and any(m.size < language.size for m in layout.modules.values()))


def first_stage_ranks(layout: Layout) -> range:
    """The ranks of the language model's first pipeline stage (the whole world when it is
    not pipelined): where a colocated layout's encoders may be placed."""
    language = layout.modules[LANGUAGE]
    return range(language.rank_offset,
                 language.rank_offset + language.size // language.parallel.pipeline)


def bridge_group_ranks(layout: Layout) -> range:
    """The ranks of the first-stage placement's bridge group (its first stage); empty
    otherwise, where the colocated bridges span the world."""
    return first_stage_ranks(layout) if encoders_on_first_stage(layout) else range(0)


def placement_name(layout: Layout) -> str:
    """``colocated``, ``first stage`` or ``non-colocated``: how ``mimotron plan`` names it."""
    if encoders_on_first_stage(layout):
        return "first stage"
    return "colocated" if layout.colocated else "non-colocated"


def is_colocated_pipeline(layout: Layout) -> bool:
    """Whether ``layout`` is colocated with a pipelined language model
    (:mod:`mimotron.pipeline.colocated_pipeline`)."""
    language = layout.modules.get(LANGUAGE)  # the planner prices modules alone
    return layout.colocated and language is not None and language.parallel.pipeline > 1


def language_pipeline(layout: Layout) -> Layout:
    """The language model of a colocated pipelined layout alone, as a split layout of
    one module: its stages' plans and point-to-point links are a split layout's."""
    assert is_colocated_pipeline(layout), "not a colocated layout with a language pipeline"
    return Layout(layout.world_size, False, {LANGUAGE: layout.modules[LANGUAGE]}, {})


def runs_ahead(cfg: MimoConfig, modules: dict[str, ModulePlacement], colocated: bool
               ) -> frozenset[str]:
    """The encoders whose forwards run ahead of the language model.

    A wholly frozen encoder (``freeze = true``) of a split layout needs no gradient
    (``train.frozen_ahead``, on by default):
    its ranks run every micro-batch's forward without autograd, one after the other, and
    send each output as it is done, instead of waiting in 1F1B for gradients that would
    change nothing. Not under interleaving (the encoder's or the language model's),
    whose plans wait for chunk orders of their own.
    """
    if (not cfg.train.frozen_ahead or colocated
            or modules[LANGUAGE].parallel.virtual_pipeline > 1):
        return frozenset()
    return frozenset(n for n in cfg.encoder_names if cfg.modules[n].fully_frozen
                     and modules[n].parallel.virtual_pipeline == 1)


def _describe_blocks(modules: dict[str, ModulePlacement]) -> str:
    return ", ".join(
        f"{n}: ranks {m.rank_offset}-{m.rank_offset + m.size - 1}" for n, m in modules.items()
    )


def _check_placement(modules: dict[str, ModulePlacement]) -> tuple[bool, int]:
    """Return (colocated, world_size) or raise for overlaps, gaps and partial overlaps.

    Colocated includes the first-stage placement: the language model on ``[0, world)``
    with ``pipeline > 1``, every encoder on exactly its first stage's ranks."""
    blocks = sorted(modules.values(), key=lambda m: (m.rank_offset, m.name))
    first = blocks[0]
    stage = _first_stage_size(modules)
    if len(blocks) > 1 and stage and all(
            m.rank_offset == 0 and m.size == stage for n, m in modules.items() if n != LANGUAGE):
        return True, modules[LANGUAGE].size
    if len(blocks) > 1 and stage and all(m.rank_offset == 0 for m in blocks):
        _check_shared_sizes(modules, stage)
    if len(blocks) > 1 and stage:
        _check_first_stage_kept(modules, stage)
    # One module alone with pipeline stages is a pipeline, not a colocated placement.
    alone_pipelined = len(blocks) == 1 and first.parallel.pipeline > 1
    if not alone_pipelined and all(m.rank_offset == first.rank_offset and m.size == first.size
                                   for m in blocks):
        if first.rank_offset != 0:
            raise ValueError(
                f"modules.{first.name}.parallel.rank_offset={first.rank_offset} is invalid: "
                "the ranks must start at 0 (ranks below it would hold no module)"
            )
        return True, first.size
    expected = 0
    for m in blocks:
        field_name = f"modules.{m.name}.parallel.rank_offset"
        if m.rank_offset < expected:
            other = next(o for o in blocks if m.rank_offset in o.ranks and o is not m)
            first_stage = (f", every encoder on the language model's first pipeline stage "
                           f"(rank_offset=0 and {stage} ranks)" if stage else "")
            raise ValueError(
                f"{field_name}={m.rank_offset} is invalid: ranks {m.rank_offset}-"
                f"{m.rank_offset + m.size - 1} partially overlap modules.{other.name} (ranks "
                f"{other.rank_offset}-{other.rank_offset + other.size - 1}); use either the same "
                f"ranks and size for every module (colocated){first_stage}, or disjoint blocks, "
                f"e.g. rank_offset={expected}"
            )
        if m.rank_offset > expected:
            raise ValueError(
                f"{field_name}={m.rank_offset} is invalid: ranks {expected}-{m.rank_offset - 1} "
                f"would hold no module (stub ranks); set rank_offset={expected}"
            )
        expected = m.rank_offset + m.size
    return False, expected


def _check_shared_sizes(modules: dict[str, ModulePlacement], stage: int) -> None:
    """Every module from rank 0: each encoder spans the language model's ranks or its
    first stage's, all alike; name the first encoder that does not."""
    world = modules[LANGUAGE].size
    encoders = [m for n, m in modules.items() if n != LANGUAGE]
    wanted = encoders[0].size if encoders[0].size in (world, stage) else world
    odd = next((m for m in encoders if m.size != wanted), None)
    if odd is None:
        return
    raise ValueError(
        f"modules.{odd.name}.parallel (tensor x context x data x pipeline = {odd.size} "
        f"ranks) is invalid with every module at rank_offset=0: each encoder spans the "
        f"language model's {world} ranks (colocated) or its first pipeline stage's {stage} "
        "(the first-stage placement), every encoder alike; or place the modules on "
        "disjoint blocks")


def _check_first_stage_kept(modules: dict[str, ModulePlacement], stage: int) -> None:
    """Where an encoder sits on the language model's first stage, every encoder must;
    name the first that does not (rather than whichever block sorts first)."""
    encoders = [m for n, m in modules.items() if n != LANGUAGE]
    placed = next((m for m in encoders if (m.rank_offset, m.size) == (0, stage)), None)
    odd = next((m for m in encoders if (m.rank_offset, m.size) != (0, stage)), None)
    if placed is None or odd is None:
        return
    raise ValueError(
        f"modules.{odd.name}.parallel.rank_offset={odd.rank_offset} ({odd.size} ranks) is "
        f"invalid: modules.{placed.name} sits on the language model's first pipeline stage "
        f"(ranks 0-{stage - 1}), so every encoder must: rank_offset=0 and tensor x data = "
        f"{stage}; or place every module on disjoint blocks")


def _first_stage_size(modules: dict[str, ModulePlacement]) -> int:
    """Ranks of the language model's first pipeline stage when it starts at rank 0 with
    ``pipeline > 1`` (where encoders may sit); 0 otherwise."""
    language = modules.get(LANGUAGE)
    if language is None or language.rank_offset or language.parallel.pipeline == 1:
        return 0
    return language.size // language.parallel.pipeline


def _check_module_shape(cfg: MimoConfig, name: str, colocated: bool) -> None:
    mod = cfg.modules[name]
    par, p = mod.parallel, f"modules.{name}.parallel"
    if colocated and par.pipeline > 1 and len(cfg.modules) > 1:
        check_colocated_pipeline(cfg, name)
    sizes = [("num_heads", mod.num_heads), ("hidden_size", mod.hidden_size)]
    if mod.hf_path:
        sizes += _hf_shape_keys(name, mod)
    for key, total in sizes:
        if total % par.tensor:
            raise ValueError(
                f"{p}.tensor={par.tensor} is invalid: it must divide modules.{name}.{key}={total}"
            )
    if par.pipeline > mod.num_layers:
        raise ValueError(
            f"{p}.pipeline={par.pipeline} is invalid: modules.{name}.num_layers={mod.num_layers} "
            "layers cannot fill more stages than layers"
        )
    if par.layers_per_stage and sum(par.layers_per_stage) != mod.num_layers:
        raise ValueError(
            f"{p}.layers_per_stage={par.layers_per_stage} is invalid: it must sum to "
            f"modules.{name}.num_layers={mod.num_layers}"
        )
    check_sequence_parallel(cfg, name)
    check_context_parallel(cfg, name)
    check_expert_layout(cfg, name)
    check_virtual_pipeline(cfg, name, colocated)
    check_fsdp(cfg, name)


def check_colocated_pipeline(cfg: MimoConfig, name: str) -> None:
    """A colocated layout pipelines only its language model
    (:mod:`mimotron.pipeline.colocated_pipeline`): every rank holds every encoder (or,
    in the first-stage placement, every rank of the first stage), which runs the step's
    micro-batches before the language stages and its backward after. Context
    parallelism needs the first-stage placement: with an encoder on every rank, ranks of
    later stages would join the bridge's all-to-all with no tokens of their own."""
    par, p = cfg.modules[name].parallel, f"modules.{name}.parallel"
    if name != LANGUAGE:
        raise ValueError(
            f"{p}.pipeline={par.pipeline} is invalid: in a colocated layout only the "
            "language model may be pipelined (the encoders run before its stages); use "
            "pipeline=1, or non-colocated blocks for a pipelined encoder")
    language = cfg.modules[LANGUAGE].parallel
    first_stage = any(cfg.modules[n].parallel.size < language.size for n in cfg.encoder_names)
    refused = [(f"{p}.context={par.context}", par.context > 1 and not first_stage,
                "context=1, every encoder on the first stage's "
                f"{language.size // language.pipeline} ranks (the bridge into "
                "context-parallel stages spans the encoders' ranks)"),
               ("data.balance_encoders=true", cfg.data.balance_encoders,
                "balance_encoders=false (its bridge serves unpipelined colocated layouts)")]
    for what, bad, valid in refused:
        if bad:
            raise ValueError(f"{what} is invalid with a colocated layout whose language "
                             f"model is pipelined ({p}.pipeline={par.pipeline}); use {valid}, "
                             "or non-colocated blocks")


def _hf_shape_keys(name: str, mod: ModuleConfig) -> list[tuple[str, int]]:
    """A checkpoint's key/value heads (checked like num_heads); tied embeddings need PP 1."""

    if mod.parallel.pipeline > 1 and tied_embeddings(mod):
        raise ValueError(
            f"modules.{name}.parallel.pipeline={mod.parallel.pipeline} is invalid: "
            f"hf_path {mod.hf_path!r} ties its output head to the embedding "
            "(tie_word_embeddings), which needs both on one stage; use pipeline=1"
        )
    return [("num_kv_heads (config.json)", head_counts(mod)[1])]


def _check_dp_compatible(src: ModulePlacement, dst: ModulePlacement) -> None:
    a, b = src.parallel.data, dst.parallel.data
    if a % b and b % a:
        raise ValueError(
            f"modules.{src.name}.parallel.data={a} is invalid: it feeds modules.{dst.name} "
            f"(data={b}) and one data-parallel degree must divide the other "
            f"(e.g. {b} or {b * 2} or a divisor of {b})"
        )


def _check_encoder_batching(cfg: MimoConfig, colocated: bool) -> None:
    """Encoder batching reorders a colocated step; split layouts run encoders elsewhere.

    fp16 is refused: the one encoder backward sums the whole step's gradient inside fp16
    kernels, which overflow at loss scales the per-micro-batch backwards (summed in the
    fp32 ``.grad``) survive, so steps would be skipped that batching off takes.
    """
    if not cfg.train.encoder_batching:
        return
    if not colocated:
        raise ValueError(
            "train.encoder_batching=true is invalid: it needs a colocated layout (every "
            "module on the same ranks); this layout places the modules on disjoint blocks, "
            "where each encoder already runs on its own ranks; set it to false")
    if cfg.train.precision == "fp16":
        raise ValueError(
            "train.encoder_batching=true is invalid with train.precision='fp16': the single "
            "encoder backward sums the whole step's gradient in fp16 and overflows where "
            "per-micro-batch backwards do not; use precision 'bf16' or 'fp32', or set "
            "encoder_batching to false")


def _check_batch(cfg: MimoConfig, modules: dict[str, ModulePlacement]) -> None:
    mbs = cfg.train.micro_batch_size
    for name, mod in modules.items():
        dp = mod.parallel.data
        if mbs % dp:
            raise ValueError(
                f"train.micro_batch_size={mbs} is invalid: it must be divisible by "
                f"modules.{name}.parallel.data={dp} (each DP replica takes an equal slice)"
            )


def module_grid_shape(par: ParallelConfig) -> tuple[list[int], list[str]]:
    """Shape and dim names of a module's base grid (tp fastest)."""
    return [par.tensor, par.context, par.data, par.pipeline], list(GRID_DIMS)
