"""``MimoModelInfra``: grids, process groups, topology and roles of one run.

Built once per run and passed everywhere (no module-level group globals). Group creation
is collective over the world, so every rank builds every module's grid in one order.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from mimotron.config.schema import MimoConfig
from mimotron.names import LANGUAGE
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import (
    MultiModuleProcessGroupCollection,
    ProcessGroupCollection,
    build_module_grid,
    build_pg_collections,
)
from mimotron.parallel.layout import Layout, RankRole, check_layout


@dataclass
class MimoModelInfra:
    """The parallel infrastructure of a run, as seen from one rank."""

    layout: Layout
    rank: int
    grids: dict[str, HyperCommGrid]
    pg_collections: dict[str, ProcessGroupCollection]
    multimodule_pg_collection: MultiModuleProcessGroupCollection
    topology: dict[str, list[str]]

    @property
    def roles(self) -> dict[str, RankRole]:
        """This rank's role in each module it holds."""
        return {r.module: r for r in self.layout.roles(self.rank)}

    @property
    def module_names(self) -> list[str]:
        return list(self.roles)

    @property
    def is_language_rank(self) -> bool:
        return LANGUAGE in self.roles

    @property
    def is_loss_leader(self) -> bool:
        """One rank per language DP replica reports its loss (tp 0, last stage)."""
        r = self.roles.get(LANGUAGE)
        return r is not None and r.tp == 0 and r.cp == 0 and r.is_last_stage

    @property
    def is_loss_partial(self) -> bool:
        """A rank whose loss sum is a partial sum of its replica's (tp 0, last stage, any cp).

        Without context parallelism this is :attr:`is_loss_leader`; with it, each CP rank
        scores its own positions and every one's loss sum is added into the world sum,
        while token, correct and sample counts (whole sequences) come from cp 0 only.
        """
        r = self.roles.get(LANGUAGE)
        return r is not None and r.tp == 0 and r.is_last_stage

    @property
    def is_logging_rank(self) -> bool:
        """The single rank that prints and writes metrics (language dp 0 leader)."""
        r = self.roles.get(LANGUAGE)
        return self.is_loss_leader and r is not None and r.dp == 0

    @property
    def module_to_grid_tuple(self) -> list[tuple[str, HyperCommGrid]]:
        return [(n, self.grids[n]) for n in self.module_names]


def build_infra(cfg: MimoConfig, rank: int, world_size: int) -> MimoModelInfra:
    """Plan the layout and create every module's grid and groups (collective).

    Raises:
        ValueError: the layout does not fit ``world_size`` (raised on every rank before
            any group is created, so nobody waits on a collective).
    """
    layout = check_layout(cfg, env_world_size=world_size)
    backend = dist.get_backend() if dist.is_initialized() else None
    # new_group ignores the world's timeout (default 30 min): pass ours so no rank hangs.
    timeout = timedelta(seconds=cfg.train.pg_timeout_s)
    grids = {n: build_module_grid(m.parallel, backend=backend, timeout=timeout)
             for n, m in cfg.modules.items()}
    pgs, multi = build_pg_collections(grids)
    return MimoModelInfra(layout, rank, grids, pgs, multi, layout.topology)
