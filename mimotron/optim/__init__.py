"""Per-module optimizers with a global view, loss scaling, and per-module LR schedules."""

from mimotron.config.schema import OptimizerConfig
from mimotron.optim.build import (
    build_schedulers,
    build_torch_optimizer,
    get_mimo_optimizer,
)
from mimotron.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from mimotron.optim.mimo_optimizer import MimoOptimizer, ModuleOptimizerInfo
from mimotron.optim.scheduler import (
    OptimizerParamScheduler,
    load_schedulers_state_dict,
    schedulers_state_dict,
)

__all__ = [
    "ConstantLossScaler",
    "DynamicLossScaler",
    "LossScaler",
    "MimoOptimizer",
    "ModuleOptimizerInfo",
    "OptimizerConfig",
    "OptimizerParamScheduler",
    "build_schedulers",
    "build_torch_optimizer",
    "get_mimo_optimizer",
    "load_schedulers_state_dict",
    "schedulers_state_dict",
]
