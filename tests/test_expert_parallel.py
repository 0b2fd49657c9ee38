"""The expert-parallel token exchange alone, against a one-process per-token loop.

One 4-rank run covers two layouts of the same experts (E = 4, k = 2):

* EP 4 over the world, every rank with its own tokens;
* EP 2 over TP peers ``{0, 1}``, ``{2, 3}``, each pair holding IDENTICAL tokens (the
  ``expert_tensor = 1, tensor = 2`` case), expert shards replicated over ``{0, 2}``,
  ``{1, 3}`` (``expt_dp``): each token must be computed once, the input gradients must be
  the full ones on both peers, and the expert gradients summed over ``expt_dp`` must be
  the one-process gradients.

Also checked: forward outputs, input and routing-weight gradients, and the byte counter
(token copies x hidden x 4 bytes each way, counted once per rank).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from mimotron.cli.plan import run_plan
from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.models.moe import GroupedExperts
from mimotron.parallel.expert_parallel import ExchangeBytes, exchange, shard_experts
from mimotron.parallel.layout import check_layout
from tests.common import BASE, DIGITS, colocated, par

E, H, F_, K, T = 4, 8, 6, 2, 5


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w1": torch.randn(E, F_, H, generator=g), "w3": torch.randn(E, F_, H, generator=g),
            "w2": torch.randn(E, H, F_, generator=g)}


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if seed == 1:
        ids = torch.zeros(T, K, dtype=torch.long) + torch.tensor([0, 1])  # all to rank 0
    return x, ids, torch.rand(T, K, generator=g)


def _reference(w: dict, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor
               ) -> torch.Tensor:
    """The obvious per-token loop over full weights."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(H)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(w["w1"][e] @ x[t]) * (w["w3"][e] @ x[t])
            acc = acc + gates[t, j] * (w["w2"][e] @ h)
        rows.append(acc)
    return torch.stack(rows)


class _Block(torch.nn.Module):
    """The attributes ``shard_experts`` looks for (``experts`` and ``dispatcher``)."""

    def __init__(self, w: dict) -> None:
        super().__init__()
        self.experts = GroupedExperts(E, H, F_)
        with torch.no_grad():
            for name, value in w.items():
                getattr(self.experts, name).copy_(value)
        self.dispatcher = None


def _run_layout(seed: int, ep_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None,
                counter: ExchangeBytes) -> dict:
    w = _weights()
    block = _Block(w)
    mesh = DeviceMesh.from_group(ep_group, "cpu", mesh_dim_names=("ep",))
    shard_experts(block, mesh, tp_group, counter)
    x, ids, gates = _tokens(seed)
    x.requires_grad_(True)
    gates.requires_grad_(True)
    out = block.dispatcher(x, ids, gates, block.experts)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + seed))
    (out * upstream).sum().backward()
    grads = {n: getattr(block.experts, n).grad for n in ("w1", "w2", "w3")}
    assert all(isinstance(g, DTensor) for g in grads.values())
    return {"out": out.detach(), "gx": x.grad, "gw": gates.grad, "ids": ids,
            "experts": {n: g.to_local() for n, g in grads.items()}}


def _exchange(rank: int, world: int) -> dict:
    # Plain exchange: rank r sends r + d rows to rank d; gradient comes back reversed.
    send = [rank + d for d in range(world)]
    recv = [s + rank for s in range(world)]
    x = torch.arange(sum(send) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    x.requires_grad_(True)
    y = exchange(x, send, recv, dist.group.WORLD)
    y.backward(y.detach() * 2)
    plain = torch.equal(x.grad, x.detach() * 2)
    first = y[: recv[0]].detach()  # rows rank 0 sent to this rank
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep2 = tp  # EP over the TP peers
    expt_dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    counter4, counter2 = ExchangeBytes(), ExchangeBytes()
    res4 = _run_layout(rank, dist.group.WORLD, None, counter4)
    res2 = _run_layout(rank // 2, ep2[rank // 2], tp[rank // 2], counter2)
    # The expt_dp reduction the engine does for expert parameters.
    for g in res2["experts"].values():
        dist.all_reduce(g, group=expt_dp[rank % 2])
    return {"plain": plain, "first": first, "res4": res4, "res2": res2,
            "bytes4": counter4, "bytes2": counter2}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(4, _exchange, timeout_s=90)


def test_plain_exchange_routes_rows_and_reverses_gradients(results):
    for rank, r in enumerate(results):
        assert r["plain"]
        # Rank 0 sends d rows to rank d, after the d (d - 1) / 2 rows of lower ranks.
        start = rank * (rank - 1) // 2
        expected = torch.arange(2 * start, 2 * (start + rank), dtype=torch.float32).view(-1, 2)
        assert torch.equal(r["first"], expected)


def _full_reference(seeds: list[int]) -> tuple[list, list, list, dict]:
    w = {n: v.clone().requires_grad_(True) for n, v in _weights().items()}
    outs, gxs, gws = [], [], []
    for seed in seeds:
        x, ids, gates = _tokens(seed)
        x.requires_grad_(True)
        gates.requires_grad_(True)
        out = _reference(w, x, ids, gates)
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + seed))
        (out * upstream).sum().backward()
        outs.append(out.detach())
        gxs.append(x.grad)
        gws.append(gates.grad)
    return outs, gxs, gws, {n: v.grad for n, v in w.items()}


@pytest.mark.parametrize("layout", ["res4", "res2"])
def test_dispatch_matches_the_per_token_loop(results, layout):
    seeds = [0, 1, 2, 3] if layout == "res4" else [0, 1]
    outs, gxs, gws, gexp = _full_reference(seeds)
    for rank, r in enumerate(results):
        seed = rank if layout == "res4" else rank // 2
        res = r[layout]
        i = seeds.index(seed)
        torch.testing.assert_close(res["out"], outs[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["gx"], gxs[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["gw"], gws[i], rtol=1e-5, atol=1e-5)
        ep_rank, ep_size = (rank, 4) if layout == "res4" else (rank % 2, 2)
        for name, g in res["experts"].items():
            expected = gexp[name].chunk(ep_size, dim=0)[ep_rank]
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-5)


def test_byte_counter_counts_every_token_copy_once(results):
    row = H * 4
    b4 = [r["bytes4"] for r in results]
    assert all(b.dispatch == T * K * row and b.rows == T * K for b in b4)
    # Each rank sends back what it received: summed over the group, every copy once.
    assert sum(b.combine for b in b4) == 4 * T * K * row
    assert sum(b.backward for b in b4) == 2 * 4 * T * K * row
    # TP peers split their identical tokens (3 + 2 of 5): each copy dispatched once.
    for pair in ((0, 1), (2, 3)):
        b2 = [results[r]["bytes2"] for r in pair]
        assert [b.rows for b in b2] == [3 * K, 2 * K]
        assert sum(b.dispatch for b in b2) == sum(b.combine for b in b2) == T * K * row


# ---- layouts, from the config alone -----------------------------------------------------

MOE_CFG = ["modules.language.num_experts=4", "modules.language.top_k=2"]


def _plan(overrides: list[str]) -> None:
    check_layout(load_config(DIGITS, BASE + overrides))


@pytest.mark.parametrize("overrides, field", [
    (colocated(3) + par("language", expert=3), "modules.language.parallel.expert=3"),
    (colocated(2) + par("language", expert=4), "modules.language.parallel.expert=4"),
    (colocated(2) + par("vision", expert=2), "modules.vision.parallel.expert=2"),
    (colocated(3) + par("language", expert_tensor=3),  # expert width 176
     "modules.language.parallel.expert_tensor=3"),
    (colocated(2) + par("language", expert=2, expert_tensor=2),
     "modules.language.parallel.expert=2"),
])
def test_invalid_expert_layouts_are_rejected_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        _plan(MOE_CFG + ["train.micro_batch_size=12", "train.global_batch_size=24"]
              + overrides)


def test_top_k_above_num_experts_is_rejected():
    with pytest.raises(ValueError, match="top_k=5"):
        _plan(MOE_CFG + ["modules.language.top_k=5"])


def test_plan_shows_which_experts_live_on_which_rank(capsys):
    code = run_plan(str(DIGITS), BASE + MOE_CFG + colocated(4) + par("language", expert=2))
    out = capsys.readouterr().out
    assert code == 0
    assert "experts of language: 4 per MoE layer, expert=2, 2 per rank" in out
    assert "rank   0  ep 0  expt_dp 0  pp 0  experts 0-1" in out
    assert "rank   3  ep 1  expt_dp 1  pp 0  experts 2-3" in out
    assert "routed expert params" in out
