"""ZeRO-1 sharded optimizer: exact steps, state size divided by DP, checkpoint resharding.

Unit level: ``ZeroShards`` inside a ``MimoOptimizer`` on 2 gloo ranks against plain
AdamW on the summed gradients (awkward shapes: uneven rows, a leading 1, a rank with no
rows), and on TP 2 x DP 2 with DTensor parameters whose local shards split unevenly
(``Shard`` along either dimension, ``Replicate`` with a partial gradient, a plain
parameter), whose nested ``(tp, dp)`` state loads into an unsharded optimizer. Engine
level: ``modules.<m>.parallel.shard_optimizer = true`` on 2 colocated DP ranks and on a
non-colocated layout with vision DP 2 gives bit-identical losses, zero counts and
weights to the unsharded run (fp32; the float64 grad norm within 2e-15 relative: its
sum of squares associates differently), while each rank's optimizer state (measured:
bytes of the tensors in the inner optimizer's state) is the module's state divided by
the DP degree.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.optim import MimoOptimizer, ModuleOptimizerInfo, OptimizerConfig
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.parallel.zero import ZeroShards, chunk_range, shard_dim
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests.common import BASE as COMMON_BASE
from tests.common import train_step

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
ADAM = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
# Shapes that exercise the split: uneven rows (5 -> 3 + 2), a leading 1 (split along
# dim 1: 7 -> 4 + 3), one element (rank 1 holds nothing), a 1-D bias (3 -> 2 + 1).
SHAPES = {"w": (5, 3), "pos": (1, 7, 2), "gain": (1,), "bias": (3,)}


def test_shard_dim_and_chunk_range_follow_torch_chunk() -> None:
    assert [shard_dim(s) for s in SHAPES.values()] == [0, 1, 0, 0]
    assert shard_dim((1, 1)) == 0 and shard_dim((1, 4)) == 1
    for rows in (1, 4, 5, 7):
        for num in (2, 3, 4):
            want = [len(c) for c in torch.arange(rows).chunk(num)]
            want += [0] * (num - len(want))
            got = [end - start for start, end in (chunk_range(rows, num, r) for r in range(num))]
            assert got == want and sum(got) == rows


def _params() -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(3)
    return [(n, nn.Parameter(torch.randn(s, generator=gen))) for n, s in SHAPES.items()]


def _grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank-dependent grads with exact zeros (so the sum over ranks is what DP sees)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for n, s in SHAPES.items():
        g = torch.randn(s, generator=gen)
        g[g.abs() < 0.3] = 0.0
        out[n] = g
    return out


def _mimo(params: list, zero: ZeroShards | None, group: dist.ProcessGroup | None) -> MimoOptimizer:
    stepped = zero.fragments if zero is not None else params
    info = ModuleOptimizerInfo(
        optimizer=torch.optim.AdamW([p for _, p in stepped], **ADAM),
        pg_collection=ProcessGroupCollection(dp=group) if group is not None else None,
        is_active=True, params=stepped, zero=zero)
    return MimoOptimizer({"m": info}, OptimizerConfig(clip_grad=1.0))


def _state_bytes(opt: MimoOptimizer) -> tuple[int, int]:
    """(bytes of moment tensors, bytes of scalar step tensors) in the inner optimizers."""
    moments = steps = 0
    for info in opt.module_infos.values():
        if info.optimizer is None:
            continue
        for st in info.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    n = v.numel() * v.element_size()
                    moments, steps = (moments + n, steps) if v.dim() else (moments, steps + n)
    return moments, steps


def _rank_unit(rank: int, world: int, ckpt: str) -> dict:
    group = dist.new_group(list(range(world)))
    params, ref_params = _params(), _params()
    zero = ZeroShards(params, group)
    opt, ref = _mimo(params, zero, group), _mimo(ref_params, None, None)
    results = []
    for step in range(3):
        for name, p in params:  # each rank backpropagated its own slice...
            p.grad = _grads(step, rank)[name].clone()
        for name, p in ref_params:  # ...the reference sees the DP sum
            p.grad = sum(_grads(step, r)[name] for r in range(world))
        results.append((opt.step(), ref.step()))
    # New parameter storage and values (a model load with assign=True): re-view, step.
    gen = torch.Generator().manual_seed(7)
    for (_, p), (_, q) in zip(params, ref_params, strict=True):
        p.data = torch.randn(p.shape, generator=gen)
        q.data = p.data.clone()
    opt.reload_model_params()
    for name, p in params:
        p.grad = _grads(3, rank)[name].clone()
    for name, p in ref_params:
        p.grad = sum(_grads(3, r)[name] for r in range(world))
    results.append((opt.step(), ref.step()))
    diff = max((p - q).abs().max().item() for (_, p), (_, q) in zip(params, ref_params,
                                                                         strict=True))
    # Checkpoint: sharded DCP save, loaded by an unsharded optimizer on the same ranks.
    flat = opt.sharded_state_dict()
    assert all(isinstance(v, DTensor) for k, v in flat.items() if k.endswith("exp_avg"))
    dcp.save(flat, checkpoint_id=ckpt)
    plain = _mimo(copy.deepcopy(ref_params), None, None)
    loading = plain.sharded_state_dict(is_loading=True)
    dcp.load(loading, checkpoint_id=ckpt)
    plain.load_state_dict(loading)
    ref_state = ref.state_dict()["m"]["state"]
    loaded = plain.state_dict()["m"]["state"]
    dcp_diff = max((loaded[n][k] - ref_state[n][k]).abs().max().item()
                   for n in ref_state for k in ("exp_avg", "exp_avg_sq"))
    # In memory: an unsharded state dict loads into a fresh sharded optimizer (rows sliced).
    params2 = copy.deepcopy(ref_params)
    opt2 = _mimo(params2, ZeroShards(params2, group), group)
    opt2.load_state_dict(copy.deepcopy(ref.state_dict()))  # as if read from disk
    for name, p in params2:
        p.grad = _grads(9, rank)[name].clone()
    for name, p in ref_params:
        p.grad = sum(_grads(9, r)[name] for r in range(world))
    resumed = (opt2.step(), ref.step())
    resumed_diff = max((p - q).abs().max().item()
                       for (_, p), (_, q) in zip(params2, ref_params, strict=True))
    return {"results": results, "diff": diff, "bytes": _state_bytes(opt),
            "ref_bytes": _state_bytes(ref), "dcp_diff": dcp_diff, "resumed": resumed,
            "resumed_diff": resumed_diff}


def test_zero_shards_step_like_adamw_on_summed_grads(tmp_path: Path) -> None:
    out = run_ranks(2, _rank_unit, str(tmp_path / "ckpt"), timeout_s=120)
    for r in out:
        for (success, norm, zeros), (ref_success, ref_norm, ref_zeros) in r["results"]:
            assert success and ref_success
            assert norm == pytest.approx(ref_norm, rel=1e-6) and zeros == ref_zeros
        assert r["diff"] < 1e-6 and r["dcp_diff"] < 1e-7 and r["resumed_diff"] < 1e-6
        assert r["resumed"][0][1] == pytest.approx(r["resumed"][1][1], rel=1e-6)
    # Elements per rank: w 3|2 rows of 3, pos 4|3 rows of 2, gain 1|0, bias 2|1; two fp32
    # moments each.
    sizes = [3 * 3 + 4 * 2 + 1 + 2, 2 * 3 + 3 * 2 + 0 + 1]
    assert [r["bytes"][0] for r in out] == [2 * 4 * n for n in sizes]
    assert sum(r["bytes"][0] for r in out) == out[0]["ref_bytes"][0]


# ---- tensor parallelism, unit level --------------------------------------------------

# TP 2 x DP 2 on mesh [[0, 1], [2, 3]] (TP pairs 0-1 and 2-3). Shapes and placements
# chosen so the LOCAL shards split unevenly over DP: w [6, 3] Shard(0) -> local [3, 3],
# rows 2 + 1; wo [5, 4] Shard(1) -> local [5, 2], rows 3 + 2; head [2, 5] Shard(0) ->
# local [1, 5], split along dim 1 (3 + 2); bias [3] Replicate (its gradient arrives
# Partial: the launch redistributes it) -> 2 + 1; pos [1, 7, 2] plain -> 4 + 3 along dim 1.
TP_PARAMS = {"w": ((6, 3), Shard(0)), "wo": ((5, 4), Shard(1)), "head": ((2, 5), Shard(0)),
             "bias": ((3,), Replicate()), "pos": ((1, 7, 2), None)}


def _placed(full: torch.Tensor, placement: Placement | None, mesh: DeviceMesh,
            partial: bool = False) -> torch.Tensor:
    """``full`` as this TP rank holds it (plain, Replicate, Shard, or split as Partial)."""
    if placement is None:
        return full.clone()
    me = mesh.get_local_rank()
    if partial:  # two addends whose sum is ``full``
        local, placement = full * (0.25 if me == 0 else 0.75), Partial()
    elif isinstance(placement, Shard):
        local = full.chunk(mesh.size(), dim=placement.dim)[me].contiguous()
    else:
        local = full.clone()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=full.shape,
                              stride=full.stride())


def _tp_full(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """Per DP replica the full gradients (step -1: the initial weights)."""
    gen = torch.Generator().manual_seed(100 * step + dp_rank + 1000)
    return {n: torch.randn(shape, generator=gen) for n, (shape, _) in TP_PARAMS.items()}


def _rank_tp(rank: int, world: int, ckpt: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp, tp = mesh["tp"], mesh.get_group("dp"), mesh.get_group("tp")
    init = _tp_full(-1, 0)
    params = [(n, nn.Parameter(_placed(init[n], pl, tp_mesh))) for n, (_, pl) in TP_PARAMS.items()]
    ref_params = [(n, nn.Parameter(init[n].clone())) for n in TP_PARAMS]
    zero = ZeroShards(params, dp)
    info = ModuleOptimizerInfo(
        optimizer=torch.optim.AdamW([f for _, f in zero.fragments], **ADAM),
        pg_collection=ProcessGroupCollection(dp=dp, tp=tp, mp=tp), is_active=True,
        params=zero.fragments, zero=zero)
    opt, ref = MimoOptimizer({"m": info}, OptimizerConfig(clip_grad=1.0)), _mimo(ref_params, None,
                                                                                 None)
    results = []
    for step in range(3):
        mine = _tp_full(step, dist.get_rank(dp))
        for name, p in params:
            p.grad = _placed(mine[name], TP_PARAMS[name][1], tp_mesh, partial=name == "bias")
        for name, q in ref_params:
            q.grad = _tp_full(step, 0)[name] + _tp_full(step, 1)[name]
        results.append((opt.step(), ref.step()))
    full = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in params}
    diff = max((full[n] - q).abs().max().item() for n, q in ref_params)
    # The (tp, dp)-nested state loads through DCP into an unsharded, un-TP'd optimizer.
    dcp.save(opt.sharded_state_dict(), checkpoint_id=ckpt)
    plain = _mimo(copy.deepcopy(ref_params), None, None)
    loading = plain.sharded_state_dict(is_loading=True)
    dcp.load(loading, checkpoint_id=ckpt)
    plain.load_state_dict(loading)
    want, got = ref.state_dict()["m"]["state"], plain.state_dict()["m"]["state"]
    dcp_diff = max((got[n][k] - want[n][k]).abs().max().item()
                   for n in want for k in ("exp_avg", "exp_avg_sq"))
    return {"results": results, "diff": diff, "dcp_diff": dcp_diff,
            "fragments": {n: tuple(f.shape) for n, f in zero.fragments}}


def test_tensor_parallel_shards_split_their_local_rows(tmp_path: Path) -> None:
    """ZeRO over DP of each TP rank's local shard steps like AdamW on the full tensors."""
    out = run_ranks(4, _rank_tp, str(tmp_path / "ckpt"), timeout_s=120)
    for r in out:
        for (success, norm, zeros), (_, ref_norm, ref_zeros) in r["results"]:
            assert success and norm == pytest.approx(ref_norm, rel=1e-6)
            assert zeros == ref_zeros
        assert r["diff"] < 1e-6 and r["dcp_diff"] < 1e-7
    # Rank 0 (dp 0) and rank 2 (dp 1) split TP shard 0's local rows.
    assert out[0]["fragments"] == {"w": (2, 3), "wo": (3, 2), "head": (1, 3), "bias": (2,),
                                   "pos": (1, 4, 2)}
    assert out[2]["fragments"] == {"w": (1, 3), "wo": (2, 2), "head": (1, 2), "bias": (1,),
                                   "pos": (1, 3, 2)}


# ---- engine level --------------------------------------------------------------------

BASE = COMMON_BASE
NUM_ITERS = 4
# The grad norm's float64 sum of squares is summed per fragment, then over the DP group
# (unsharded: per parameter), so it may differ in the last bits (measured: <= 4.6e-16
# relative); the fp32 clip factor, the losses and the weights stay bit-identical.
NORM_REL = 2e-15


def _par(module: str, **kw: object) -> list[str]:
    return [f"modules.{module}.parallel.{k}={str(v).lower()}" for k, v in kw.items()]


def _train(rank: int, world: int, overrides: list[str]) -> dict:
    cfg = load_config(DIGITS, BASE + overrides)
    run = setup_mimo(cfg, init_runtime())
    steps = []
    for _ in range(NUM_ITERS):
        loss, skipped, grad_norm, num_zeros = train_step(run)
        steps.append((loss["loss"], grad_norm, skipped, num_zeros))
    state, rows = {}, {}
    for name, info in run.optimizer.module_infos.items():
        if info.is_active:
            state[name] = _state_bytes(MimoOptimizer({name: info}, run.optimizer.config))
            # Bound on the imbalance of a row split (unsharded run): one row per parameter.
            rows[name] = sum(p.numel() // p.shape[shard_dim(p.shape)] * p.element_size()
                             for _, p in info.params)
    weights = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    return {"steps": steps, "state": state, "rows": rows, "weights": weights,
            "sharded": sorted(n for n, i in run.optimizer.module_infos.items() if i.zero)}


LAYOUTS = {
    # 2 colocated DP ranks, every module sharded.
    "colocated-dp2": (2, [o for m in ("vision", "audio", "language")
                          for o in _par(m, data=2, rank_offset=0)],
                      ("vision", "audio", "language")),
    # Vision DP 2 on ranks 0-1 (sharded), audio on rank 2, language on rank 3.
    "noncolocated-vision-dp2": (4, _par("vision", data=2, rank_offset=0)
                                + _par("audio", data=1, rank_offset=2)
                                + _par("language", data=1, rank_offset=3), ("vision",)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_matches_unsharded_and_divides_state(layout: str) -> None:
    world, par, sharded = LAYOUTS[layout]
    shard = [o for m in sharded for o in _par(m, shard_optimizer=True)]
    plain = run_ranks(world, _train, par, timeout_s=240)
    zero = run_ranks(world, _train, par + shard, timeout_s=240)
    for rank, (p, z) in enumerate(zip(plain, zero, strict=True)):
        assert z["sharded"] == sorted(n for n in sharded if n in z["state"])
        for (lp, gp, sp, zp), (lz, gz, sz, zz) in zip(p["steps"], z["steps"], strict=True):
            assert not sp and not sz
            assert lz == lp, f"rank {rank} loss"  # bitwise
            # Float64 sum of squares, associated per fragment then over DP: ulps apart.
            assert gz == pytest.approx(gp, rel=NORM_REL), f"rank {rank} grad norm"
            assert zz == zp, f"rank {rank} zero count"
        for name, w in p["weights"].items():
            assert torch.equal(z["weights"][name], w), f"rank {rank} {name}"  # bitwise
    # Measured state bytes: each DP rank of a sharded module holds 1/D of the moments.
    for name in sharded:
        ranks = [r for r, z in enumerate(zero) if name in z["state"]]
        assert len(ranks) == 2
        full_moments, full_steps = plain[ranks[0]]["state"][name]
        moments = [zero[r]["state"][name][0] for r in ranks]
        assert sum(moments) == full_moments  # nothing duplicated, nothing lost
        bound = 2 * plain[ranks[0]]["rows"][name]  # two moments, one row per parameter each
        for r in ranks:
            got, steps = zero[r]["state"][name]
            assert abs(got - full_moments / 2) <= bound, (name, r, got, full_moments)
            assert steps == full_steps  # one scalar step count per parameter everywhere
