"""``mimotron export [--format mimotron|hf|hf-llava|peft] CHECKPOINT OUT_DIR``: a model out.

``--format mimotron`` (the default): one safetensors file per module plus the run
config (:mod:`mimotron.checkpoint.export`). ``--format hf``: every module loaded from a
Hugging Face folder as a folder ``transformers`` loads, the others as with the default
(:mod:`mimotron.checkpoint.hf_export`); a run split from one vision-language folder
(top-level ``hf_path``) as one folder of that folder's class
(:mod:`mimotron.checkpoint.vlm_export`). ``--format hf-llava``: the vision tower, its
projector and the language model as one ``LlavaForConditionalGeneration`` folder with
its processor (:mod:`mimotron.checkpoint.llava_export`); ``--modules vision,language``
names the modules to keep when the run has others (an audio encoder). ``--format peft``:
a run's LoRA adapters as a PEFT adapter folder for its Hugging Face folder's model
(:mod:`mimotron.checkpoint.lora_export`); ``hf`` and ``hf-llava`` merge the adapters
into the weights they write.

Runs in this one process, without ``torch.distributed``. The output folder is checked
first, before any tensor is read: it must be new, empty or a previous export's own, and
no folder the run read (:mod:`mimotron.checkpoint.export_folder`). Exit code 0 on
success; 2 when the path is not a checkpoint, the output folder cannot be written or
is refused, or (``hf``) a folder the export needs is gone; 1 when the checkpoint is
incomplete, damaged or refused (a crafted ``.metadata``), or writing fails. Every
failure is one line (with the traceback first when ``MIMOTRON_DEBUG=1``).
"""

from __future__ import annotations

from pathlib import Path

from mimotron.outputs import EXIT_FAILED, EXIT_USAGE, report_error

FORMATS = ("mimotron", "hf", "hf-llava", "peft")


def run_export(checkpoint: str, out_dir: str, format: str = "mimotron",  # noqa: A002
               modules: str | None = None) -> int:
    """Export ``checkpoint`` (a root holding ``latest`` or an ``iter_NNNNNNN`` dir).

    Args:
        checkpoint: the checkpoint path.
        out_dir: the output folder.
        format: one of :data:`FORMATS`.
        modules: ``hf-llava`` only: comma-separated modules to export (``None``: all).

    Returns:
        The process exit code.
    """
    from mimotron.checkpoint import CheckpointError, export_checkpoint
    from mimotron.checkpoint.llava_export import export_llava_checkpoint
    from mimotron.checkpoint.lora_export import export_peft
    from mimotron.checkpoint.vlm_export import export_hf

    try:
        if modules is not None and format != "hf-llava":
            raise ValueError(f"--modules applies to --format hf-llava only, not {format!r}")
        if format == "hf-llava":
            names = None if modules is None else [m.strip() for m in modules.split(",")]
            written = export_llava_checkpoint(checkpoint, out_dir, names)
        elif format == "hf":
            written = export_hf(checkpoint, out_dir)
        elif format == "peft":
            written = export_peft(checkpoint, out_dir)
        else:
            written = export_checkpoint(checkpoint, out_dir)
            written["config"] = Path(out_dir) / "config.json"
    except ValueError as exc:
        return report_error("export", exc, EXIT_USAGE, show_type=False)
    except CheckpointError as exc:
        return report_error("export", exc, EXIT_FAILED, show_type=False)
    except Exception as exc:  # noqa: BLE001 - CheckpointError, OSError, ...: one line
        return report_error("export", exc, EXIT_FAILED)
    for label, path in written.items():
        if path.name.endswith(".json"):
            print(f"{label}: {path}")
        else:
            print(f"{label}: {path} ({_size(path) / 1e6:.2f} MB)")
    return 0


def _size(path: Path) -> int:
    """Bytes of a file, or of the files in a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size
