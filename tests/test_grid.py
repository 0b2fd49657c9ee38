"""HyperCommGrid: pure rank enumeration, validation, views, and group creation on gloo."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch._dynamo  # noqa: F401 - imported lazily by distribute_tensor: ~1 s per forked rank
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grid import HyperCommGrid

BASE = ["tp", "cp", "dp", "pp"]
EXPERT = ["expt_tp", "ep", "expt_dp", "pp"]


# ---------------------------------------------------------------- pure enumeration


def test_enum_tp2_cp1_dp2_pp2_offset4() -> None:
    grid = HyperCommGrid([2, 1, 2, 2], BASE, rank_offset=4)
    assert grid.size == 8 and grid.rank_range == range(4, 12)
    assert grid.get_rank_enum("tp") == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert grid.get_rank_enum("cp") == [[r] for r in range(4, 12)]
    assert grid.get_rank_enum("dp") == [[4, 6], [5, 7], [8, 10], [9, 11]]
    assert grid.get_rank_enum("pp") == [[4, 8], [5, 9], [6, 10], [7, 11]]
    assert grid.get_rank_enum(["dp", "cp"]) == grid.get_rank_enum("dp")
    assert grid.get_rank_enum(["tp", "pp"]) == [[4, 5, 8, 9], [6, 7, 10, 11]]
    assert grid.get_rank_enum(["pp", "tp"]) == grid.get_rank_enum(["tp", "pp"])
    assert grid.get_rank_enum(BASE) == [list(range(4, 12))]


def test_enum_tp1_cp2_dp3_pp1() -> None:
    grid = HyperCommGrid([1, 2, 3, 1], BASE)
    assert grid.get_rank_enum("tp") == [[r] for r in range(6)]
    assert grid.get_rank_enum("cp") == [[0, 1], [2, 3], [4, 5]]
    assert grid.get_rank_enum("dp") == [[0, 2, 4], [1, 3, 5]]
    assert grid.get_rank_enum(["cp", "dp"]) == [list(range(6))]
    assert grid.get_rank_enum("pp") == [[r] for r in range(6)]


def test_enum_tp2_cp1_dp1_pp3_offset2() -> None:
    grid = HyperCommGrid([2, 1, 1, 3], BASE, rank_offset=2)
    assert grid.get_rank_enum("pp") == [[2, 4, 6], [3, 5, 7]]
    assert grid.get_rank_enum("tp") == [[2, 3], [4, 5], [6, 7]]
    assert grid.get_rank_enum(["tp", "cp"]) == [[2, 3], [4, 5], [6, 7]]
    assert grid.get_coordinate(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    assert grid.get_coordinate(1) is None and grid.get_coordinate(8) is None


def test_enum_every_rank_once_and_ascending() -> None:
    grid = HyperCommGrid([2, 3, 2, 2], BASE, rank_offset=7)
    for dims in (["tp"], ["dp"], ["cp", "pp"], ["tp", "dp", "pp"]):
        groups = grid.get_rank_enum(dims)
        assert sorted(r for g in groups for r in g) == list(grid.rank_range)
        assert all(g == sorted(g) for g in groups)
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        size = 1
        for d in dims:
            size *= grid.shape[BASE.index(d)]
        assert all(len(g) == size for g in groups)


def test_expert_view_enum_shares_pp() -> None:
    grid = HyperCommGrid([2, 1, 4, 2], BASE)
    grid.register_view("expert", [1, 4, 2, 2], EXPERT, shared_dims=["pp"])
    assert grid.get_rank_enum("pp", view="expert") == grid.get_rank_enum("pp")
    assert grid.get_rank_enum("ep", view="expert") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    ]
    assert grid.get_rank_enum("expt_dp", view="expert") == [
        [0, 4],
        [1, 5],
        [2, 6],
        [3, 7],
        [8, 12],
        [9, 13],
        [10, 14],
        [11, 15],
    ]
    assert grid.get_coordinate(13, view="expert") == {"expt_tp": 0, "ep": 1, "expt_dp": 1, "pp": 1}


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("shape", "names", "match"),
    [
        ([2, 0], ["tp", "dp"], "dp"),
        ([2, -1], ["tp", "dp"], "dp"),
        ([2, 2], ["tp"], "same length"),
        ([2, 2], ["tp", "tp"], "unique"),
        ([], [], "at least one"),
    ],
)
def test_invalid_shape(shape: list[int], names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HyperCommGrid(shape, names)


def test_invalid_offset_and_dims() -> None:
    with pytest.raises(ValueError, match="rank_offset"):
        HyperCommGrid([2], ["tp"], rank_offset=-1)
    grid = HyperCommGrid([2, 2], ["tp", "dp"])
    with pytest.raises(ValueError, match="pp"):
        grid.get_rank_enum("pp")
    with pytest.raises(ValueError, match="distinct"):
        grid.get_rank_enum(["tp", "tp"])
    with pytest.raises(ValueError, match="unknown view"):
        grid.get_rank_enum("tp", view="expert")


@pytest.mark.parametrize(
    ("shape", "names", "shared", "match"),
    [
        ([2, 2, 2, 2], EXPERT, ["pp"], "prod"),  # 16 ranks over a grid of 8
        ([2, 2, 1, 2], EXPERT, ["ep"], "shared dim 'ep'"),  # not a base dim
        ([1, 1, 2, 4], EXPERT, ["pp"], "size/stride"),  # pp size 4, base has 2
        ([2, 4], ["pp", "ep"], ["pp"], "size/stride"),  # pp size 2 but stride 1, base 4
    ],
)
def test_invalid_view(shape: list[int], names: list[str], shared: list[str], match: str) -> None:
    grid = HyperCommGrid([2, 1, 2, 2], BASE)
    with pytest.raises(ValueError, match=match):
        grid.register_view("expert", shape, names, shared)
    assert grid.views == ["base"]


def test_custom_pg_validation() -> None:
    grid = HyperCommGrid([2, 2], ["tp", "pp"], rank_offset=2)
    for bad in ([[2, 3], [3, 4]], [[1, 2]], [[2], []]):
        with pytest.raises(ValueError, match="rank_groups"):
            grid.create_custom_pg("embd", bad)
    with pytest.raises(ValueError, match="not created"):
        grid.get_custom_pg("embd")


def test_duplicate_view_rejected() -> None:
    grid = HyperCommGrid([2, 2], ["tp", "pp"])
    grid.register_view("expert", [2, 2], ["ep", "pp"], ["pp"])
    with pytest.raises(ValueError, match="already exists"):
        grid.register_view("expert", [2, 2], ["ep", "pp"], ["pp"])


# ---------------------------------------------------------------- process groups (gloo)


def _check_pg(pg: dist.ProcessGroup | None, expected: list[list[int]], rank: int) -> None:
    """``pg`` holds exactly the expected group of ``rank`` (or is None when it has none)."""
    mine = [g for g in expected if rank in g]
    if not mine:
        assert pg is None
        return
    assert pg is not None and dist.get_process_group_ranks(pg) == mine[0]
    # Prove the members by communicating: the sum of rank ids and the member count.
    t = torch.tensor([float(rank), 1.0])
    dist.all_reduce(t, group=pg)
    assert t.tolist() == [float(sum(mine[0])), float(len(mine[0]))], (t, mine[0])


_DIMS = (["tp"], ["cp"], ["dp"], ["pp"], ["cp", "dp"], ["tp", "pp"])


def _disjoint_grids(rank: int, world_size: int) -> int:
    grid_a = HyperCommGrid([2, 1, 2, 1], BASE, rank_offset=0)  # ranks 0-3: tp2 dp2
    grid_b = HyperCommGrid([1, 1, 2, 2], BASE, rank_offset=4)  # ranks 4-7: dp2 pp2
    for grid in (grid_a, grid_b):
        for dims in _DIMS:
            grid.create_pg(dims)
    assert grid_a.is_current_rank_in_grid() == (rank < 4)
    assert grid_b.is_current_rank_in_grid() == (rank >= 4)
    for grid in (grid_a, grid_b):
        for dims in _DIMS:
            _check_pg(grid.get_pg(dims), grid.get_rank_enum(dims), rank)
    with pytest.raises(ValueError, match="exist"):
        grid_a.create_pg(["dp", "cp"])  # same key as ["cp", "dp"]
    with pytest.raises(ValueError, match=r"\['tp', 'dp'\]"):
        grid_a.get_pg(["dp", "tp"])
    return dist.get_rank()


def test_disjoint_grids_8_ranks() -> None:
    assert run_ranks(8, _disjoint_grids, timeout_s=60) == list(range(8))


def _colocated_grids(rank: int, world_size: int) -> None:
    vision = HyperCommGrid([1, 1, 4, 1], BASE)
    language = HyperCommGrid([2, 1, 1, 2], BASE)
    for grid in (vision, language):
        for dims in _DIMS:
            grid.create_pg(dims)
    for grid in (vision, language):
        for dims in _DIMS:
            _check_pg(grid.get_pg(dims), grid.get_rank_enum(dims), rank)
    # Within one grid, equal memberships share one group (cp == tp == singletons here).
    assert vision.get_pg("tp") is vision.get_pg("cp")
    # Across grids groups are never shared: each module owns its communicators.
    assert vision.get_pg("tp") is not language.get_pg("cp")


def test_colocated_grids_4_ranks() -> None:
    run_ranks(4, _colocated_grids, timeout_s=60)


def _expert_view(rank: int, world_size: int) -> None:
    grid = HyperCommGrid([2, 1, 2, 2], BASE, timeout=timedelta(seconds=13))
    grid.register_view("expert", [1, 4, 1, 2], EXPERT, shared_dims=["pp"])
    pp = grid.create_pg("pp")
    # The grid's timeout reaches its groups (new_group's default would be 30 min).
    assert pp._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=13)
    assert grid.get_pg("pp", view="expert") is pp
    with pytest.raises(ValueError, match="exist"):
        grid.create_pg("pp", view="expert")  # already created through the base view
    ep = grid.create_pg("ep", view="expert")
    tp_ep_pp = grid.create_pg(["expt_tp", "ep", "pp"], view="expert")
    _check_pg(pp, grid.get_rank_enum("pp"), rank)
    _check_pg(ep, [[0, 1, 2, 3], [4, 5, 6, 7]], rank)
    _check_pg(tp_ep_pp, [list(range(8))], rank)
    # Options take the group-at-a-time path (new_group per group), a description too.
    dp = grid.create_pg("dp", group_desc="dp with a description")
    _check_pg(dp, grid.get_rank_enum("dp"), rank)


def test_expert_view_shares_pp_8_ranks() -> None:
    run_ranks(8, _expert_view, timeout_s=60)


def _device_mesh(rank: int, world_size: int) -> None:
    grid = HyperCommGrid([2, 1, 1, 2], BASE, rank_offset=2)  # ranks 2-5
    other = HyperCommGrid([2], ["tp"], rank_offset=0)  # ranks 0-1
    mesh = grid.to_device_mesh()
    count = dist.distributed_c10d.get_pg_count()
    again = grid.to_device_mesh()
    sub = grid.to_device_mesh(dims=["tp", "pp"])
    other.to_device_mesh()
    # The meshes reuse the grid's groups: only `other` created new ones.
    assert dist.distributed_c10d.get_pg_count() == count + 1
    assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert again.mesh_dim_names == mesh.mesh_dim_names
    assert sub.mesh_dim_names == ("pp", "tp") and sub.shape == (2, 2)
    if not grid.is_current_rank_in_grid():
        assert mesh.get_coordinate() is None
        return
    coord = grid.get_coordinate()
    assert list(mesh.get_coordinate()) == [coord[d] for d in ("pp", "dp", "cp", "tp")]
    assert mesh.mesh.flatten().tolist() == [2, 3, 4, 5]
    assert mesh.get_group("tp") is grid.get_pg("tp") is sub.get_group("tp")
    assert mesh.get_local_rank("pp") == coord["pp"]
    # DTensor works on the mesh: shard over tp, replicate elsewhere, round-trip.
    x = torch.arange(8.0).reshape(4, 2)
    dt = distribute_tensor(x, mesh, [Replicate(), Replicate(), Replicate(), Shard(0)])
    assert dt.to_local().shape == (2, 2) and torch.equal(dt.full_tensor(), x)
    assert mesh["tp"].get_group() is grid.get_pg("tp")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group("pp"))
    assert t.item() == sum(next(g for g in grid.get_rank_enum("pp") if rank in g))


def test_to_device_mesh_reuses_groups() -> None:
    run_ranks(6, _device_mesh, timeout_s=60)
