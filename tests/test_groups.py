"""Process-group collections: module grids from config, gloo groups, and a 256-rank layout."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
import torch.distributed as dist

from mimotron.config import ParallelConfig
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import (
    GROUP_ORDER,
    MultiModuleProcessGroupCollection,
    ProcessGroupCollection,
    build_module_grid,
    build_pg_collections,
)

FIELDS = [f.name for f in fields(ProcessGroupCollection)]


def expected_groups(grid: HyperCommGrid) -> dict[str, list[list[int]]]:
    """Every field's groups, computed independently of ``from_grid``."""
    out = {}
    for name, view, dims in GROUP_ORDER:
        if view is None or view in grid.views:
            out[name] = grid.get_rank_enum(list(dims), view)
    pipelines = grid.get_rank_enum("pp")
    out["embd"] = [[p[0], p[-1]] if len(p) > 1 else [p[0]] for p in pipelines]
    out["pos_embd"] = [[p[0]] for p in pipelines]
    return out


def check_collection(pgs: ProcessGroupCollection, grid: HyperCommGrid, rank: int) -> None:
    """Each field holds exactly this rank's expected group, or None outside the grid."""
    expected = expected_groups(grid)
    for name in FIELDS:
        pg = getattr(pgs, name)
        mine = [g for g in expected.get(name, []) if rank in g]
        if not mine:
            assert pg is None, (name, rank)
            continue
        assert pg is not None and dist.get_process_group_ranks(pg) == mine[0], (name, rank)
        if dist.get_backend() == "gloo":
            # Prove membership by communication: sum of rank ids and member count.
            t = torch.tensor([float(rank), 1.0])
            dist.all_reduce(t, group=pg)
            assert t.tolist() == [float(sum(mine[0])), float(len(mine[0]))], (name, t)


# ---------------------------------------------------------------- pure


def test_build_module_grid_shapes() -> None:
    grid = build_module_grid(ParallelConfig(tensor=2, data=3, pipeline=2, rank_offset=5))
    assert grid.shape == [2, 1, 3, 2] and grid.dim_names == ["tp", "cp", "dp", "pp"]
    assert grid.rank_range == range(5, 17) and grid.views == ["base"]
    moe = build_module_grid(ParallelConfig(tensor=2, data=4, pipeline=2, expert=4))
    assert moe.view_dim_names("expert") == ["expt_tp", "ep", "expt_dp", "pp"]
    assert moe.get_rank_enum("ep", view="expert")[0] == [0, 1, 2, 3]
    assert moe.get_rank_enum("expt_dp", view="expert")[0] == [0, 4]
    tp_moe = build_module_grid(ParallelConfig(data=4, expert_tensor=2))
    assert tp_moe.get_rank_enum("expt_dp", view="expert") == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (ParallelConfig(data=4, expert=3), "must divide"),
        (ParallelConfig(data=2, expert=2, expert_tensor=2), "must divide"),
        (ParallelConfig(tensor=0), "'tp'"),
        (ParallelConfig(rank_offset=-2), "rank_offset"),
    ],
)
def test_build_module_grid_invalid(cfg: ParallelConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_module_grid(cfg)


def test_from_grid_rejects_other_dims() -> None:
    with pytest.raises(ValueError, match="dim_names"):
        ProcessGroupCollection.from_grid(HyperCommGrid([2, 2], ["dp", "tp"]))


def test_multi_module_collection() -> None:
    vision, language = ProcessGroupCollection(), ProcessGroupCollection()
    both = MultiModuleProcessGroupCollection({"vision": vision, "language": language})
    assert both.modules == ["language", "vision"] and len(both) == 2
    assert "vision" in both and "audio" not in both and both["vision"] is vision
    assert both.has_language_model() and both.get_language_model_collection() is language
    assert both.get_language_model_cp_size() == 1  # no cp group: degree 1
    encoder_only = MultiModuleProcessGroupCollection({"vision": vision})
    assert not encoder_only.has_language_model()
    with pytest.raises(ValueError, match="has_language_model"):
        encoder_only.get_language_model_cp_size()
    with pytest.raises(KeyError, match="audio"):
        encoder_only["audio"]
    with pytest.raises(ValueError, match="module_pgs"):
        MultiModuleProcessGroupCollection({})


# ---------------------------------------------------------------- gloo


def _non_colocated(rank: int, world_size: int) -> list[str]:
    grids = {
        "vision": build_module_grid(ParallelConfig(tensor=2, data=2)),
        "language": build_module_grid(ParallelConfig(data=2, pipeline=2, expert=2, rank_offset=4)),
    }
    all_pgs, mine = build_pg_collections(grids)
    for name in sorted(grids):
        check_collection(all_pgs[name], grids[name], rank)
    assert mine.has_language_model() == (rank >= 4)
    assert mine.modules == (["language"] if rank >= 4 else ["vision"])
    if rank >= 4:
        lm = mine.get_language_model_collection()
        assert lm.embd.size() == 2  # pipelines [4, 6] and [5, 7]: first + last stage
        # Only the first stage holds position embeddings.
        assert (lm.pos_embd is not None) == (rank in (4, 5))
        assert lm.pp is grids["language"].get_pg("pp", view="expert")
    return mine.modules


def test_non_colocated_8_ranks() -> None:
    modules = run_ranks(8, _non_colocated, timeout_s=60)
    assert modules == [["vision"]] * 4 + [["language"]] * 4


def _colocated(rank: int, world_size: int) -> None:
    grids = {
        "vision": build_module_grid(ParallelConfig(data=4)),
        "audio": build_module_grid(ParallelConfig(tensor=4)),
        "language": build_module_grid(ParallelConfig(tensor=2, pipeline=2)),
    }
    all_pgs, mine = build_pg_collections(grids)
    for name in sorted(grids):
        check_collection(all_pgs[name], grids[name], rank)
    assert mine.modules == ["audio", "language", "vision"]
    assert mine["language"].mp.size() == 4 and mine["vision"].dp.size() == 4
    assert mine["language"].ep is None  # no expert view without expert degrees


def test_colocated_4_ranks() -> None:
    run_ranks(4, _colocated, timeout_s=60)


# ---------------------------------------------------------------- 256 ranks, fake backend


def _fake_layout() -> dict[str, HyperCommGrid]:
    return {
        "vision": build_module_grid(ParallelConfig(tensor=2, data=16, pipeline=2)),
        "language": build_module_grid(
            ParallelConfig(tensor=4, data=12, pipeline=4, expert=8, rank_offset=64)
        ),
    }


def _fake_rank(rank: int) -> tuple[int, dict[tuple[int, ...], str]]:
    """Build the layout as ``rank`` of 256; return the group count and name per group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=256)
    try:
        grids = _fake_layout()
        all_pgs, mine = build_pg_collections(grids)
        for name in sorted(grids):
            check_collection(all_pgs[name], grids[name], rank)
        assert mine.has_language_model() == (rank >= 64)
        if rank >= 64:
            lm = mine.get_language_model_collection()
            assert lm.ep.size() == 8 and lm.expt_dp.size() == 6 and lm.tp_ep_pp.size() == 32
        names = {
            tuple(dist.get_process_group_ranks(pg)): pg.group_name
            for pgs in mine.module_pgs.values()
            for f in FIELDS
            if (pg := getattr(pgs, f)) is not None
        }
        return dist.distributed_c10d.get_pg_count(), names
    finally:
        dist.destroy_process_group()


def test_256_ranks_fake_backend() -> None:
    results = [_fake_rank(r) for r in (0, 1, 37, 63, 64, 65, 68, 130, 255)]
    # Same global order on every rank: same number of groups, and a group shared by two
    # ranks has the same name (new_group numbers groups by call order) on both.
    assert len({count for count, _ in results}) == 1
    seen: dict[tuple[int, ...], str] = {}
    for _, names in results:
        for ranks, name in names.items():
            assert seen.setdefault(ranks, name) == name, ranks
    assert any(len(ranks) > 1 and ranks[0] >= 64 for ranks in seen)
