"""Process groups a kind at a time (:mod:`mimotron.parallel.group_factory`): the links'
colour sets, the split contract every rank must keep, and the world-wide operations of
a job's start-up at 64 and 1,024 ranks (``benchmarks/process_groups.py``; 4,096 there)."""

from __future__ import annotations

import random

import pytest
import torch.distributed as dist

from benchmarks.process_groups import census
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.group_factory import check_split, colour_sets, create_groups


def test_colour_sets_deal_each_link_once_into_sets_sharing_no_rank():
    rng = random.Random(0)
    links = sorted({(a, b) for a, b in ((rng.randrange(12), rng.randrange(12))
                                        for _ in range(60)) if a != b})
    sets = colour_sets(links)
    assert sorted(link for s in sets for link in s) == links
    for s in sets:
        ranks = [r for link in s for r in link]
        assert len(ranks) == len(set(ranks)), s
    degree = max(sum(r in link for link in links) for r in range(12))
    assert len(sets) <= 2 * degree - 1
    # Both directions of a pair are two groups, in two sets.
    assert colour_sets([(0, 1), (1, 0)]) == [[(0, 1)], [(1, 0)]]


@pytest.mark.parametrize("split,match", [
    ([], "non-empty"), ([[0, 1], []], "non-empty"), ([[0, 1], [1, 2]], "disjoint"),
    ([[0, 4]], r"ranks in \[0, 4\)"),
])
def test_a_split_must_be_disjoint_non_empty_groups_of_the_world(split, match):
    with pytest.raises(ValueError, match=match):
        check_split(split, 4)


def _groups_of_four(rank: int, world: int) -> list[list[float]]:
    """Two splits of 4 gloo ranks; each rank sums its rank over the groups it got."""
    import torch

    out = []
    for groups in ([[0, 1], [2, 3]], [[1, 3], [0, 2]], [[0, 1, 2]]):
        pg = create_groups(groups)
        if rank == 3 and groups == [[0, 1, 2]]:
            assert pg is None  # in no group of the split
            continue
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=pg)
        out.append([t.item(), float(pg.size())])
    return out


def test_each_rank_gets_the_group_holding_it():
    results = run_ranks(4, _groups_of_four, timeout_s=60)
    assert results[0] == [[1.0, 2.0], [2.0, 2.0], [3.0, 3.0]]
    assert results[3] == [[5.0, 2.0], [4.0, 2.0]]


def test_every_rank_issues_the_same_splits_in_the_same_order():
    """What an NCCL split needs of the world (each rank splits the world communicator
    alike): the start-up of 64 ranks (Llama-2-70B + ViT-L, split layout) seen from ranks
    of every module and stage issues one sequence of splits, each a set of disjoint
    groups, whatever the rank."""
    seen = [census(64, rank) for rank in (0, 7, 8, 20, 63)]
    assert len({c.split_log for c in seen}) == 1
    for split in seen[0].split_log:
        check_split([list(g) for g in split], 64)


def test_world_wide_operations_grow_with_group_kinds_not_with_the_world():
    """A group at a time, every rank makes a call per group of the world (195 at 64
    ranks, 3,184 at 1,024); a set at a time, a fixed handful (12 and 14: the kinds of
    group, and the colour sets of the links)."""
    small, large = census(64, 0), census(1024, 0)
    assert (small.group_calls, large.group_calls) == (195, 3184)
    assert (small.splits, large.splits) == (12, 14)
    assert large.groups_joined <= 7


def test_the_plan_counts_the_communicators_the_start_up_makes():
    """:func:`communicators_of` (from the layout alone, what the plan reserves NCCL
    buffers for) against the groups of two or more ranks a start-up really made, plus
    the world's: ranks of every module and stage at 64 ranks, two at 1,024."""
    from benchmarks.process_groups import CONFIG, LAYOUTS
    from mimotron.config import load_config
    from mimotron.parallel.layout import check_layout
    from mimotron.pipeline.communicators import communicators_of

    for world, ranks in ((64, (0, 7, 8, 20, 63)), (1024, (5, 1000))):
        cfg = load_config(str(CONFIG), LAYOUTS[world])
        layout = check_layout(cfg)
        for rank in ranks:
            made = census(world, rank).groups_joined + 1
            assert communicators_of(layout, rank, cfg.train.micro_batch_size) == made, rank


def _fit_rows(capsys, *options: str) -> dict[int, float]:
    """``mimotron plan --device-memory 80GB``'s per-rank totals (MiB) of the 64-rank layout."""
    from benchmarks.process_groups import CONFIG
    from mimotron.cli.main import main

    assert main(["plan", str(CONFIG), "--device-memory", "80GB", *options]) == 0
    out = capsys.readouterr().out.split("fit on a device")[1]
    rows = [line.split() for line in out.splitlines()[2:] if line.strip()[:1].isdigit()]
    return {int(r[0]): float(r[-3].replace(",", "")) for r in rows}


def test_the_plan_reserves_nccl_buffers_per_communicator(capsys):
    """Each rank's fit adds ``--nccl-buffer-mib`` per communicator it joins (128 MiB by
    default; 0 leaves the estimate alone); a negative figure is one error line."""
    from benchmarks.process_groups import CONFIG
    from mimotron.cli.main import main
    from mimotron.config import load_config
    from mimotron.parallel.layout import check_layout
    from mimotron.pipeline.communicators import communicators_of

    layout = check_layout(load_config(str(CONFIG)))
    with_buffers, without = _fit_rows(capsys), _fit_rows(capsys, "--nccl-buffer-mib", "0")
    for rank in (0, 8, 63):
        added = with_buffers[rank] - without[rank]
        assert added == pytest.approx(128 * communicators_of(layout, rank, 1), abs=0.01)
    assert main(["plan", str(CONFIG), "--device-memory", "80GB", "--nccl-buffer-mib", "-1"]) == 2
    assert "--nccl-buffer-mib=-1.0 is invalid" in capsys.readouterr().err
