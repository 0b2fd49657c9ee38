"""Process-group bundles: one per module (``ProcessGroupCollection``) and per rank.

A module's groups come from its :class:`~mimotron.parallel.grid.HyperCommGrid` with base
dims ``["tp", "cp", "dp", "pp"]`` and, for MoE, an ``"expert"`` view
``["expt_tp", "ep", "expt_dp", "pp"]``. Creating groups is collective over the whole
world, so :func:`build_pg_collections` creates the groups of every module's grid on every
rank in one fixed order (module names sorted, then ``GROUP_ORDER``), whether the modules
are colocated (grids over the same ranks) or not (disjoint contiguous blocks).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from datetime import timedelta

from torch.distributed import ProcessGroup

from mimotron.config.schema import ParallelConfig
from mimotron.names import GRID_AXES, LANGUAGE
from mimotron.parallel.grid import HyperCommGrid

BASE_DIMS = GRID_AXES
EXPERT_VIEW = "expert"
EXPERT_DIMS = ("expt_tp", "ep", "expt_dp", "pp")

# (field, view, dims) in creation order; part of the global-order contract, never reorder.
GROUP_ORDER: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("tp", None, ("tp",)),
    ("cp", None, ("cp",)),
    ("pp", None, ("pp",)),
    ("dp", None, ("dp",)),
    ("dp_cp", None, ("cp", "dp")),
    ("tp_cp", None, ("tp", "cp")),
    ("mp", None, ("tp", "pp")),
    ("ep", EXPERT_VIEW, ("ep",)),
    ("expt_tp", EXPERT_VIEW, ("expt_tp",)),
    ("expt_dp", EXPERT_VIEW, ("expt_dp",)),
    ("tp_ep", EXPERT_VIEW, ("expt_tp", "ep")),
    ("tp_ep_pp", EXPERT_VIEW, ("expt_tp", "ep", "pp")),
)


def group_sets(grid: HyperCommGrid) -> dict[str, list[list[int]]]:
    """The rank groups of every field :meth:`ProcessGroupCollection.from_grid` creates
    (``GROUP_ORDER``'s, the expert ones where the grid has the view, then the embedding
    groups), by field name; pure (no process group)."""
    has_expert = EXPERT_VIEW in grid.views
    out = {name: grid.get_rank_enum(list(dims), view) for name, view, dims in GROUP_ORDER
           if view != EXPERT_VIEW or has_expert}
    return {**out, **embedding_group_sets(grid)}


def embedding_group_sets(grid: HyperCommGrid) -> dict[str, list[list[int]]]:
    """``embd`` and ``pos_embd``: the groups no grid dim spans. Embedding groups tie the
    input embedding (first stage) to the output layer (last stage) of each pipeline;
    with one stage both are the same rank."""
    pipelines = grid.get_rank_enum("pp")
    return {"embd": [sorted({p[0], p[-1]}) for p in pipelines],
            "pos_embd": [[p[0]] for p in pipelines]}


@dataclass
class ProcessGroupCollection:
    """The process groups of one module on this rank; ``None`` = not present.

    The expert fields (``ep``, ``expt_tp``, ``expt_dp``, ``tp_ep``, ``tp_ep_pp``) are
    ``None`` when the module's grid has no expert view.
    """

    tp: ProcessGroup | None = None
    cp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    dp_cp: ProcessGroup | None = None
    tp_cp: ProcessGroup | None = None
    ep: ProcessGroup | None = None
    expt_tp: ProcessGroup | None = None
    expt_dp: ProcessGroup | None = None
    tp_ep: ProcessGroup | None = None
    tp_ep_pp: ProcessGroup | None = None
    mp: ProcessGroup | None = None  # tp x pp: where a module's parameters are split
    embd: ProcessGroup | None = None
    pos_embd: ProcessGroup | None = None

    @classmethod
    def from_grid(cls, grid: HyperCommGrid) -> ProcessGroupCollection:
        """Create (or fetch, if already created) every group of a module's grid.

        Collective over the world: every rank calls it for every grid, in the same order,
        including ranks outside ``grid``; those get a collection of ``None``.

        Args:
            grid: base dims ``["tp", "cp", "dp", "pp"]``, optional ``"expert"`` view
                with dims ``["expt_tp", "ep", "expt_dp", "pp"]``.

        Returns:
            This rank's groups of the module.

        Raises:
            ValueError: the grid's dims or expert view dims are not the expected ones.
        """
        if tuple(grid.dim_names) != BASE_DIMS:
            raise ValueError(f"grid dim_names must be {list(BASE_DIMS)}, got {grid.dim_names}")
        has_expert = EXPERT_VIEW in grid.views
        if has_expert and tuple(grid.view_dim_names(EXPERT_VIEW)) != EXPERT_DIMS:
            raise ValueError(
                f"grid view {EXPERT_VIEW!r} dims must be {list(EXPERT_DIMS)}, "
                f"got {grid.view_dim_names(EXPERT_VIEW)}"
            )
        pgs: dict[str, ProcessGroup | None] = {}
        for name, view, dims in GROUP_ORDER:
            if view == EXPERT_VIEW and not has_expert:
                continue
            created = grid.has_pg(list(dims), view)
            get = grid.get_pg if created else grid.create_pg
            pgs[name] = get(list(dims), view)
        for name, groups in embedding_group_sets(grid).items():
            created = grid.has_custom_pg(name)
            pgs[name] = grid.get_custom_pg(name) if created else grid.create_custom_pg(name, groups)
        return cls(**pgs)

    def sizes(self) -> dict[str, int]:
        """Size of each present group, by field name (for logs and checks)."""
        return {
            f.name: pg.size() for f in fields(self) if (pg := getattr(self, f.name)) is not None
        }


def build_module_grid(
    parallel_cfg: ParallelConfig, backend: str | None = None, timeout: timedelta | None = None
) -> HyperCommGrid:
    """The grid of one module: ``[tensor, context, data, pipeline]`` at its rank offset.

    An ``"expert"`` view ``[expert_tensor, expert, size // (expert_tensor * expert *
    pipeline), pipeline]`` sharing ``pp`` is registered when ``expert > 1`` or
    ``expert_tensor > 1``.

    Args:
        parallel_cfg: the module's parallel degrees.
        backend: backend of the module's groups (``None`` = the world's).
        timeout: timeout of the module's groups (``None`` = torch's default).

    Raises:
        ValueError: a degree is invalid, or the expert degrees do not divide the grid.
    """
    p = parallel_cfg
    grid = HyperCommGrid(
        [p.tensor, p.context, p.data, p.pipeline],
        list(BASE_DIMS),
        rank_offset=p.rank_offset,
        backend=backend,
        timeout=timeout,
    )
    if p.expert > 1 or p.expert_tensor > 1:
        per_stage = p.expert_tensor * p.expert * p.pipeline
        if p.expert < 1 or p.expert_tensor < 1 or grid.size % per_stage:
            raise ValueError(
                f"parallel.expert ({p.expert}) x parallel.expert_tensor ({p.expert_tensor}) x "
                f"parallel.pipeline ({p.pipeline}) must divide the module size {grid.size} "
                f"(tensor x context x data x pipeline)"
            )
        shape = [p.expert_tensor, p.expert, grid.size // per_stage, p.pipeline]
        grid.register_view(EXPERT_VIEW, shape, list(EXPERT_DIMS), shared_dims=["pp"])
    return grid


class MultiModuleProcessGroupCollection:
    """The group collections of the modules THIS rank belongs to.

    Non-colocated ranks hold one module; colocated ranks hold all of them.

    Args:
        module_pgs: module name -> its collection on this rank (modules this rank is in).
        language_model_module_name: name of the language (loss) module.

    Raises:
        ValueError: ``module_pgs`` is empty (every rank holds at least one module).
    """

    def __init__(
        self,
        module_pgs: dict[str, ProcessGroupCollection],
        language_model_module_name: str = LANGUAGE,
    ) -> None:
        if not module_pgs:
            raise ValueError("module_pgs must hold at least one module; got none")
        self.module_pgs = dict(sorted(module_pgs.items()))
        self.language_model_module_name = language_model_module_name

    @property
    def modules(self) -> list[str]:
        """Names of the modules on this rank, sorted."""
        return list(self.module_pgs)

    def __getitem__(self, module: str) -> ProcessGroupCollection:
        if module not in self.module_pgs:
            raise KeyError(f"module {module!r} is not on this rank (modules: {self.modules})")
        return self.module_pgs[module]

    def __contains__(self, module: object) -> bool:
        return module in self.module_pgs

    def __iter__(self) -> Iterator[str]:
        return iter(self.module_pgs)

    def __len__(self) -> int:
        return len(self.module_pgs)

    def items(self) -> list[tuple[str, ProcessGroupCollection]]:
        """``(module name, collection)`` pairs, sorted by name."""
        return list(self.module_pgs.items())

    def has_language_model(self) -> bool:
        """Whether this rank holds (a stage of) the language model."""
        return self.language_model_module_name in self.module_pgs

    def get_language_model_collection(self) -> ProcessGroupCollection:
        """The language model's groups.

        Raises:
            ValueError: the language model is not on this rank.
        """
        if not self.has_language_model():
            raise ValueError(
                f"language model {self.language_model_module_name!r} is not on this rank "
                f"(modules: {self.modules}); check has_language_model() first"
            )
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        """Context-parallel size of the language model (1 if it has no cp group)."""
        cp = self.get_language_model_collection().cp
        return 1 if cp is None else cp.size()

    def __repr__(self) -> str:
        parts = ", ".join(f"{m}: {pgs.sizes()}" for m, pgs in self.module_pgs.items())
        return f"MultiModuleProcessGroupCollection({parts})"


def build_pg_collections(
    grids: dict[str, HyperCommGrid], language_model_module_name: str = LANGUAGE
) -> tuple[dict[str, ProcessGroupCollection], MultiModuleProcessGroupCollection]:
    """Create the groups of all modules' grids in one global order; collective.

    Every world rank must call this with the same grids. Order: module names sorted,
    then ``GROUP_ORDER``, then the embedding groups.

    Args:
        grids: module name -> its grid (see :func:`build_module_grid`).
        language_model_module_name: name of the language module.

    Returns:
        ``(every module's collection on this rank — all ``None`` for modules this rank
        is not in, this rank's multi-module collection)``.

    Raises:
        ValueError: no grid holds this rank.
    """
    all_pgs = {name: ProcessGroupCollection.from_grid(grids[name]) for name in sorted(grids)}
    mine = {name: pgs for name, pgs in all_pgs.items() if grids[name].is_current_rank_in_grid()}
    if not mine:
        ranges = {name: grids[name].rank_range for name in sorted(grids)}
        raise ValueError(f"this rank is in no module's grid; module ranks: {ranges}")
    return all_pgs, MultiModuleProcessGroupCollection(mine, language_model_module_name)
