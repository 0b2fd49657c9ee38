"""Case ``experts``: bytes the expert-parallel token exchange moves vs the analytic minimum.

An MoE layer's routed part (:class:`~mimotron.parallel.expert_parallel.
ExpertParallelDispatcher` around real :class:`~mimotron.models.moe.GroupedExperts`) runs
forward and backward on forked gloo ranks, ``steps`` times, in three layouts:

* ``ep2``: EP 2, each rank with its own tokens;
* ``ep4``: EP 4, each rank with its own tokens;
* ``ep2_tp2``: EP 2 over dense TP peers (``tensor = 2, expert_tensor = 1``) holding
  identical tokens, twice (DP 2): each token copy must still travel once.

The dispatcher counts the bytes its ``all_to_all_single`` calls send (an
:class:`~mimotron.parallel.expert_parallel.ExchangeBytes` passed in; rows to this rank
itself included, the share leaving the rank reported apart). The analytic minimum of a
step is every distinct token's ``k`` copies dispatched and combined once:
``2 * tokens * k * hidden * 4`` bytes (fp32), forward; backward moves the same again.
``experts_bytes_ratio`` = forward row bytes / minimum; 1.00 means no duplication (the
per-expert count exchange, ``8 * E`` bytes per rank and layer, is reported apart).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from benchmarks.common import CaseResult, Figure, Options
from mimotron.forked_ranks import run_ranks
from mimotron.models.moe import GroupedExperts
from mimotron.parallel.expert_parallel import ExchangeBytes, shard_experts

# layout -> (world size, TP peers with identical tokens)
LAYOUTS = {"ep2": (2, 1), "ep4": (4, 1), "ep2_tp2": (4, 2)}


class _Block(torch.nn.Module):
    """What :func:`shard_experts` looks for: ``experts`` and a ``dispatcher``."""

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.experts = GroupedExperts(num_experts, hidden, 2 * hidden)
        torch.manual_seed(0)
        for p in self.experts.parameters():
            torch.nn.init.normal_(p, std=hidden**-0.5)
        self.dispatcher = None


def _rank(rank: int, world: int, tp: int, tokens: int, hidden: int, experts: int, k: int,
          steps: int) -> dict[str, int]:
    # EP over the TP peers when tp > 1 (groups {0, 1}, {2, 3}); else over the world.
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    ep_group = groups[rank // tp] if tp > 1 else dist.group.WORLD
    block = _Block(experts, hidden)
    mesh = DeviceMesh.from_group(ep_group, "cpu", mesh_dim_names=("ep",))
    counter = ExchangeBytes()
    shard_experts(block, mesh, ep_group if tp > 1 else None, counter)
    g = torch.Generator().manual_seed(rank // tp)  # TP peers: identical tokens
    for _ in range(steps):
        x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
        logits = torch.randn(tokens, experts, generator=g)
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        block.dispatcher(x, ids, weights, block.experts).square().sum().backward()
    return {"dispatch": counter.dispatch, "combine": counter.combine,
            "backward": counter.backward, "remote": counter.remote, "counts": counter.counts,
            "distinct_tokens": tokens * steps if rank % tp == 0 else 0}


def measure(layout: str, tokens: int, hidden: int, experts: int, k: int,
            steps: int) -> dict[str, Any]:
    """Bytes of one layout summed over its ranks, with the analytic minimum."""
    world, tp = LAYOUTS[layout]
    per_rank = run_ranks(world, _rank, tp, tokens, hidden, experts, k, steps, timeout_s=300)
    total = {key: sum(r[key] for r in per_rank) for key in per_rank[0]}
    minimum = 2 * total["distinct_tokens"] * k * hidden * 4
    forward = total["dispatch"] + total["combine"]
    return {**total, "forward_bytes": forward, "minimum_bytes": minimum,
            "ratio": forward / minimum, "backward_ratio": total["backward"] / minimum,
            "remote_share": total["remote"] / (forward + total["backward"]),
            "world": world, "tokens_per_rank": tokens, "steps": steps}


def format_rows(results: dict[str, dict[str, Any]]) -> str:
    """A plain table of the layouts (printed by :func:`run_case`'s notes and standalone)."""
    lines = [f"{'layout':<8} {'ranks':>5} {'fwd bytes':>12} {'minimum':>12} {'ratio':>6} "
             f"{'bwd ratio':>9} {'remote':>7} {'counts':>7}"]
    for name, r in results.items():
        lines.append(f"{name:<8} {r['world']:>5} {r['forward_bytes']:>12,} "
                     f"{r['minimum_bytes']:>12,} {r['ratio']:>6.2f} {r['backward_ratio']:>9.2f} "
                     f"{r['remote_share']:>7.0%} {r['counts']:>7,}")
    return "\n".join(lines)


def run_case(opts: Options) -> CaseResult:
    """Measure every layout; one figure per layout (target: no duplicated token copy)."""
    tokens, hidden = (16, 16) if opts.tiny else (512, 128)
    steps = 2 if opts.quick or opts.tiny else 5
    results = {name: measure(name, tokens, hidden, 8, 2, steps) for name in LAYOUTS}
    res = CaseResult("experts", measurements=results)
    for name, r in results.items():
        res.figures.append(Figure(
            f"experts_bytes_ratio_{name}", r["ratio"], "<= 1.0",
            detail=(f"EP exchange row bytes per step / (tokens x k x hidden x 4 B, both ways); "
                    f"{r['world']} ranks, {r['remote_share']:.0%} leaves the rank")))
    res.notes.append("experts table:\n" + format_rows(results))
    return res


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    print(format_rows({n: measure(n, 512, 128, 8, 2, 5) for n in LAYOUTS}))
