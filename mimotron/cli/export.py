"""``mimotron export CHECKPOINT OUT_DIR``: full model as safetensors per module + config.

Runs in this one process, without ``torch.distributed``. The output folder is checked
first, before the checkpoint is read. Exit code 0 on success; 2 when the path is not a
checkpoint or the output folder cannot be written; 1 when the checkpoint is incomplete,
damaged or refused (a crafted ``.metadata``), or writing fails. Every failure is one
line (with the traceback first when ``MIMOTRON_DEBUG=1``).
"""

from __future__ import annotations

from pathlib import Path

from mimotron.outputs import EXIT_FAILED, EXIT_USAGE, report_error


def run_export(checkpoint: str, out_dir: str) -> int:
    """Export ``checkpoint`` (a root holding ``latest`` or an ``iter_NNNNNNN`` dir)."""
    from mimotron.checkpoint import CheckpointError, export_checkpoint

    try:
        written = export_checkpoint(checkpoint, out_dir)
    except ValueError as exc:
        return report_error("export", exc, EXIT_USAGE, show_type=False)
    except CheckpointError as exc:
        return report_error("export", exc, EXIT_FAILED, show_type=False)
    except Exception as exc:  # noqa: BLE001 - CheckpointError, OSError, ...: one line
        return report_error("export", exc, EXIT_FAILED)
    for module, path in written.items():
        print(f"{module}: {path} ({path.stat().st_size / 1e6:.2f} MB)")
    print(f"config: {Path(out_dir) / 'config.json'}")
    return 0
