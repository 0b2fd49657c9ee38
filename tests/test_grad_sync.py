"""GradSync, branch by branch, against per-rank gradients summed in plain PyTorch.

Each case runs a small model on forked gloo ranks: two micro-batches of rank-dependent
inputs, the step's :class:`~mimotron.parallel.grad_sync.GradSync` armed before the last
backward (as the schedule does), then ``finish``. The expected gradients are computed in
every rank independently: the same model and micro-batches of *every* rank of the
group, run with plain autograd (no hooks, no collectives) and summed. Buckets are tiny
(one per linear layer), so each module has several.

Branches:

* plain (no hooks, module by module) and the ``finalize_model_grads`` entry point with a
  ZeRO-1 module named only (left to its optimizer);
* overlapped with every hook firing (no flush), with a bucket whose hooks fire only
  partly on one rank (its last micro-batch skips a layer: that rank flushes it and the
  buckets queued after it, in order), with an encoder that runs no backward on one rank
  (its slice has no sample of the modality: its gradients are zero-filled and flushed),
  and with frozen parts (a frozen layer inside a module, a frozen module: never summed);
* ZeRO-1 reduce-scatter buckets, plain (the optimizer launches them) and overlapped
  (launched from hooks and by the flush, waited for by ``reduce_grads``);
* sequence-parallel TP-partial gradients on TP 2 x DP 2: the bucket holding them is
  late, launched by the flush after the TP sum;
* expert shards on EP 2 x expert-DP 2: summed over ``expt_dp`` only, in late buckets.

Every counted flush is asserted, so a ``finish`` that skipped the flush fails (a rank
would wait for a bucket its peer never launched, or a gradient would stay unsummed).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from mimotron.forked_ranks import run_ranks
from mimotron.parallel.expert_parallel import EP_AXIS
from mimotron.parallel.grad_sync import GradSync, finalize_model_grads
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.sequence_parallel import SP_ATTR
from mimotron.parallel.zero import ZeroShards, chunk_range, shard_dim

H = 8
# 4 buckets a module (own parameters register first): [norm, a.weight],
# [a.bias, extra.weight], [extra.bias, b.weight], [b.bias]; the overlap queue takes them
# last first, so skipping ``extra`` stalls it at its second bucket (hooks fire partly), and
# a sequence-parallel norm makes the module's last bucket late.
BUCKET_BYTES = 288
NUM_MICROBATCHES = 2


class Toy(nn.Module):
    """Linear layers ``a``, ``b``, an optional ``extra`` and a norm-like weight."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = nn.Linear(H, H)
        self.frozen.requires_grad_(False)
        self.a = nn.Linear(H, H)
        self.norm = nn.Parameter(torch.rand(H) + 0.5)
        self.extra, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor, use_extra: bool, partial: torch.Tensor | None
                ) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(self.frozen(x))) * self.norm)
        if use_extra:
            y = y + self.extra(y)
        loss = y.pow(2).mean()
        if partial is not None:  # a TP rank's share of the norm's gradient
            loss = loss + (self.norm * partial).sum()
        return loss


def inputs(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(3, H, generator=g), torch.randn(H, generator=g)


def run_backward(models: dict[str, Toy], case: dict, rank: int, sync: GradSync | None) -> None:
    """The rank's micro-batches; ``sync`` is armed before the last backward."""
    dp_rank, tp_rank = case["coords"](rank)
    for k in range(NUM_MICROBATCHES):
        last = k == NUM_MICROBATCHES - 1
        if sync is not None and last:
            sync.arm()
        x, z = inputs(dp_rank, k)
        partial = inputs(100 + rank, k)[1] if case.get("sp") else None
        use_extra = not (last and rank in case.get("skip_extra_on", ()))
        loss = models["language"](x, use_extra, partial)
        for name in ("vision", "still"):
            if name in models and not (name == "vision" and rank in case.get("no_vision_on", ())):
                loss = loss + models[name](x * 0.5, True, None)
        loss.backward()


def build(case: dict) -> dict[str, Toy]:
    models = {"language": Toy(0), "vision": Toy(1)}
    if case.get("frozen_module"):
        models["still"] = Toy(2)
        models["still"].requires_grad_(False)
        models["still"].norm.requires_grad_(True)  # trainable param of a frozen module
    if case.get("sp"):
        setattr(models["language"].norm, SP_ATTR, True)
    return models


def expected_grads(case: dict, group_ranks: dict[str, list[int]]) -> dict[str, dict]:
    """Per module, per parameter: the sum of every group member's plain-autograd grad."""
    out: dict[str, dict] = {}
    per_rank = {}
    for r in range(case["world"]):
        models = build(case)
        run_backward(models, case, r, None)
        per_rank[r] = {m: {n: p.grad for n, p in mod.named_parameters()}
                       for m, mod in models.items()}
    for m, ranks in group_ranks.items():
        if m not in per_rank[0]:
            continue
        out[m] = {}
        for n in per_rank[ranks[0]][m]:
            grads = [per_rank[r][m][n] for r in ranks if per_rank[r][m][n] is not None]
            out[m][n] = sum(grads) if grads else None  # a missing gradient counts zero
    return out


def dp2(rank: int) -> tuple[int, int]:
    return rank, 0


def tp2dp2(rank: int) -> tuple[int, int]:
    return rank // 2, rank % 2  # tp groups {0,1},{2,3}; dp groups {0,2},{1,3}


CASES: dict[str, dict] = {
    "plain": {"world": 2, "coords": dp2, "overlap": False, "skip_extra_on": (1,),
              "no_vision_on": (1,), "frozen_module": True},
    "plain-zero-named": {"world": 2, "coords": dp2, "overlap": False, "zero": "named"},
    "overlap-all-hooks": {"world": 2, "coords": dp2, "overlap": True, "flushed": (0, 0)},
    "overlap-partial-hooks": {"world": 2, "coords": dp2, "overlap": True,
                              "skip_extra_on": (1,), "flushed": (0, 7)},
    "overlap-no-backward-frozen": {"world": 2, "coords": dp2, "overlap": True,
                                   "no_vision_on": (1,), "frozen_module": True,
                                   "flushed": (0, 4)},
    "zero-plain": {"world": 2, "coords": dp2, "overlap": False, "zero": "shards",
                   "skip_extra_on": (1,)},
    "zero-overlap-partial": {"world": 2, "coords": dp2, "overlap": True, "zero": "shards",
                             "skip_extra_on": (0,), "no_vision_on": (1,), "flushed": (7, 4)},
    "sp-tp2dp2-overlap": {"world": 4, "coords": tp2dp2, "overlap": True, "sp": True,
                          "flushed": (4, 4, 4, 4)},
    "sp-tp2dp2-plain": {"world": 4, "coords": tp2dp2, "overlap": False, "sp": True},
}


def groups_for(case: dict, rank: int) -> tuple[ProcessGroupCollection, dict[str, list[int]]]:
    """This rank's groups (every rank creates every group, in one order)."""
    if case["world"] == 2:
        dp = dist.new_group([0, 1])
        return ProcessGroupCollection(dp=dp), {"language": [0, 1], "vision": [0, 1]}
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_ranks = [[0, 2], [1, 3]][rank % 2]
    pg = ProcessGroupCollection(tp=tps[rank // 2], dp=dps[rank % 2])
    return pg, {"language": dp_ranks, "vision": dp_ranks}


def case_run(rank: int, world: int, name: str) -> dict:
    case = CASES[name]
    pg, group_ranks = groups_for(case, rank)
    group_ranks["still"] = [rank]  # frozen: this rank's own gradients, never summed
    models = build(case)
    frozen = {"still"} if case.get("frozen_module") else set()
    if case.get("sp"):  # the norm's grad is partial over TP: summed over all 4 ranks
        full = expected_grads(case, {"language": list(range(world)), "vision": [0]})
        expected = expected_grads(case, group_ranks)
        expected["language"]["norm"] = full["language"]["norm"]
    else:
        expected = expected_grads(case, group_ranks)
    pgs = dict.fromkeys(models, pg)
    shards = None
    if case.get("zero") == "shards":
        shards = ZeroShards([(n, p) for n, p in models["language"].named_parameters()
                             if p.requires_grad], pg.dp, BUCKET_BYTES)
    if case.get("zero") == "named":
        run_backward(models, case, rank, None)
        finalize_model_grads(models, pgs, frozen, {"language"}, BUCKET_BYTES)
        sync = None
    else:
        sync = GradSync(models, pgs, frozen, BUCKET_BYTES,
                        {"language": shards} if shards is not None else None,
                        overlap=case["overlap"])
        run_backward(models, case, rank, sync)
        sync.finish()
    if shards is not None:
        shards.reduce_grads()
    local = {m: {n: None if p.grad is None else p.grad.clone()
                 for n, p in mod.named_parameters()} for m, mod in models.items()}
    fragments = ({n: f.grad.clone() for n, f in shards.fragments}
                 if shards is not None else {})
    counts = (sync.num_launched_early, sync.num_flushed, len(sync.buckets)) if sync else None
    return {"grads": local, "expected": expected, "fragments": fragments, "counts": counts,
            "dp_size": 2, "dp_rank": case["coords"](rank)[0] % 2}


def expected_fragment(full: torch.Tensor, num_shards: int, shard_rank: int) -> torch.Tensor:
    dim = shard_dim(full.shape)
    start, end = chunk_range(full.shape[dim], num_shards, shard_rank)
    return full.narrow(dim, start, end - start)


@pytest.mark.parametrize("name", list(CASES))
def test_grad_sync_sums_like_plain_pytorch(name: str) -> None:
    case = CASES[name]
    results = run_ranks(case["world"], case_run, name, timeout_s=120, pg_timeout_s=30)
    for rank, res in enumerate(results):
        exp = res["expected"]
        for m, grads in res["grads"].items():
            for n, g in grads.items():
                if n.startswith("frozen."):  # a frozen layer inside a trained module
                    assert g is None, (rank, m, n)
                    continue
                if case.get("zero") and m == "language":
                    continue  # reduced into the optimizer's fragments, checked below
                if exp[m][n] is None:
                    assert g is None, (rank, m, n)
                    continue
                torch.testing.assert_close(g, exp[m][n], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank}: {m}.{n}")
        for n, frag in res["fragments"].items():
            want = expected_fragment(exp["language"][n], res["dp_size"], res["dp_rank"])
            torch.testing.assert_close(frag, want, rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank}: fragment {n}")
        if "flushed" in case:
            early, flushed, num = res["counts"]
            assert flushed == case["flushed"][rank], (rank, res["counts"])
            assert early + flushed <= num and num >= 8, (rank, res["counts"])
            if case["flushed"][rank] == 0 and not case.get("sp"):
                assert early == num, (rank, res["counts"])  # every bucket from a hook


def expert_run(rank: int, world: int, overlap: bool) -> dict:
    """EP 2 x expert-DP 2: expert shards summed over expt_dp, dense over all 4 ranks."""
    e, d = rank % 2, rank // 2
    eps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    expt_dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp = dist.new_group([0, 1, 2, 3])
    ep = eps[d]
    mesh = DeviceMesh.from_group(ep, "cpu", mesh_dim_names=(EP_AXIS,))
    module = nn.Module()
    module.dense = nn.Linear(H, H)
    module.w = nn.Parameter(DTensor.from_local(torch.zeros(2, H), mesh, [Shard(0)],
                                               run_check=False))
    sync = GradSync({"language": module}, {"language": ProcessGroupCollection(
        dp=dp, ep=ep, expt_dp=expt_dps[e])}, (), BUCKET_BYTES, overlap=overlap)
    sync.arm()

    def grad(r: int, n: int) -> torch.Tensor:
        return torch.randn(n, generator=torch.Generator().manual_seed(r))

    module.dense.weight.grad = grad(rank, H * H).view(H, H)
    module.dense.bias.grad = grad(10 + rank, H)
    module.w.grad = DTensor.from_local(grad(20 + rank, 2 * H).view(2, H), mesh, [Shard(0)],
                                       run_check=False)
    sync.finish()
    want_w = sum(grad(20 + r, 2 * H).view(2, H) for r in (e, e + 2))
    want_dense = sum(grad(r, H * H).view(H, H) for r in range(4))
    torch.testing.assert_close(module.w.grad.to_local(), want_w)
    torch.testing.assert_close(module.dense.weight.grad, want_dense)
    return [b.late for b in sync.buckets]


@pytest.mark.parametrize("overlap", [False, True])
def test_expert_buckets_sum_over_expt_dp(overlap: bool) -> None:
    results = run_ranks(4, expert_run, overlap, timeout_s=120, pg_timeout_s=30)
    if overlap:  # dense buckets early, the expert bucket last and late
        assert all(lates == [False, True] for lates in results), results
