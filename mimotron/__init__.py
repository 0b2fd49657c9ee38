"""mimotron: training for multi-module models with heterogeneous parallelism.

Every name of the public API (docs/design.md, "Public API") is importable from here.
They are loaded on first use, so ``import mimotron`` (and the CLI's start-up) stays
cheap.
"""

from __future__ import annotations

from mimotron.lazy import lazy_getattr

__version__ = "0.1.0"

# Public name -> defining module. A constant table, read only.
_EXPORTS = {
    "MimoConfig": "mimotron.config",
    "OptimizerConfig": "mimotron.config",
    "load_config": "mimotron.config",
    "HyperCommGrid": "mimotron.parallel.grid",
    "ProcessGroupCollection": "mimotron.parallel.groups",
    "MultiModuleProcessGroupCollection": "mimotron.parallel.groups",
    "zero_grad_buffer_for_multimodule": "mimotron.training.megatron_compat",
    "MimoModel": "mimotron.models.mimo",
    "MultiModulePipelineCommunicator": "mimotron.pipeline.communicator",
    "forward_backward_no_pipelining": "mimotron.training.megatron_compat",
    "forward_backward_pipelining_without_interleaving": "mimotron.training.megatron_compat",
    "MimoOptimizer": "mimotron.optim.mimo_optimizer",
    "ModuleOptimizerInfo": "mimotron.optim.mimo_optimizer",
    "get_mimo_optimizer": "mimotron.optim",
    "OptimizerParamScheduler": "mimotron.optim.scheduler",
    "save_checkpoint": "mimotron.checkpoint",
    "load_checkpoint": "mimotron.checkpoint",
    "train_step_mimo": "mimotron.training.megatron_compat",
    "train_mimo": "mimotron.training.megatron_compat",
    "setup_mimo": "mimotron.training.loop",
    "MimoModelInfra": "mimotron.training.infra",
    "GlobalState": "mimotron.training.state",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
