"""Every public name of docs/design.md ("Public API") is importable from the top-level package."""

from __future__ import annotations

import importlib

import pytest

import mimotron

CONTRACT = [
    "MimoConfig", "HyperCommGrid", "ProcessGroupCollection",
    "MultiModuleProcessGroupCollection", "MimoModel", "zero_grad_buffer_for_multimodule",
    "MultiModulePipelineCommunicator", "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving", "MimoOptimizer",
    "ModuleOptimizerInfo", "get_mimo_optimizer", "OptimizerConfig", "OptimizerParamScheduler",
    "save_checkpoint", "load_checkpoint", "train_step_mimo", "train_mimo", "MimoModelInfra",
    "GlobalState",
]


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_name_importable(name):
    obj = getattr(mimotron, name)
    assert callable(obj)
    assert name in mimotron.__all__


def test_mimo_optimizer_method_set():
    methods = ["prepare_grads", "get_grad_norm", "step", "step_with_ready_grads", "zero_grad",
               "prepare_model_params_for_param_sync", "get_loss_scale", "count_zeros",
               "state_dict", "load_state_dict", "sharded_state_dict", "reload_model_params"]
    cls = mimotron.MimoOptimizer
    assert all(callable(getattr(cls, m)) for m in methods)
    assert isinstance(cls.param_groups, property)


def test_unknown_name():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        importlib.import_module("mimotron").nope  # noqa: B018
