"""Distributed checkpoints on ``torch.distributed.checkpoint`` (DCP).

Layout-independent keys, so a checkpoint written by one TP/PP/DP split and placement
loads into any other; synchronous or background saves; ``latest`` moved only after every
rank finished; SHA-256 manifests so damage is found and named; SIGTERM-safe stopping;
export to safetensors. See :mod:`~mimotron.checkpoint.state` for what is stored.

The names below are loaded on first use: the launcher of ``mimotron train`` reads
``files`` and ``signals`` (plain files and signal handlers) and must not pay for
importing DCP, DTensor and the models (seconds per launch) to do so.
"""

from __future__ import annotations

from mimotron.lazy import lazy_getattr

# Public name -> defining module. A constant table, read only.
_EXPORTS = {
    "CheckpointError": "mimotron.checkpoint.files",
    "CheckpointManager": "mimotron.checkpoint.manager",
    "SafeLoadPlanner": "mimotron.checkpoint.load",
    "SaveHandle": "mimotron.checkpoint.save",
    "StopSignals": "mimotron.checkpoint.signals",
    "export_checkpoint": "mimotron.checkpoint.export",
    "iter_dir": "mimotron.checkpoint.files",
    "load_checkpoint": "mimotron.checkpoint.load",
    "load_exported": "mimotron.checkpoint.export",
    "maybe_load_checkpoint": "mimotron.checkpoint.pretrained",
    "read_full_model": "mimotron.checkpoint.export",
    "read_latest": "mimotron.checkpoint.files",
    "resolve_load": "mimotron.checkpoint.files",
    "save_checkpoint": "mimotron.checkpoint.save",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
