"""The run's configuration: one TOML file and ``key=value`` overrides, checked before
any rank starts.

The package holds one concern per module:

* :mod:`~mimotron.config.schema`: the dataclasses with a docstring per field, the choice
  types and the tuples derived from them (pure: imports nothing of mimotron but ``names``);
* :mod:`~mimotron.config.load`: TOML and overrides into the schema (``load_config``, the
  one entry point ``mimotron train`` and ``mimotron plan`` both call);
* :mod:`~mimotron.config.validation`: every single-field and cross-field rule
  (``validate_config``), with :mod:`~mimotron.config.numbers` (finite, in-range numbers),
  :mod:`~mimotron.config.paths` (run folders and names) and :mod:`~mimotron.config.limits`
  (sizes, timeouts, local ranks);
* :mod:`~mimotron.config.setup_rules`: the rules the rank set-up relies on, checked from
  the config at layout time;
* :mod:`~mimotron.config.docs`: docs/configuration.md's table from the field docstrings.

The names below are exported lazily, so ``from mimotron.config import MimoConfig`` loads
the schema only, never the checks.
"""

from mimotron.lazy import lazy_getattr

_EXPORTS = {
    "CheckpointConfig": "mimotron.config.schema",
    "DATASETS": "mimotron.config.schema",
    "DECAY_STYLES": "mimotron.config.schema",
    "DataConfig": "mimotron.config.schema",
    "DatasetName": "mimotron.config.schema",
    "DecayStyle": "mimotron.config.schema",
    "ENCODER_KINDS": "mimotron.config.schema",
    "EncoderKind": "mimotron.config.schema",
    "EvalConfig": "mimotron.config.schema",
    "FREEZE_PARTS": "mimotron.config.schema",
    "HF_ONLY_KEYS": "mimotron.config.validation",
    "LANGUAGE_KINDS": "mimotron.config.schema",
    "LanguageKind": "mimotron.config.schema",
    "LogConfig": "mimotron.config.schema",
    "MODULE_KINDS": "mimotron.config.schema",
    "MimoConfig": "mimotron.config.schema",
    "ModuleConfig": "mimotron.config.schema",
    "ModuleKind": "mimotron.config.schema",
    "OPTIMIZERS": "mimotron.config.schema",
    "OptimizerConfig": "mimotron.config.schema",
    "OptimizerName": "mimotron.config.schema",
    "PRECISIONS": "mimotron.config.schema",
    "ParallelConfig": "mimotron.config.schema",
    "Precision": "mimotron.config.schema",
    "ProfileConfig": "mimotron.config.schema",
    "RECOMPUTE_MODES": "mimotron.config.schema",
    "SCHEDULES": "mimotron.config.schema",
    "Schedule": "mimotron.config.schema",
    "SchedulerConfig": "mimotron.config.schema",
    "TOY_AUDIO_RATE": "mimotron.config.validation",
    "TrainConfig": "mimotron.config.schema",
    "WEIGHT_DECAY_STYLES": "mimotron.config.schema",
    "WeightDecayStyle": "mimotron.config.schema",
    "apply_override": "mimotron.config.load",
    "config_from_dict": "mimotron.config.load",
    "load_config": "mimotron.config.load",
    "parse_override": "mimotron.config.load",
    "validate_config": "mimotron.config.validation",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_getattr(__name__, _EXPORTS)
