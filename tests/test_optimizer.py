"""MimoOptimizer: one-process parity with torch, multi-rank world consensus (gloo), and
state round trips (optimizer alone, and through the engine with model and schedulers)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from mimotron.config import MimoConfig, ModuleConfig, load_config
from mimotron.data.tokenizer import CharTokenizer
from mimotron.forked_ranks import run_ranks
from mimotron.models.build import build_mimo_model
from mimotron.optim import (
    ConstantLossScaler,
    DynamicLossScaler,
    MimoOptimizer,
    ModuleOptimizerInfo,
    OptimizerConfig,
    build_torch_optimizer,
    get_mimo_optimizer,
    load_schedulers_state_dict,
    schedulers_state_dict,
)
from mimotron.parallel.groups import ProcessGroupCollection
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_step_mimo
from mimotron.training.model_setup import freeze_modules
from mimotron.training.step import default_forward_step

SIZES = {"c": (3, 5), "a": (4, 3), "b": (6, 4)}  # module -> (in, out); unsorted on purpose
ADAM = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _modules(seed: int = 0) -> dict[str, nn.Linear]:
    torch.manual_seed(seed)
    return {name: nn.Linear(i, o) for name, (i, o) in SIZES.items()}


def _set_grads(mods: dict[str, nn.Module], step: int, scale: float = 1.0) -> None:
    """Deterministic grads: the same for any copy of the same modules."""
    gen = torch.Generator().manual_seed(100 + step)
    for name in sorted(mods):
        for _, p in mods[name].named_parameters():
            g = torch.randn(p.shape, generator=gen)
            g[g.abs() < 0.2] = 0.0  # some exact zeros for count_zeros
            p.grad = g * scale


def _all_params(mods: dict[str, nn.Module]) -> list[nn.Parameter]:
    return [p for name in sorted(mods) for p in mods[name].parameters()]


def _mimo(mods: dict[str, nn.Module], clip: float = 1.0, scaler: bool = False) -> MimoOptimizer:
    infos = {
        name: ModuleOptimizerInfo(
            optimizer=torch.optim.AdamW(m.parameters(), **ADAM),
            is_active=True,
            params=list(m.named_parameters()),
            loss_scaler=DynamicLossScaler(1024.0, 1.0, 1000, 1) if scaler else ConstantLossScaler(),
        )
        for name, m in mods.items()
    }
    return MimoOptimizer(infos, OptimizerConfig(clip_grad=clip))


def test_grad_norm_and_clipping_match_torch() -> None:
    mods = _modules()
    ref = copy.deepcopy(mods)
    opt = _mimo(mods, clip=0.5)
    _set_grads(mods, 0)
    _set_grads(ref, 0)
    ref_norm = nn.utils.clip_grad_norm_(_all_params(ref), 0.5).item()
    assert opt.get_grad_norm() == pytest.approx(ref_norm, rel=1e-6)
    assert ref_norm > 0.5  # clipping is really exercised
    assert opt.clip_grad_norm() == pytest.approx(ref_norm, rel=1e-6)
    for p, q in zip(_all_params(mods), _all_params(ref), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    assert opt.get_grad_norm() == pytest.approx(0.5, rel=1e-5)
    opt.clip_grad_norm(0.0)  # 0 = off
    assert opt.get_grad_norm() == pytest.approx(0.5, rel=1e-5)


def test_step_matches_plain_adamw_with_clipping() -> None:
    mods = _modules()
    ref = copy.deepcopy(mods)
    opt = _mimo(mods, clip=1.0)
    ref_opt = torch.optim.AdamW(_all_params(ref), **ADAM)
    for step in range(4):
        _set_grads(mods, step)
        _set_grads(ref, step)
        zeros = sum(int((p.grad == 0).sum()) for p in _all_params(ref))
        ref_norm = nn.utils.clip_grad_norm_(_all_params(ref), 1.0).item()
        ref_opt.step()
        success, norm, num_zeros = opt.step()
        assert success and norm == pytest.approx(ref_norm, rel=1e-6) and num_zeros == zeros
    for p, q in zip(_all_params(mods), _all_params(ref), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_count_zeros_and_zero_grad() -> None:
    mods = _modules()
    opt = _mimo(mods)
    for p in _all_params(mods):
        p.grad = torch.ones_like(p)
    mods["a"].weight.grad.zero_()  # 12 zeros
    mods["c"].bias.grad[:2] = 0.0  # 2 zeros
    mods["b"].bias.grad = None  # absent grads count nothing
    assert opt.count_zeros() == 14
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is None or not p.grad.any() for p in _all_params(mods))
    opt.zero_grad()
    assert all(p.grad is None for p in _all_params(mods))


def test_param_groups_are_tagged_and_live() -> None:
    mods = _modules()
    opt = _mimo(mods)
    assert [g["module"] for g in opt.param_groups] == ["a", "b", "c"]
    opt.param_groups[1]["lr"] = 0.5
    assert opt.module_infos["b"].optimizer.param_groups[0]["lr"] == 0.5
    assert list(opt.module_infos) == ["a", "b", "c"]  # slot order = sorted names
    assert float(opt.get_loss_scale()) == 1.0


def test_state_dict_round_trip_is_keyed_by_name() -> None:
    mods = _modules()
    opt = _mimo(mods)
    for step in range(2):
        _set_grads(mods, step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["a"]["state"]) == {"weight", "bias"}
    assert sd["a"]["param_groups"][0]["params"] == ["weight", "bias"]
    mods2 = copy.deepcopy(mods)
    infos = {  # a different parameter order: name keys must still match state to params
        name: ModuleOptimizerInfo(
            optimizer=torch.optim.AdamW([m.bias, m.weight], **ADAM),
            is_active=True,
            params=list(m.named_parameters()),
        )
        for name, m in mods2.items()
    }
    opt2 = MimoOptimizer(infos, OptimizerConfig(clip_grad=1.0))
    opt2.load_state_dict(sd)
    _set_grads(mods, 2)
    _set_grads(mods2, 2)
    assert opt.step() == opt2.step()
    for p, q in zip(_all_params(mods), _all_params(mods2), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError):
        opt2.load_state_dict({"a": sd["a"], "b": sd["b"]})  # module c missing


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_state_dict_dcp_round_trip(tmp_path: Path) -> None:
    mods = _modules()
    opt = _mimo(mods, scaler=True)
    for step in range(2):
        _set_grads(mods, step, scale=1024.0)
        opt.step()
    flat = opt.sharded_state_dict()
    assert isinstance(flat["optimizer.a.state.weight.exp_avg"], torch.Tensor)
    assert flat["optimizer.b.param_groups"][0]["module"] == "b"
    assert flat["optimizer.c.loss_scaler"]["growth_tracker"] == 2
    dcp.save(flat, checkpoint_id=str(tmp_path))
    mods2 = copy.deepcopy(mods)
    opt2 = _mimo(mods2, scaler=True)
    sd2 = opt2.sharded_state_dict(is_loading=True)
    for p, q in zip(_all_params(mods), _all_params(mods2), strict=True):
        assert torch.equal(p, q)  # materialising state must not move parameters
    dcp.load(sd2, checkpoint_id=str(tmp_path))
    opt2.load_state_dict(sd2)
    assert opt2.module_infos["c"].loss_scaler.state_dict()["growth_tracker"] == 2
    _set_grads(mods, 2, scale=1024.0)
    _set_grads(mods2, 2, scale=1024.0)
    assert opt.step() == opt2.step()
    for p, q in zip(_all_params(mods), _all_params(mods2), strict=True):
        assert torch.equal(p, q)


def test_fp16_scaling_unscales_and_found_inf_skips() -> None:
    mods = _modules()
    ref = copy.deepcopy(mods)
    opt = _mimo(mods, scaler=True)
    ref_opt = torch.optim.AdamW(_all_params(ref), **ADAM)
    _set_grads(mods, 0, scale=1024.0)
    _set_grads(ref, 0)
    ref_norm = nn.utils.clip_grad_norm_(_all_params(ref), 1.0).item()
    ref_opt.step()
    success, norm, _ = opt.step()
    assert success and norm == pytest.approx(ref_norm, rel=1e-6)
    before = [p.detach().clone() for p in _all_params(mods)]
    _set_grads(mods, 1, scale=1024.0)
    mods["b"].weight.grad[0, 0] = float("inf")
    assert opt.step() == (False, None, None)
    assert float(opt.get_loss_scale()) == 512.0
    assert all(torch.equal(a, p) for a, p in zip(before, _all_params(mods), strict=True))


def _frozen(cfg: MimoConfig) -> nn.Module:
    model = _FakeMimo()
    freeze_modules(model, cfg)
    return model


class _FakeMimo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modality_submodules = nn.ModuleDict({"vision": nn.Linear(4, 4)})
        self.language_model = nn.ModuleDict(
            {"proj": nn.Linear(4, 4), "norm": nn.LayerNorm(4), "out": nn.Linear(4, 4)}
        )
        self.language_model["proj"].weight.requires_grad_(False)  # not trainable: skipped


class _NoGetMapping:
    def __init__(self, items: dict) -> None:
        self._items = items

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __getitem__(self, key: str) -> ProcessGroupCollection:
        return self._items[key]


def test_dynamic_loss_scaler_growth_hysteresis_and_state() -> None:
    s = DynamicLossScaler(8.0, 2.0, growth_interval=3, hysteresis=2)
    s.update(True)
    assert float(s.scale) == 8.0  # first overflow absorbed by hysteresis
    s.update(True)
    assert float(s.scale) == 4.0
    s.update(True)
    s.update(True)
    assert float(s.scale) == 2.0  # min_scale floor
    for _ in range(3):
        s.update(False)
    assert float(s.scale) == 4.0 and s.inv_scale == 0.25
    t = DynamicLossScaler(1.0, 1.0, 3, 2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    const = ConstantLossScaler()
    const.update(True)
    assert float(const.scale) == 1.0 and not const.is_dynamic
    with pytest.raises(ValueError):
        DynamicLossScaler(0.0, 1.0, 3, 2)
    with pytest.raises(ValueError):
        DynamicLossScaler(8.0, 1.0, 0, 2)


def test_get_mimo_optimizer_builds_per_module_optimizers() -> None:
    cfg = MimoConfig(
        modules={
            "vision": ModuleConfig(kind="vit", optimizer={"name": "sgd", "momentum": 0.9}),
            "audio": ModuleConfig(kind="audio"),  # not on this rank
            "language": ModuleConfig(kind="language"),
        }
    )
    cfg.optimizer.weight_decay = 0.1
    opt = get_mimo_optimizer(_FakeMimo(), cfg, precision="fp16")
    infos = opt.module_infos
    assert list(infos) == ["audio", "language", "vision"]
    assert not infos["audio"].is_active and infos["audio"].optimizer is None
    assert isinstance(infos["vision"].optimizer, torch.optim.SGD)
    lang = infos["language"].optimizer
    assert isinstance(lang, torch.optim.AdamW)
    names = {id(p): n for n, p in infos["language"].params}
    groups = [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in lang.param_groups]
    no_decay = ["proj.bias", "norm.weight", "norm.bias", "out.bias"]  # "norm" / "bias" names
    assert groups == [(["out.weight"], 0.1), (no_decay, 0.0)]
    assert all(isinstance(i.loss_scaler, DynamicLossScaler) for i in infos.values())
    assert float(opt.get_loss_scale()) == cfg.optimizer.initial_loss_scale

    cfg.modules["vision"].freeze = True
    with pytest.raises(ValueError, match="freeze_modules"):  # freezing is the model's job
        get_mimo_optimizer(_FakeMimo(), cfg)
    opt = get_mimo_optimizer(_frozen(cfg), cfg)
    assert not opt.module_infos["vision"].is_active and opt.module_infos["vision"].frozen
    assert [g["module"] for g in opt.param_groups] == ["language", "language"]
    with pytest.raises(ValueError):
        get_mimo_optimizer(_frozen(cfg), cfg, precision="fp8")
    grid = SimpleNamespace(size=2, is_current_rank_in_grid=lambda: True)
    with pytest.raises(ValueError, match="pg_collections"):  # a 2-rank module needs its groups
        get_mimo_optimizer(_frozen(cfg), cfg, grids={"language": grid})
    pgs = _NoGetMapping({"language": ProcessGroupCollection()})  # like the multi-module bundle
    opt = get_mimo_optimizer(_frozen(cfg), cfg, grids={"language": grid}, pg_collections=pgs)
    assert opt.module_infos["language"].pg_collection is pgs["language"]
    with pytest.raises(ValueError):
        build_torch_optimizer([("w", nn.Parameter(torch.ones(1)))], OptimizerConfig(name="lion"))


# ---- multi-rank: module A on ranks 0-1 (dp=2), module B on ranks 2-3 (mp=2) ---------------

FULL = {"A": (4, 4), "B": (5, 6)}  # out rows of the split module go half to each rank


def _full_modules() -> dict[str, nn.Linear]:
    torch.manual_seed(1)
    return {name: nn.Linear(i, o) for name, (i, o) in FULL.items()}


def _piece(t: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of a full tensor of its module (B rows split by mp rank)."""
    return t if rank < 2 else t.chunk(2, dim=0)[rank - 2]


def _scaler(dynamic: bool) -> ConstantLossScaler | DynamicLossScaler:
    return DynamicLossScaler(1024.0, 1.0, 1000, 1) if dynamic else ConstantLossScaler()


def _split_infos(rank: int, full: dict[str, nn.Linear], dynamic: bool) -> dict:
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank, same order
    mine = "A" if rank < 2 else "B"
    params = [
        (n, nn.Parameter(_piece(p.detach(), rank).clone()))
        for n, p in full[mine].named_parameters()
    ]
    pg = ProcessGroupCollection(dp=g01) if rank < 2 else ProcessGroupCollection(mp=g23)
    other = "B" if rank < 2 else "A"
    return {
        mine: ModuleOptimizerInfo(
            optimizer=torch.optim.AdamW([p for _, p in params], **ADAM),
            pg_collection=pg,
            is_active=True,
            params=params,
            loss_scaler=_scaler(dynamic),
        ),
        other: ModuleOptimizerInfo(loss_scaler=_scaler(dynamic)),
    }


def _rank_split(rank: int, world_size: int, inject_inf: bool) -> dict:
    full = _full_modules()
    infos = _split_infos(rank, full, dynamic=inject_inf)
    opt = MimoOptimizer(infos, OptimizerConfig(clip_grad=1.0))
    ref_opt = torch.optim.AdamW(_all_params(full), **ADAM)
    mine = "A" if rank < 2 else "B"
    scale = 1024.0 if inject_inf else 1.0
    out: dict = {"steps": [], "ref": []}
    for step in range(3):
        _set_grads(full, step)
        for (_, p), (_, q) in zip(full[mine].named_parameters(), infos[mine].params, strict=True):
            q.grad = _piece(p.grad, rank) * scale
        ref_zeros = sum(int((p.grad == 0).sum()) for p in _all_params(full))
        out["ref"].append((nn.utils.clip_grad_norm_(_all_params(full), 1.0).item(), ref_zeros))
        if inject_inf and step == 2 and rank == 3:
            infos["B"].params[0][1].grad[1, 1] = float("nan")
        res = opt.step()
        out["steps"].append(res)
        if res[0]:
            ref_opt.step()
    out["diff"] = max(
        (q - _piece(p.detach(), rank)).abs().max().item()
        for (_, p), (_, q) in zip(full[mine].named_parameters(), infos[mine].params, strict=True)
    )
    out["scales"] = [float(i.loss_scaler.scale) for i in opt.module_infos.values()]
    return out


@pytest.mark.parametrize("inject_inf", [False, True])
def test_multirank_split_modules_match_one_process(inject_inf: bool) -> None:
    results = run_ranks(4, _rank_split, inject_inf, timeout_s=120)
    steps = [r["steps"] for r in results]
    assert all(s == steps[0] for s in steps)  # identical (success, norm, zeros) everywhere
    for (success, norm, zeros), (ref_norm, ref_zeros) in zip(steps[0], results[0]["ref"],
                                                              strict=True):
        if success:
            assert norm == pytest.approx(ref_norm, rel=1e-6) and zeros == ref_zeros
    if inject_inf:
        assert [s[0] for s in steps[0]] == [True, True, False]
        assert steps[0][2] == (False, None, None)
        assert all(r["scales"] == [512.0, 512.0] for r in results)  # hysteresis 1: halved
    else:
        assert all(s[0] for s in steps[0])
        assert all(r["scales"] == [1.0, 1.0] for r in results)
    assert max(r["diff"] for r in results) < 1e-6


def _separate_step(opt: MimoOptimizer) -> tuple[bool, float | None, int | None]:
    """``step()`` spelled out with the public methods, each with its own collective."""
    if opt.prepare_grads():
        return False, None, None
    norm, zeros = opt.get_grad_norm(), opt.count_zeros()
    opt.clip_grad_norm(grad_norm=norm)
    return opt.step_with_ready_grads(), norm, zeros


def _rank_fused_vs_separate(rank: int, world_size: int) -> dict:
    full = _full_modules()
    fused_infos, parts_infos = (_split_infos(rank, full, dynamic=True) for _ in range(2))
    fused = MimoOptimizer(fused_infos, OptimizerConfig(clip_grad=1.0))
    parts = MimoOptimizer(parts_infos, OptimizerConfig(clip_grad=1.0))
    mine = "A" if rank < 2 else "B"
    out: dict = {"fused": [], "parts": [], "sums": []}
    for step in range(4):
        _set_grads(full, step, scale=1024.0)
        for infos in (fused_infos, parts_infos):
            for (_, p), (_, q) in zip(full[mine].named_parameters(), infos[mine].params,
                                      strict=True):
                q.grad = _piece(p.grad, rank).clone()  # unscaled in place
            if step == 2 and rank == 3:  # an overflow on one rank: both paths skip
                infos["B"].params[0][1].grad[1, 1] = float("inf")
        addends = torch.tensor([rank + 0.25, 1.0], dtype=torch.float64)
        *res, sums = fused.step_with_world_sums(addends)
        out["fused"].append(tuple(res))
        out["sums"].append(sums)
        out["parts"].append(_separate_step(parts))
    out["same_params"] = all(
        torch.equal(a, b) for (_, a), (_, b) in zip(fused_infos[mine].params,
                                                    parts_infos[mine].params, strict=True))
    out["scales"] = [[float(i.loss_scaler.scale) for i in o.module_infos.values()]
                     for o in (fused, parts)]
    return out


def test_fused_step_is_bitwise_the_separate_calls() -> None:
    # One world collective (found-inf, norm and zero slots, caller's sums) gives exactly
    # what prepare_grads / get_grad_norm / count_zeros / clip / step_with_ready_grads give.
    results = run_ranks(4, _rank_fused_vs_separate, timeout_s=120)
    for r in results:
        assert r["fused"] == r["parts"]  # == on the float norms: bitwise
        assert r["same_params"] and r["scales"][0] == r["scales"][1]
        assert r["sums"] == [[0.25 + 1.25 + 2.25 + 3.25, 4.0]] * 4
    assert [s[0] for s in results[0]["fused"]] == [True, True, False, True]
    assert results[0]["fused"] == results[3]["fused"]


def _dtensor_params(rank: int, full: nn.Linear, mesh: DeviceMesh) -> list:
    """weight Shard(0) over the mesh, bias Replicate."""
    coord = mesh.get_coordinate()[0]
    w = full.weight.detach().chunk(2, dim=0)[coord].clone()
    return [
        ("weight", nn.Parameter(DTensor.from_local(w, mesh, [Shard(0)], run_check=False))),
        ("bias", nn.Parameter(DTensor.from_local(full.bias.detach().clone(), mesh, [Replicate()],
                                                 run_check=False))),
    ]


def _rank_dtensor(rank: int, world_size: int, ckpt: str) -> dict:
    meshes = {"A": DeviceMesh("cpu", [0, 1]), "B": DeviceMesh("cpu", [2, 3])}  # every rank
    full = _full_modules()
    mine = "A" if rank < 2 else "B"
    group = meshes[mine].get_group()
    # A: FSDP-like (sharded over its dp group); B: tensor parallel (sharded over mp).
    pg = ProcessGroupCollection(dp=group) if rank < 2 else ProcessGroupCollection(mp=group)

    def build(params: list) -> MimoOptimizer:
        infos = {"A": ModuleOptimizerInfo(), "B": ModuleOptimizerInfo()}
        infos[mine] = ModuleOptimizerInfo(
            optimizer=torch.optim.AdamW([p for _, p in params], **ADAM),
            pg_collection=pg, is_active=True, params=params,
        )
        return MimoOptimizer(infos, OptimizerConfig(clip_grad=1.0))

    def set_grads(params: list, step: int) -> None:
        _set_grads(full, step)
        for (_, p), (_, q) in zip(full[mine].named_parameters(), params, strict=True):
            local = p.grad if q.placements[0].is_replicate() else p.grad.chunk(2, dim=0)[
                meshes[mine].get_coordinate()[0]]
            q.grad = DTensor.from_local(local.clone(), meshes[mine], q.placements, run_check=False)

    params = _dtensor_params(rank, full[mine], meshes[mine])
    opt = build(params)
    set_grads(params, 0)
    ref_norm = nn.utils.clip_grad_norm_(_all_params(full), 1.0).item()
    ref_zeros = sum(int((p.grad == 0).sum()) for p in _all_params(full))
    first = opt.step()
    dcp.save(opt.sharded_state_dict(), checkpoint_id=ckpt)
    params2 = [(n, nn.Parameter(DTensor.from_local(p.to_local().clone(), p.device_mesh,
                                                    p.placements, run_check=False)))
               for n, p in params]
    opt2 = build(params2)
    sd2 = opt2.sharded_state_dict(is_loading=True)
    dcp.load(sd2, checkpoint_id=ckpt)
    opt2.load_state_dict(sd2)
    set_grads(params, 1)
    set_grads(params2, 1)
    second, second2 = opt.step(), opt2.step()
    diff = max((p.to_local() - q.to_local()).abs().max().item()
               for (_, p), (_, q) in zip(params, params2, strict=True))
    return {"first": first, "ref": (ref_norm, ref_zeros), "second": (second, second2),
            "diff": diff}


def test_multirank_dtensor_norm_and_dcp_round_trip(tmp_path: Path) -> None:
    results = run_ranks(4, _rank_dtensor, str(tmp_path / "ckpt"), timeout_s=120)
    firsts = [r["first"] for r in results]
    assert all(f == firsts[0] for f in firsts)
    success, norm, zeros = firsts[0]
    ref_norm, ref_zeros = results[0]["ref"]
    assert success and norm == pytest.approx(ref_norm, rel=1e-6) and zeros == ref_zeros
    for r in results:
        assert r["second"][0] == r["second"][1]
        assert r["diff"] == 0.0  # resumed optimizer state is exact


# ---- the real model and engine ------------------------------------------------------------

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
ENGINE = [
    "modules.vision.hidden_size=32", "modules.vision.num_layers=1",
    "modules.audio.hidden_size=32", "modules.language.hidden_size=64",
    "train.global_batch_size=16", "train.micro_batch_size=8",
    "optimizer.lr=3e-3", "optimizer.clip_grad=0.5", "optimizer.weight_decay=0.05",
    "scheduler.warmup_iters=2", "eval.interval=1000",
]


def test_norms_and_biases_get_no_weight_decay_by_default() -> None:
    cfg = load_config(DIGITS, ENGINE)
    tok = CharTokenizer()
    holders = {n: tok.placeholder_id(cfg.modules[n].modality) for n in cfg.encoder_names}
    opt = get_mimo_optimizer(build_mimo_model(cfg, tok.vocab_size, holders), cfg)
    seen = 0
    for name, info in opt.module_infos.items():
        names = {id(p): n for n, p in info.params}
        for group in info.optimizer.param_groups:
            for p in group["params"]:
                n = names[id(p)]
                no_decay = "norm" in n or "bias" in n
                assert group["weight_decay"] == (0.0 if no_decay else 0.05), (name, n)
                seen += no_decay
    assert seen > 10  # RMSNorm weights and projector/conv biases of every module


def _engine_round_trip(rank: int, world: int) -> dict:
    overrides = ENGINE + [f"modules.{m}.parallel.{k}={v}" for m in ("vision", "audio", "language")
                          for k, v in (("data", 2), ("rank_offset", 0))]
    overrides.append("modules.language.parallel.shard_optimizer=true")  # both paths at once
    cfg = load_config(DIGITS, overrides)

    def step(run) -> tuple:  # noqa: ANN001 - MimoRun
        loss, skipped, grad_norm, zeros = train_step_mimo(
            default_forward_step, run.train_data_iterator, run.model, run.optimizer,
            run.schedulers, run.global_state, run.communicator, infra=run.infra)
        return loss["loss"], skipped, grad_norm, zeros

    a = setup_mimo(cfg, init_runtime())
    assert a.optimizer.module_infos["language"].zero is not None
    for _ in range(3):
        step(a)
    saved = copy.deepcopy({  # as if written to disk and read back
        "model": a.model.state_dict(), "optimizer": a.optimizer.state_dict(),
        "schedulers": schedulers_state_dict(a.schedulers)})
    original = [step(a) for _ in range(2)]
    b = setup_mimo(cfg, init_runtime())
    b.model.load_state_dict(saved["model"])
    b.optimizer.load_state_dict(saved["optimizer"])
    b.optimizer.reload_model_params()
    assert load_schedulers_state_dict(b.schedulers, saved["schedulers"]) == []
    for _ in range(3):  # the checkpoint's data position
        next(b.train_data_iterator)
    resumed = [step(b) for _ in range(2)]
    return {"original": original, "resumed": resumed}


def test_engine_state_dict_round_trip_gives_identical_next_steps() -> None:
    for r in run_ranks(2, _engine_round_trip, timeout_s=240):
        assert r["resumed"] == r["original"]


def _rank_tp_duplicate(rank: int, world: int) -> tuple:
    group = dist.new_group([0, 1])
    mesh = DeviceMesh.from_group(group, "cpu")
    # As parallel.tensor_parallel leaves them: weight rows a DTensor sharded over "tp",
    # the bias a plain tensor, whole on both ranks.
    full = _full_modules()["B"]
    weight = nn.Parameter(distribute_tensor(full.weight.detach(), mesh, [Shard(0)]))
    bias = nn.Parameter(full.bias.detach().clone())
    _set_grads({"B": full}, 0)
    weight.grad = distribute_tensor(full.weight.grad, mesh, [Shard(0)])
    bias.grad = full.bias.grad.clone()
    info = ModuleOptimizerInfo(
        optimizer=torch.optim.AdamW([weight, bias], **ADAM), is_active=True,
        pg_collection=ProcessGroupCollection(tp=group, mp=group),
        params=[("weight", weight), ("bias", bias)])
    opt = MimoOptimizer({"B": info}, OptimizerConfig(clip_grad=0.0))
    zeros = sum(int((p.grad == 0).sum()) for p in full.parameters())
    return opt.get_grad_norm(), opt.count_zeros(), full.weight.grad.norm().item(), \
        full.bias.grad.norm().item(), zeros


def test_tensor_parallel_duplicates_count_once_in_the_norm() -> None:
    for norm, zeros, w_norm, b_norm, ref_zeros in run_ranks(2, _rank_tp_duplicate):
        assert norm == pytest.approx((w_norm**2 + b_norm**2) ** 0.5, rel=1e-6)
        assert zeros == ref_zeros
