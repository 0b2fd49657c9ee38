"""mimotron: training for multi-module models with heterogeneous parallelism."""

from mimotron.config import MimoConfig, load_config

__all__ = ["MimoConfig", "load_config"]
__version__ = "0.1.0"
