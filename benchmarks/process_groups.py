"""Process groups at scale: how many a rank joins and how many world-wide operations a
job's start-up makes, at 64, 1,024 and 4,096 ranks (torch's ``fake`` backend: one
process builds the groups as one rank of the world, no communication).

The layouts are Llama-2-70B + ViT-L's (``configs/llama2_70b_vit_64gpu.toml``: the
vision tower TP 8, the language model TP 8 with sequence parallelism over pipeline
stages), grown by data parallelism:

======  ======================  =================================
ranks   vision                  language
======  ======================  =================================
64      TP 8 (ranks 0-7)        TP 8 x PP 7 (11-12 layers a stage)
1,024   TP 8 x DP 16            TP 8 x PP 7 x DP 16
4,096   TP 8 x DP 64            TP 8 x PP 7 x DP 64
======  ======================  =================================

A rank builds every module's groups (``build_infra``) and the point-to-point links of
the pipeline and the bridges (``build_link_groups``), as training does. Counted:

* **groups per rank**: the groups of two ranks or more the rank is a member of (each an
  NCCL communicator once used; the world's is one more);
* **world-wide operations, a group at a time**: the ``new_group`` calls every rank makes
  (one per group of the world: with NCCL bound to a device each is a world-wide
  communicator split, ranks outside the group joining without a colour);
* **world-wide operations, a set at a time**: the splits
  (:func:`~mimotron.parallel.group_factory.create_groups`: one per set of disjoint
  groups), what the job makes now.

Usage::

    python benchmarks/process_groups.py            # the three sizes, rank 0 and a last rank
    python benchmarks/process_groups.py --world 64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mimotron.config import load_config  # noqa: E402
from mimotron.parallel import group_factory  # noqa: E402
from mimotron.pipeline.edges import build_edges  # noqa: E402
from mimotron.pipeline.links import build_link_groups, p2p_links  # noqa: E402
from mimotron.training.infra import build_infra  # noqa: E402

CONFIG = ROOT / "configs" / "llama2_70b_vit_64gpu.toml"
LAYOUTS = {  # world size -> overrides of CONFIG
    64: [],
    1024: ["modules.vision.parallel.data=16", "modules.language.parallel.data=16",
           "modules.language.parallel.rank_offset=128", "train.global_batch_size=16",
           "train.micro_batch_size=16"],
    4096: ["modules.vision.parallel.data=64", "modules.language.parallel.data=64",
           "modules.language.parallel.rank_offset=512", "train.global_batch_size=64",
           "train.micro_batch_size=64"],
}


@dataclass(frozen=True)
class Census:
    """What one rank's start-up made.

    Attributes:
        world: ranks in the world.
        rank: the rank that built them.
        groups_joined: groups of two ranks or more this rank is a member of.
        group_calls: ``new_group`` calls (the world-wide operations a group at a time).
        splits: splits of the world (the world-wide operations a set at a time).
        split_log: every split's groups, in order (what every rank must issue alike).
    """

    world: int
    rank: int
    groups_joined: int
    group_calls: int
    splits: int
    split_log: tuple[tuple[tuple[int, ...], ...], ...]


@contextmanager
def _counting(log: list[Any], calls: list[int]) -> Iterator[None]:
    """Count ``new_group`` calls and record every split, restoring both after."""
    new_group, split = dist.new_group, group_factory.emulated_split_group

    def counted_new_group(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return new_group(*args, **kwargs)

    def recorded_split(**kwargs: Any) -> Any:
        log.append(tuple(tuple(g) for g in kwargs["split_ranks"]))
        return split(**kwargs)

    dist.new_group, group_factory.emulated_split_group = counted_new_group, recorded_split
    try:
        yield
    finally:
        dist.new_group, group_factory.emulated_split_group = new_group, split


def census(world: int, rank: int) -> Census:
    """Build the layout of ``world`` ranks as ``rank`` (fake backend) and count."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = load_config(str(CONFIG), LAYOUTS[world])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    log: list[Any] = []
    calls: list[int] = []
    try:
        with _counting(log, calls):
            infra = build_infra(cfg, rank, world)
            edges = build_edges(infra.layout, {"vision": "image"})
            links = p2p_links(infra.layout, cfg.train.micro_batch_size, edges)
            build_link_groups(links, rank, timedelta(seconds=60))
        joined = sum(1 for pg, members in dist.distributed_c10d._world.pg_group_ranks.items()
                     if pg is not dist.group.WORLD and rank in members and len(members) > 1)
    finally:
        dist.destroy_process_group()
    return Census(world, rank, joined, len(calls), len(log), tuple(log))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, action="append", choices=sorted(LAYOUTS))
    args = parser.parse_args()
    print("| ranks | rank | groups it joins | world-wide ops, a group at a time | "
          "world-wide ops, a set at a time |")
    print("|---|---|---|---|---|")
    for world in args.world or sorted(LAYOUTS):
        for rank in (0, world - 1):
            c = census(world, rank)
            print(f"| {world:,} | {rank} | {c.groups_joined} | {c.group_calls:,} | {c.splits} |")


if __name__ == "__main__":
    main()
