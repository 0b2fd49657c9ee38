"""``mimotron export CHECKPOINT OUT_DIR``: full model as safetensors per module + config.

Runs in this one process, without ``torch.distributed``. Exit code 0 on success, 2 when
the path is not a checkpoint, 1 when the checkpoint is incomplete or damaged.
"""

from __future__ import annotations

import sys


def run_export(checkpoint: str, out_dir: str) -> int:
    """Export ``checkpoint`` (a root holding ``latest`` or an ``iter_NNNNNNN`` dir)."""
    from mimotron.checkpoint import CheckpointError, export_checkpoint

    try:
        written = export_checkpoint(checkpoint, out_dir)
    except ValueError as exc:
        print(f"mimotron export: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"mimotron export: {exc}", file=sys.stderr)
        return 1
    for module, path in written.items():
        print(f"{module}: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    print(f"config: {out_dir}/config.json")
    return 0
