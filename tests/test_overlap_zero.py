"""Overlapped ZeRO-1 collectives change no bit.

With ``train.overlap_grad_reduce`` a ZeRO-1 module's reduce-scatter buckets launch
during the last backward; with ``train.overlap_param_gather`` its parameter all-gather
is only launched after the optimizer step and lands in the next forward's pre-hooks.
Each case trains 10 fp32 iterations through the real engine twice on the same forked
gloo ranks, both overlaps off then on, and asserts bitwise-equal losses, grad norms,
the reduce-scattered gradient rows every optimizer steps, and final weights. The
non-overlapped path is the one ``tests/test_parity.py`` and
``tests/test_sharded_optimizer.py`` compare with the plain PyTorch loop, so equality
here carries that parity over.

Evidence that the overlap happened: some reduce-scatter bucket launched from a gradient
hook, after every step a parameter gather was still in flight, and the next forward's
pre-hooks (not the optimizer's safety net) landed it.

The resume case saves a checkpoint right after a step, with the gather still in flight,
trains on, and then resumes from it in a fresh run: the resumed steps and weights equal
the uninterrupted ones bit for bit. Reading the weights through ``state_dict`` lands a
pending gather first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mimotron.checkpoint import save_checkpoint
from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.optim.mimo_optimizer import MimoOptimizer
from mimotron.parallel.grad_sync import GradSync
from mimotron.parallel.zero import ZeroShards
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from tests import common
from tests.common import BASE, DIGITS, coloc, colocated, engine_run, noncolocated, par, train_step
from tests.moe import MOE_NO_AUX
from tests.parity import TINY_BUCKETS, assert_bitwise_equal, world_size

NUM_ITERS = 10
OVERLAP = ["train.overlap_grad_reduce=true", "train.overlap_param_gather=true"]
ALL = ("vision", "audio", "language")


def zero(*modules: str) -> list[str]:
    return [o for m in modules for o in par(m, shard_optimizer="true")]


CASES: dict[str, list[str]] = {
    "zero-coloc-dp2": colocated(2) + zero(*ALL),
    # The language model (TP: no ZeRO) overlaps its DTensor all-reduces, the encoders
    # their reduce-scatters, on the same ranks.
    "zero-encoders-dp4-language-tp2dp2": coloc({"data": 4}, {"data": 4},
                                               {"tensor": 2, "data": 2})
    + zero("vision", "audio") + ["train.grad_bucket_mb=0.1"],  # fewer TP collectives
    "zero-language-pp2dp2": noncolocated({}, {}, {"pipeline": 2, "data": 2})
    + zero("language") + ["train.micro_batch_size=4"],
    # Expert-parallel ZeRO-1: dense rows over dp (4), expert rows over expt_dp (2).
    "zero-moe-ep2-dp4": colocated(4) + MOE_NO_AUX + par("language", expert=2) + zero(*ALL),
}


# The unpatched methods (each side patches them anew, in its forked rank only).
REDUCE_GRADS, FINISH = ZeroShards.reduce_grads, GradSync.finish


def _record(rank_log: dict[str, list], optimizer: MimoOptimizer) -> None:
    """Patch this forked rank to log reduced fragment rows and where gathers landed."""
    reduce_grads, finish = REDUCE_GRADS, FINISH
    safety_net = optimizer.finish_param_gather

    def logged_reduce(self: ZeroShards) -> None:
        reduce_grads(self)
        rank_log["rows"].append([f.grad.clone() for _, f in self.fragments])

    def logged_finish(self: GradSync) -> None:
        rank_log["early"].append(self.num_launched_early)
        finish(self)

    def logged_safety_net() -> None:
        infos = optimizer.module_infos.values()
        rank_log["late_gathers"].append(sum(i.zero is not None and i.zero.gather_pending
                                             for i in infos))
        safety_net()

    ZeroShards.reduce_grads = logged_reduce
    GradSync.finish = logged_finish
    optimizer.finish_param_gather = logged_safety_net


def _pending(run: Any) -> int:
    return sum(i.zero is not None and i.zero.gather_pending
               for i in run.optimizer.module_infos.values())


def _on_off(rank: int, world: int, overrides: list[str], num_iters: int) -> dict:
    """The engine with both overlaps off, then on, in this rank, with the logs."""
    logs: dict[str, dict[str, list]] = {}
    sides = {}
    for name, extra in (("off", []), ("on", OVERLAP)):
        log = logs[name] = {"rows": [], "early": [], "late_gathers": [], "pending": []}
        def patched(cfg: Any, runtime: Any, log: dict = log) -> Any:
            run = setup_mimo(cfg, runtime)
            _record(log, run.optimizer)
            step = run.optimizer.step_with_ready_grads

            def step_then_look() -> bool:
                ok = step()
                log["pending"].append(_pending(run))
                return ok

            run.optimizer.step_with_ready_grads = step_then_look
            return run

        common.setup_mimo = patched  # this forked rank only
        sides[name] = engine_run(rank, world, overrides + extra, num_iters)
    return {"sides": sides, "logs": logs}


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_zero_is_bitwise_equal(name):
    overrides = [f"train.iters={NUM_ITERS}", *TINY_BUCKETS, *CASES[name]]
    results = run_ranks(world_size(overrides), _on_off, overrides, NUM_ITERS, timeout_s=300)
    for rank, res in enumerate(results):
        off, on = res["sides"]["off"], res["sides"]["on"]
        assert_bitwise_equal(off, on, rank)
        rows_off, rows_on = res["logs"]["off"]["rows"], res["logs"]["on"]["rows"]
        assert len(rows_on) == len(rows_off)
        for a, b in zip(rows_off, rows_on, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), \
                f"rank {rank}: reduce-scattered rows differ"
        log = res["logs"]["on"]
        if rows_on:  # a rank holding a ZeRO-1 module
            assert all(n > 0 for n in log["pending"]), f"rank {rank}: a gather landed early"
            # The safety net before each optimizer step finds nothing left; only the
            # engine run's read of the final weights lands the last step's gather.
            *steps, final = log["late_gathers"]
            assert not any(steps) and final > 0, f"rank {rank}: {log['late_gathers']}"
    assert sum(n for res in results for n in res["logs"]["on"]["early"]) > 0


def _resume(rank: int, world: int, overrides: list[str], root: str) -> dict:
    """Save after step 5 with the gather in flight, train on, resume from the save."""
    cfg = load_config(DIGITS, BASE + overrides + OVERLAP)
    run = setup_mimo(cfg, init_runtime())
    ts = run.global_state.train_state
    losses = []

    def steps(run: Any, num: int) -> None:
        for _ in range(num):
            loss, _, norm, _ = train_step(run)
            losses.append((loss["loss"], norm))
            run.global_state.train_state.iteration += 1
            run.global_state.train_state.consumed_samples += cfg.train.global_batch_size

    steps(run, 5)
    pending_at_save = _pending(run)
    save_checkpoint(root, run.model, run.optimizer, run.schedulers, run.global_state, run.infra)
    steps(run, 5)
    pending_before_read = _pending(run)
    straight = {k: v.clone() for k, v in run.model.state_dict().items()}  # lands the gather
    pending_after_read = _pending(run)
    assert ts.iteration == 10
    resumed = setup_mimo(load_config(DIGITS, BASE + overrides + OVERLAP + [
        f"checkpoint.dir={root}", "checkpoint.load=auto"]), init_runtime())
    first = len(losses)
    steps(resumed, 5)
    weights_equal = all(torch.equal(v, straight[k]) for k, v in resumed.model.state_dict().items())
    return {"pending_at_save": pending_at_save, "straight": losses[5:first],
            "state_dict_landed": pending_before_read > 0 and pending_after_read == 0,
            "resumed": losses[first:], "weights_equal": weights_equal,
            "iteration": resumed.global_state.train_state.iteration}


def test_resume_from_a_save_with_a_gather_in_flight(tmp_path):
    overrides = ["train.iters=10", *colocated(2), *zero(*ALL), *TINY_BUCKETS]
    for rank, res in enumerate(run_ranks(2, _resume, overrides, str(tmp_path), timeout_s=300)):
        assert res["pending_at_save"] > 0, f"rank {rank}: nothing was in flight at the save"
        assert res["iteration"] == 10
        assert res["resumed"] == res["straight"], f"rank {rank}: resumed steps differ"
        assert res["weights_equal"], f"rank {rank}: resumed weights differ"
        assert res["state_dict_landed"], f"rank {rank}: state_dict did not land the gather"
