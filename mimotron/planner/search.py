"""``mimotron plan --auto``'s search: every module's layout, scored, the best kept.

Three phases keep a 3-module model on 64 ranks well under a minute:

1. **Per module** (:func:`module_choices`), for each micro-batch size: every degree
   combination (:func:`~mimotron.planner.options.degree_options`) on every block size
   is priced alone, analytically (its stages' compute and collectives per micro-batch
   times the micro-batches, plus ``(p - 1) / v`` stages of fill and the reduction and
   optimizer tail); walking them fastest first, each is given the fastest recompute /
   sharding rung (:func:`~mimotron.planner.options.memory_ladder`) whose memory
   estimate (:func:`~mimotron.estimate.memory.estimate_memory`, on a config holding the
   candidate) fits, after the layout validator accepted it; the best
   :data:`KEEP` per block size stay (a colocated module also keeps each one's leanest
   rung that fits: the modules share a rank's memory).
2. **Compose**: colocated (every module on every rank, the modules' times added; the
   language model may be pipelined, the encoders then running before its stages),
   first stage (a pipelined language model on every rank, the encoders on its first
   stage's ranks only, the times added likewise) and split (contiguous blocks whose
   sizes tile the world, in config order, data-parallel degrees that divide one
   another, the slowest module's time), ranked by that approximate time.
3. **Check** the composed list in that order: each candidate is written as config
   overrides and goes through ``load_config`` and
   :func:`~mimotron.parallel.layout.check_layout` (the validator ``mimotron train``
   runs), the memory estimate of every rank against the limit, and the step-time model
   (:func:`~mimotron.planner.cost.step_cost`: the simulated plans). The survivors are
   sorted by predicted step time.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from mimotron.config.load import load_config
from mimotron.config.schema import MimoConfig
from mimotron.estimate.flops import model_flops_per_iteration
from mimotron.estimate.memory import estimate_memory
from mimotron.names import LANGUAGE
from mimotron.parallel.layout import Layout, ModulePlacement, check_layout
from mimotron.pipeline.communicators import NCCL_BUFFER_BYTES, communicators_of
from mimotron.planner.calibration_data import Calibration
from mimotron.planner.cost import StepCost, model_vocabulary, step_cost
from mimotron.planner.devices import DeviceSpec
from mimotron.planner.fit import rank_classes
from mimotron.planner.lanes import lane_cost
from mimotron.planner.options import (
    ModuleOption,
    apply_option,
    degree_options,
    memory_ladder,
    module_overrides,
)
from mimotron.planner.simulate import SimulationError
from mimotron.planner.terms import Links

KEEP = 3
"""Options kept per module and block size after phase 1."""
MIN_CHECKED = 24
"""Candidates that pass the full check before the search stops (at least 3 x top)."""
MAX_CHECKS = 400
"""Full checks at most (candidates the validator or the memory limit refuse count)."""
MAX_WORLD = 2**20
"""The largest ``--world`` searched (1,048,576 ranks: several times the largest clusters
built); beyond it the planner's per-rank checks would not finish."""


@dataclass(frozen=True)
class SearchRequest:
    """What to search: a config, the world, the device and its memory."""

    config: str
    overrides: list[str]
    world: int
    device: DeviceSpec
    memory_limit: int
    calibration: Calibration | None = None
    top: int = 5
    micro_batches: tuple[int, ...] = ()
    """Micro-batch sizes to try (each dividing the global batch); empty: every divisor."""
    headroom: float = 0.0
    """Fraction of ``memory_limit`` kept free (``--headroom``): a layout fits when its
    estimate is at most :attr:`usable_memory`."""
    nccl_buffer_bytes: int = NCCL_BUFFER_BYTES
    """Reserved per NCCL communicator a rank joins, added to its estimate
    (:mod:`mimotron.pipeline.communicators`); not on the ``cpu`` device (gloo)."""

    @property
    def usable_memory(self) -> int:
        """The memory a layout's estimate may use: the limit less the headroom."""
        return int(self.memory_limit * (1.0 - self.headroom))


@dataclass(frozen=True)
class ModuleChoice:
    """A module option that passed phase 1: its analytic time alone and memory."""

    option: ModuleOption
    seconds: float
    memory: int


@dataclass
class Candidate:
    """A whole layout: one option per module, the micro-batch, placement, its verdict."""

    options: dict[str, ModuleOption]
    micro_batch: int
    colocated: bool
    approx: float
    first_stage: bool = False  # colocated, every encoder on the first language stage's ranks
    encoder_batching: bool = False  # train.encoder_batching (an encoders' phase of its own)
    overrides: list[str] = field(default_factory=list)  # every layout key, for load_config
    changes: list[str] = field(default_factory=list)  # only those the base config differs in
    cost: StepCost | None = None
    peak: int = 0  # the largest per-rank memory estimate (bytes)
    peak_rank: int = 0
    model_flops: float = 0.0  # per step (mimotron.estimate.flops): MFU = this / step / peak
    tokens: int = 0  # per step: global batch x seq_length
    samples: int = 0  # per step: the global batch

    @property
    def placement(self) -> str:
        """``colocated``, ``first stage`` or ``split``."""
        if self.first_stage:
            return "first stage"
        return "colocated" if self.colocated else "split"

    @property
    def offsets(self) -> dict[str, int]:
        """Each module's first rank."""
        out, at = {}, 0
        for name, option in self.options.items():
            out[name] = 0 if self.colocated else at
            at += 0 if self.colocated else option.size
        return out


@dataclass
class SearchResult:
    """The ranked candidates and what the search did."""

    candidates: list[Candidate]
    scored: int = 0  # module options priced in phase 1
    composed: int = 0  # whole layouts composed in phase 2
    checked: int = 0  # full checks run in phase 3
    refused: int = 0  # by the validator
    too_big: int = 0  # over the memory limit
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class _Context:
    """What the phases share: the base config, the vocabulary, the counts memo."""

    base: MimoConfig
    request: SearchRequest
    vocab: int
    memo: dict[tuple[object, ...], list[object]] = field(default_factory=dict)
    scored: int = 0


def search(request: SearchRequest) -> SearchResult:
    """Find the fastest layouts of ``request.config`` on ``request.world`` ranks.

    Raises:
        ValueError: the base config is invalid, or ``world`` is not positive.
    """
    if not 1 <= request.world <= MAX_WORLD:
        raise ValueError(f"--world={request.world} is invalid: expected 1 to {MAX_WORLD:,} "
                         "ranks")
    if not 0.0 <= request.headroom < 1.0:
        raise ValueError(f"--headroom={request.headroom} is invalid: expected a fraction "
                         "of the device memory in [0, 1), e.g. 0.05")
    start = time.perf_counter()
    base = load_config(request.config, request.overrides)
    ctx = _Context(base, request, model_vocabulary(base))
    sizes = request.micro_batches or tuple(_micro_batches(base))
    most = largest_world(base, max(sizes), _max_tensor(ctx))
    if request.world > most:
        raise ValueError(
            f"--world={request.world} is invalid for {request.config}: the layouts --auto "
            f"searches use at most {most:,} ranks (each module tensor x context x data x "
            f"pipeline, data dividing the micro-batch, at most {max(sizes)}, pipeline at most "
            "its layers); "
            "lower --world or raise train.global_batch_size")
    composed: list[Candidate] = []
    for mbs in sizes:
        if base.train.global_batch_size % mbs:
            raise ValueError(f"micro-batch size {mbs} is invalid: it must divide "
                             f"train.global_batch_size={base.train.global_batch_size}")
        composed += _compose(ctx, mbs)
    result = SearchResult([], composed=len(composed))
    seen: set[tuple[object, ...]] = set()
    for cand in _shortlist_order(composed):
        if result.checked >= MAX_CHECKS or len(result.candidates) >= max(
                MIN_CHECKED, 3 * request.top):
            break
        # Layouts that differ only in the encoders' mostly tie: the list would repeat
        # itself, so each (placement, micro-batch, language layout) is listed once, with
        # the encoders phase 2 ranked best of those that fit (the encoders' memory may
        # decide whether a colocated layout fits).
        key = (cand.placement, cand.micro_batch, cand.options[LANGUAGE])
        if key in seen:
            continue
        result.checked += 1
        verdict = _check(ctx, cand)
        if verdict == "refused":
            result.refused += 1
        elif verdict == "too big":
            result.too_big += 1
        else:
            seen.add(key)
            result.candidates.append(cand)
    result.candidates.sort(key=_rank_key)
    result.scored, result.seconds = ctx.scored, time.perf_counter() - start
    return result


def _rank_key(c: Candidate) -> tuple[float, int, int]:
    """Phase 3's order: the predicted step (to 6 digits: float noise is no difference),
    then fewer micro-batches (their fixed costs are what a model prices least well),
    then the smaller peak."""
    total = c.cost.total if c.cost else 0.0
    return float(f"{total:.6g}"), -c.micro_batch, c.peak


def _footprint(c: Candidate) -> int:
    """A tie-break among equal times: fewer pipeline stages."""
    return sum(o.pipeline for o in c.options.values())


def _shortlist_order(composed: list[Candidate]) -> list[Candidate]:
    """Colocated, first-stage and split candidates in turn, each kind fastest first.

    Phase 2's time adds colocated modules and takes the slowest split one, which leaves
    out what the simulation adds (the bubble, shared CPU cores); taking the kinds in
    turn keeps any from crowding the others out of the checked list.
    """
    kinds = [sorted((c for c in composed if c.placement == k),
                    key=lambda c: (c.approx, _footprint(c)))
             for k in ("colocated", "first stage", "split")]
    out: list[Candidate] = []
    for i in range(max(len(k) for k in kinds) if composed else 0):
        out += [k[i] for k in kinds if i < len(k)]
    return out


def _micro_batches(cfg: MimoConfig) -> list[int]:
    """Micro-batch sizes that divide the global batch (the global batch stays)."""
    g = cfg.train.global_batch_size
    return [m for m in range(1, g + 1) if g % m == 0]


def largest_world(cfg: MimoConfig, micro_batch: int, max_tensor: int) -> int:
    """The most ranks any layout of ``cfg`` can occupy: every module's largest block
    (:func:`~mimotron.planner.options.degree_options` at ``micro_batch``), side by side."""
    return sum(max(o.size for o in degree_options(cfg, name, MAX_WORLD, micro_batch,
                                                  max_tensor, pipelined=True))
               for name in cfg.modules)


def _compose(ctx: _Context, mbs: int) -> list[Candidate]:
    """Phase 2 at one micro-batch size: colocated and split layouts of kept options."""
    world, names = ctx.request.world, list(ctx.base.modules)
    out: list[Candidate] = []
    colocated = {n: module_choices(ctx, n, mbs, world, exact=True) for n in names}
    for combo in _products([colocated[n].get(world, []) for n in names]):
        if _compatible(names, combo):
            approx = sum(c.seconds for c in combo)
            options = dict(zip(names, (c.option for c in combo), strict=True))
            out.append(Candidate(options, mbs, True, approx, encoder_batching=_batches(
                ctx, names, options[LANGUAGE])))
    if len(names) > 1:
        languages = module_choices(ctx, LANGUAGE, mbs, world, exact=True, first_stage=True)
        out += _first_stage(ctx, mbs, names, languages.get(world, []))
    if len(names) == 1 or world < len(names):
        return out
    split = {n: module_choices(ctx, n, mbs, world - len(names) + 1, exact=False)
             for n in names}
    for sizes in _tilings([sorted(split[n]) for n in names], world):
        pools = [split[n][s] for n, s in zip(names, sizes, strict=True)]
        for combo in _products(pools):
            if _compatible(names, combo):
                approx = max(c.seconds for c in combo)
                out.append(Candidate(dict(zip(names, (c.option for c in combo),
                                              strict=True)), mbs, False, approx))
    return out


def _first_stage(ctx: _Context, mbs: int, names: list[str], languages: list[ModuleChoice]
                 ) -> list[Candidate]:
    """Phase 2's first-stage layouts: each pipelined language choice on the world with
    every encoder on exactly its first stage's ranks (``world / pipeline``); the encoders'
    phase runs in series with the pipeline, so the times add as colocated ones do."""
    pools: dict[int, dict[str, list[ModuleChoice]]] = {}  # by first-stage size
    out: list[Candidate] = []
    for lm in languages:
        stage = ctx.request.world // lm.option.pipeline
        if stage not in pools:
            pools[stage] = {n: module_choices(ctx, n, mbs, stage, exact=True).get(stage, [])
                            for n in names if n != LANGUAGE}
        for combo in _products([[lm] if n == LANGUAGE else pools[stage][n] for n in names]):
            if _compatible(names, combo):
                out.append(Candidate(dict(zip(names, (c.option for c in combo), strict=True)),
                                     mbs, True, sum(c.seconds for c in combo),
                                     first_stage=True,
                                     encoder_batching=_batches(ctx, names, lm.option)))
    return out


def _batches(ctx: _Context, names: list[str], language: ModuleOption) -> bool:
    """Encoder batching for a colocated candidate: on where its language model is
    pipelined (the encoders hold the whole step's activations anyway, their phase
    running before the stages, so one forward and backward for the step saves each
    micro-batch's fixed costs for a larger backward workspace; not under fp16, the
    validator's rule), else as the config has it."""
    if len(names) > 1 and language.pipeline > 1:
        return ctx.base.train.precision != "fp16"
    return ctx.base.train.encoder_batching


def _products(pools: list[list[ModuleChoice]]) -> list[tuple[ModuleChoice, ...]]:
    out: list[tuple[ModuleChoice, ...]] = [()]
    for pool in pools:
        out = [(*prefix, c) for prefix in out for c in pool]
    return out


def _tilings(sizes: list[list[int]], world: int) -> list[tuple[int, ...]]:
    """Block sizes, one per module from its list, that sum to ``world``."""
    if len(sizes) == 1:
        return [(world,)] if world in sizes[0] else []
    return [(s, *rest) for s in sizes[0] if s < world
            for rest in _tilings(sizes[1:], world - s)]


def _compatible(names: list[str], combo: tuple[ModuleChoice, ...]) -> bool:
    """Each encoder's data-parallel degree and the language model's divide one another."""
    by_name = dict(zip(names, combo, strict=True))
    lm = by_name[LANGUAGE].option.data
    return all(c.option.data % lm == 0 or lm % c.option.data == 0
               for n, c in by_name.items() if n != LANGUAGE)


def module_choices(ctx: _Context, name: str, mbs: int, max_size: int, exact: bool,
                   first_stage: bool = False) -> dict[int, list[ModuleChoice]]:
    """Phase 1: the best :data:`KEEP` options of module ``name`` per block size.

    Args:
        ctx: the search's shared state.
        name: the module.
        mbs: the micro-batch size.
        max_size: the largest block (``exact``: only blocks of exactly this size, the
            colocated case, where only the language model may have pipeline stages).
        exact: see ``max_size``.
        first_stage: the language model of a first-stage layout (``exact``): pipelined
            options only, context parallelism allowed (the encoders on its first stage).
    """
    scratch = copy.deepcopy(ctx.base)
    scratch.train.micro_batch_size = mbs
    _minimal_others(scratch, name)
    limit = ctx.request.usable_memory
    options = []
    # Colocated, only the language model pipelines (encoders run before its stages),
    # without interleaving, and with context parallelism only where the encoders sit on
    # its first stage (check_colocated_pipeline: the first_stage choices).
    pipelined = not exact or len(scratch.modules) == 1 or name == LANGUAGE
    for option in degree_options(scratch, name, max_size, mbs, _max_tensor(ctx), pipelined):
        if exact and option.size != max_size:
            continue
        if first_stage and option.pipeline == 1:
            continue
        if exact and len(scratch.modules) > 1 and option.pipeline > 1:
            options += [option] if option.context == 1 or first_stage else []
            continue
        options += _with_virtual(scratch, name, option)
    priced = sorted(((_alone_seconds(ctx, scratch, name, o), o) for o in options),
                    key=lambda x: (x[0], x[1].size))
    kept: dict[int, list[ModuleChoice]] = {}
    lean: dict[int, list[ModuleChoice]] = {}  # colocated: the leanest rung too
    for _, option in priced:
        if len(kept.get(option.size, [])) >= KEEP:
            continue
        # The fastest rung that fits: FSDP2 may beat ZeRO-1 (its traffic overlaps the
        # compute, ZeRO-1's end-of-step reduction does not), recompute never does.
        ladder = sorted(((_alone_seconds(ctx, scratch, name, r), i, r) for i, r in
                         enumerate(memory_ladder(option, scratch.modules[name]))),
                        key=lambda x: (float(f"{x[0]:.9g}"), x[1]))  # ties: leaner last
        fitted = None
        for seconds, _, rung in ladder:
            peak = _module_memory(ctx, scratch, name, rung, colocated=exact)
            if peak is not None and peak <= limit:
                fitted = ModuleChoice(rung, seconds, peak)
                kept.setdefault(option.size, []).append(fitted)
                break
        if exact and fitted is not None:
            leanest = max(ladder, key=lambda x: x[1])  # memory_ladder's last: the leanest
            lean.setdefault(option.size, []).extend(
                _leanest(ctx, scratch, name, leanest[2], leanest[0], fitted))
    for size, extra in lean.items():
        kept[size] += extra
    for choices in kept.values():
        choices.sort(key=lambda c: (c.seconds, c.memory))
    return kept


def _leanest(ctx: _Context, cfg: MimoConfig, name: str, rung: ModuleOption, seconds: float,
             chosen: ModuleChoice) -> list[ModuleChoice]:
    """The ladder's leanest rung as a further choice of a colocated module, where it
    fits and is not the chosen one: colocated modules share each rank's memory, so the
    fastest rung of each may fit alone and not together."""
    if rung == chosen.option:
        return []
    peak = _module_memory(ctx, cfg, name, rung, colocated=True)
    if peak is None or peak > ctx.request.usable_memory:
        return []
    return [ModuleChoice(rung, seconds, peak)]


def _max_tensor(ctx: _Context) -> int:
    """TP stays inside a node's fast link (8 at most where a node is smaller)."""
    return min(ctx.request.world, max(ctx.request.device.devices_per_node, 8))


def _with_virtual(cfg: MimoConfig, name: str, option: ModuleOption) -> list[ModuleOption]:
    """The option, and interleaved (2 chunks per rank) where the language model may be."""
    out = [option]
    n, p = cfg.num_microbatches, option.pipeline
    if (name == LANGUAGE and p > 1 and n % p == 0
            and cfg.modules[name].num_layers >= 2 * p):
        out.append(ModuleOption(option.tensor, option.context, option.data, p,
                                option.expert, 2))
    return out


def _minimal_others(cfg: MimoConfig, name: str) -> None:
    """Every other module on one rank after ``name``'s block (phase 1's stand-in)."""
    for other, mod in cfg.modules.items():
        if other != name:
            apply_option(cfg, other, ModuleOption(), 0)
            mod.parallel.shard_optimizer = False


def _place(cfg: MimoConfig, name: str) -> Layout:
    """The scratch layout: ``name`` at rank 0, each other module on one rank after it."""
    at = cfg.modules[name].parallel.size
    for other, mod in cfg.modules.items():
        if other != name:
            mod.parallel.rank_offset = at
            at += 1
    modules = {n: ModulePlacement(n, m.parallel) for n, m in cfg.modules.items()}
    return Layout(at, False, modules, {n: [LANGUAGE] for n in cfg.encoder_names})


def _alone_seconds(ctx: _Context, cfg: MimoConfig, name: str, option: ModuleOption) -> float:
    """Phase 1's analytic time of a module alone: its busiest stage's micro-batches,
    ``(p - 1) / v`` of them again as the pipeline's fill, and its tail."""
    ctx.scored += 1
    apply_option(cfg, name, option, 0)
    layout = _place(cfg, name)
    links = Links(ctx.request.device, ctx.request.calibration)
    # The first stage holds the extra layers of an uneven split and the embedding, the
    # last the head or projector: the busiest is one of the two.
    stages = [lane_cost(cfg, layout, name, s, ctx.vocab, ctx.request.device,
                        ctx.request.calibration, links) for s in {0, option.pipeline - 1}]
    per_mb = max(s.work + s.collectives + s.fsdp for s in stages)
    fill = (option.pipeline - 1) / option.virtual * per_mb
    tail = max(s.reduction + s.optimizer for s in stages)
    return cfg.num_microbatches * per_mb + fill + tail


def _module_memory(ctx: _Context, cfg: MimoConfig, name: str, option: ModuleOption,
                   colocated: bool = False) -> int | None:
    """The module's largest per-rank estimate, or None when the validator refuses it.

    The validator sees the split scratch layout (the module's own rules); a colocated
    candidate's estimate is taken in a colocated layout, where one micro-batch is in
    flight (a split layout's encoders hold the language model's warm-up too).
    """
    apply_option(cfg, name, option, 0)
    layout = _place(cfg, name)
    try:
        check_layout(cfg)
    except ValueError:
        return None
    if colocated:
        layout = Layout(option.size, True, {name: layout.modules[name]}, {})
    placement = layout.modules[name]
    # The first stage holds the most forwards in flight, the last the logits.
    ranks = [placement.rank_at(pp=s) for s in sorted({0, option.pipeline - 1})]
    est = estimate_memory(cfg, layout, ctx.vocab, ranks, ctx.memo)
    return max(e.total for items in est.values() for e in items if e.module == name)


def candidate_overrides(ctx_overrides: list[str], cand: Candidate,
                        base: MimoConfig | None = None) -> list[str]:
    """The overrides that turn the base config into ``cand`` (with ``base``: only those
    that change a value of it, after ``ctx_overrides``)."""
    out = list(ctx_overrides)
    for name, option in cand.options.items():
        out += module_overrides(name, option, cand.offsets[name], base)
    if base is None or base.train.micro_batch_size != cand.micro_batch:
        out.append(f"train.micro_batch_size={cand.micro_batch}")
    if base is None or base.train.encoder_batching != cand.encoder_batching:
        out.append(f"train.encoder_batching={str(cand.encoder_batching).lower()}")
    return out


def _check(ctx: _Context, cand: Candidate) -> str:
    """Phase 3: the real validator, every rank's memory, the simulated step."""
    cand.overrides = candidate_overrides(ctx.request.overrides, cand)
    cand.changes = candidate_overrides(ctx.request.overrides, cand, ctx.base)
    try:
        cfg = load_config(ctx.request.config, cand.overrides)
        layout = check_layout(cfg)
    except ValueError as exc:
        if cand.encoder_batching and "encoder_batching" in str(exc):  # not served: without
            cand.encoder_batching = False
            return _check(ctx, cand)
        return "refused"
    if layout.world_size != ctx.request.world:
        return "refused"
    ranks = [r for r, _ in rank_classes(layout)]
    est = estimate_memory(cfg, layout, ctx.vocab, ranks, ctx.memo)
    # ranks on CPUs talk over gloo: no NCCL buffers
    buffers = 0 if ctx.request.device.name == "cpu" else ctx.request.nccl_buffer_bytes
    totals = {r: sum(e.total for e in items)
              + buffers * communicators_of(layout, r, cfg.train.micro_batch_size,
                                          cfg.data.balance_encoders)
              for r, items in est.items()}
    cand.peak_rank = max(totals, key=lambda r: (totals[r], -r))
    cand.peak = totals[cand.peak_rank]
    if cand.peak > ctx.request.usable_memory:
        return "too big"
    try:
        cand.cost = step_cost(cfg, layout, ctx.request.device, ctx.request.calibration,
                              ctx.vocab)
        # every sample taken to carry each encoder's input, as the step-time model does
        samples = {n: float(cfg.train.global_batch_size) for n in cfg.encoder_names}
        cand.model_flops = sum(model_flops_per_iteration(cfg, ctx.vocab, samples).values())
        cand.tokens = cfg.train.global_batch_size * cfg.data.seq_length
        cand.samples = cfg.train.global_batch_size
    except SimulationError as exc:
        raise SimulationError(f"{describe_candidate(cand)}: {exc}") from exc
    return "ok"


def describe_candidate(cand: Candidate) -> str:
    """The layout in one line: ``split, micro-batch 8, vision: tp1 pp1 dp1; ...``."""
    modules = "; ".join(f"{n}: {o.describe()}" for n, o in cand.options.items())
    return f"layout ({cand.placement}, micro-batch {cand.micro_batch}, {modules})"
