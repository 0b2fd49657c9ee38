"""``train_mimo`` and ``train_step_mimo`` take Megatron-Bridge's arguments.

The parameter lists below are copied from Bridge's API reference
(``megatron.bridge.training.train_mimo``); a tiny one-rank run calls ``train_mimo`` the
way Bridge's callers do, with every argument by keyword, including the optional process
group collection and ``(module, grid)`` pairs, and checks that contradicting the infra
raises a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.parallel.grid import HyperCommGrid
from mimotron.parallel.groups import MultiModuleProcessGroupCollection
from mimotron.runtime import init_runtime
from mimotron.training.loop import setup_mimo
from mimotron.training.megatron_compat import train_mimo, train_step_mimo
from mimotron.training.step import default_forward_step, module_parts
from tests.common import ONE_RANK, SMALL_MODEL

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
BRIDGE_TRAIN_MIMO = [
    "forward_step_func", "model", "optimizer", "schedulers", "train_data_iterator",
    "valid_data_iterator", "global_state", "mimo_infra", "multimodule_communicator",
    "multimodule_pg_collection", "module_to_grid_tuple",
]
BRIDGE_OPTIONAL = ["multimodule_pg_collection", "module_to_grid_tuple"]
BRIDGE_TRAIN_STEP_MIMO = [
    "forward_step_func", "data_iterator", "model", "optimizer", "schedulers",
    "global_state", "multimodule_communicator", "multimodule_pg_collection", "infra",
    "module_to_grid_tuple", "num_microbatches", "seq_length", "micro_batch_size",
]


def test_train_mimo_has_bridges_parameters_in_bridges_order():
    params = inspect.signature(train_mimo).parameters
    assert list(params) == BRIDGE_TRAIN_MIMO
    for name, p in params.items():
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
        assert (p.default is None) == (name in BRIDGE_OPTIONAL), name


def test_train_step_mimo_has_bridges_parameters_in_bridges_order():
    params = inspect.signature(train_step_mimo).parameters
    assert list(params) == BRIDGE_TRAIN_STEP_MIMO
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())


def _errors(run, pairs) -> dict[str, str]:
    """The ValueError message of each contradicting call (all raise before any collective)."""
    lm_only = MultiModuleProcessGroupCollection(
        {"language": run.infra.multimodule_pg_collection["language"]})
    vision = module_parts(run.model)["vision"]
    elsewhere = HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "dp", "pp"], rank_offset=3)
    calls = {
        "pg_modules": lambda: _bridge_call(run, multimodule_pg_collection=lm_only),
        "missing_module": lambda: _bridge_call(run, module_to_grid_tuple=pairs[:-1]),
        "wrong_grid": lambda: _bridge_call(
            run, module_to_grid_tuple=[(vision, elsewhere), *pairs[1:]]),
        "old_order": lambda: train_step_mimo(
            default_forward_step, run.train_data_iterator, run.model, run.optimizer,
            run.schedulers, run.global_state, run.communicator, run.infra),
        "geometry": lambda: train_step_mimo(
            default_forward_step, run.train_data_iterator, run.model, run.optimizer,
            run.schedulers, run.global_state, run.communicator, infra=run.infra,
            seq_length=run.global_state.cfg.data.seq_length + 1),
    }
    out = {}
    for key, call in calls.items():
        try:
            call()
        except ValueError as exc:
            out[key] = str(exc)
    return out


def _bridge_call(run, **optional):
    return train_mimo(
        forward_step_func=default_forward_step, model=run.model, optimizer=run.optimizer,
        schedulers=run.schedulers, train_data_iterator=run.train_data_iterator,
        valid_data_iterator=run.valid_data_iterator, global_state=run.global_state,
        mimo_infra=run.infra, multimodule_communicator=run.communicator, **optional)


def _rank(rank: int, world: int, overrides: list[str]) -> dict:
    cfg = load_config(DIGITS, [*SMALL_MODEL, *ONE_RANK, "eval.iters=1", *overrides])
    run = setup_mimo(cfg, init_runtime())
    # Built as Bridge builds them: a fresh collection, and (module part, grid) pairs.
    pgs = MultiModuleProcessGroupCollection(dict(run.infra.multimodule_pg_collection.items()))
    pairs = [(part, run.infra.grids[name]) for name, part in module_parts(run.model).items()]
    errors = _errors(run, pairs)
    summary = _bridge_call(run, multimodule_pg_collection=pgs, module_to_grid_tuple=pairs)
    return {"summary": summary, "errors": errors}


def test_train_mimo_called_with_bridges_keyword_arguments(tmp_path):
    (out,) = run_ranks(1, _rank, [f"log.dir={tmp_path}", "train.iters=2", "log.interval=1"],
                       timeout_s=180)
    assert out["summary"]["iteration"] == 2 and out["summary"]["eval"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines if "loss" in r] == [1, 2]
    errors = out["errors"]
    assert set(errors) == {"pg_modules", "missing_module", "wrong_grid", "old_order",
                           "geometry"}
    assert errors["pg_modules"].startswith("multimodule_pg_collection holds modules "
                                           "['language']")
    assert errors["missing_module"].startswith(  # pairs[:-1] leaves out the language model.
        "module_to_grid_tuple covers modules ['audio', 'vision'] but this rank (rank 0) "
        "holds ['audio', 'language', 'vision']")
    assert errors["wrong_grid"].startswith("module_to_grid_tuple gives module 'vision'")
    assert "pass infra=" in errors["old_order"]
    assert errors["geometry"].startswith("seq_length=")
    assert "data.seq_length" in errors["geometry"]


@pytest.mark.parametrize("name", BRIDGE_OPTIONAL)
def test_optional_arguments_are_documented(name):
    assert name in (train_mimo.__doc__ or "")
