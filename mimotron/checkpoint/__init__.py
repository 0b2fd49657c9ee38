"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP).

Layout-independent keys, so a checkpoint written by one TP/PP/DP split and placement
loads into any other; synchronous or background saves; ``latest`` moved only after every
rank finished; SHA-256 manifests so damage is found and named; SIGTERM-safe stopping;
export to safetensors. See :mod:`~mimotron.checkpoint.state` for what is stored.
"""

from mimotron.checkpoint.export import export_checkpoint, load_exported, read_full_model
from mimotron.checkpoint.files import CheckpointError, iter_dir, read_latest, resolve_load
from mimotron.checkpoint.load import SafeLoadPlanner, load_checkpoint, maybe_load_checkpoint
from mimotron.checkpoint.manager import CheckpointManager
from mimotron.checkpoint.save import SaveHandle, save_checkpoint
from mimotron.checkpoint.signals import StopSignals

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "SafeLoadPlanner",
    "SaveHandle",
    "StopSignals",
    "export_checkpoint",
    "iter_dir",
    "load_checkpoint",
    "load_exported",
    "maybe_load_checkpoint",
    "read_full_model",
    "read_latest",
    "resolve_load",
    "save_checkpoint",
]
