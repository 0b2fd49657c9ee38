"""The ``mimotron`` command: ``train``, ``plan``, ``plot``, ``export``, ``generate``.

Errors are one line each. ``mimotron --debug <command>`` (or ``MIMOTRON_DEBUG=1``) asks
for full tracebacks instead: the flag sets ``MIMOTRON_DEBUG=1`` in the environment, so
the ranks a launch starts inherit it. An exception no subcommand expected prints
``mimotron <command>: <Type>: <message>`` and exits 1, unless debugging is on.
"""

from __future__ import annotations

import argparse
import os
import sys

from mimotron.cli.generate import add_parser as add_generate_parser

DEBUG_ENV = "MIMOTRON_DEBUG"
EXIT_UNEXPECTED = 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mimotron", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true",
                   help=f"full tracebacks (sets {DEBUG_ENV}=1 for this command and its ranks)")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train a model (launches ranks as needed)"),
                        ("plan", "validate a config and print its rank map and memory estimate")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", help="TOML config file")
        s.add_argument("overrides", nargs="*", help="key=value overrides (dotted paths)")
        if name == "plan":
            s.add_argument("--dry-run", action="store_true",
                           help="also run training steps of the layout's ranks on a fake "
                                "accelerator (mimotron.dryrun): fails on any device mix")
            s.add_argument("--rank", type=int, action="append", default=None,
                           help="dry-run only this rank (repeatable; default: every rank)")
            s.add_argument("--device-memory", default=None, metavar="SIZE",
                           help="memory of one device (80GB, 80GiB, 81920MiB or bytes): "
                                "say per rank whether its estimate fits, with the headroom "
                                "(the exit status stays 0 when a rank does not fit)")
            s.add_argument("--nccl-buffer-mib", type=float, default=128.0, metavar="MIB",
                           help="device memory reserved per NCCL communicator a rank joins, "
                                "beside its estimate, in the --device-memory and --auto "
                                "checks (default 128: NCCL_BUFFSIZE 4 MiB x 2 ways x 16 "
                                "channels; docs/planner.md)")
            _add_auto_arguments(s)
    s = sub.add_parser("plot", help="PNG curves from one or more runs' metrics.jsonl")
    s.add_argument("run_dirs", nargs="+", help="run directories (each holding metrics.jsonl)")
    s.add_argument("--out", default=None, help="output directory (default: the first run dir)")
    s = sub.add_parser("export", help="full model of a checkpoint as safetensors per module, "
                                      "or as Hugging Face folders")
    s.add_argument("checkpoint", help="checkpoint dir holding 'latest', or an iter_NNNNNNN dir")
    s.add_argument("out_dir", help="output directory (mimotron: <module>.safetensors + "
                                   "config.json; hf: <module>/ per hf_path module)")
    s.add_argument("--format", choices=("mimotron", "hf", "hf-llava", "peft"),
                   default="mimotron",
                   help="mimotron (default): safetensors per module; hf: a folder per module "
                        "loaded from hf_path that transformers' from_pretrained loads, with "
                        "the original names, plus the tokenizer; hf-llava: one "
                        "LlavaForConditionalGeneration folder with its processor (both with "
                        "LoRA adapters merged in); peft: the LoRA adapters as a PEFT folder")
    s.add_argument("--modules", default=None, metavar="M1,M2",
                   help="hf-llava: the modules to export (e.g. vision,language), leaving "
                        "out the run's others (an audio encoder)")
    add_generate_parser(sub)
    return p


def _add_auto_arguments(s: argparse.ArgumentParser) -> None:
    """``plan --auto``'s options (docs/planner.md)."""
    s.add_argument("--auto", action="store_true",
                   help="search every module's layout on --world ranks and print the "
                        "fastest by a step-time model, the best as TOML (docs/planner.md)")
    s.add_argument("--world", type=int, default=None, help="--auto: ranks to plan for")
    s.add_argument("--top", type=int, default=5, help="--auto: candidates shown (default 5)")
    s.add_argument("--explain", action="store_true",
                   help="--auto: each candidate's step-time terms")
    s.add_argument("--device", default="h100",
                   help="--auto: device constants from the table (h100, h200, a100-80gb, "
                        "a100-40gb, cpu; default h100); --device-memory defaults to its size")
    s.add_argument("--device-table", default=None, metavar="FILE",
                   help="--auto: a TOML file of [devices.NAME] tables adding or overriding "
                        "devices")
    s.add_argument("--calibrate", action="store_true",
                   help="--auto: measure module times and collectives on this host "
                        "(device cpu), cached in the run directory")
    s.add_argument("--headroom", type=float, default=0.05,
                   help="--auto: fraction of device memory a layout leaves free for "
                        "allocator fragmentation and the estimate's error (default 0.05)")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    try:
        return _dispatch(args)
    except Exception as exc:  # noqa: BLE001 - one line unless asked for the traceback
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        message = " ".join(str(exc).split())  # One line, whatever the exception holds.
        print(f"mimotron {args.command}: {type(exc).__name__}: {message} (run with --debug "
              "for the traceback)", file=sys.stderr, flush=True)
        return EXIT_UNEXPECTED


def _dispatch(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; its exit code."""
    if args.command == "plan" and args.auto:
        from mimotron.cli.plan_auto import AutoOptions, run_plan_auto

        return run_plan_auto(args.config, args.overrides, AutoOptions(
            args.world, args.device, args.device_table, args.device_memory, args.top,
            args.explain, args.calibrate, args.headroom, args.nccl_buffer_mib))
    if args.command == "plan":
        from mimotron.cli.plan import run_plan

        return run_plan(args.config, args.overrides, dry_run=args.dry_run, ranks=args.rank,
                        device_memory=args.device_memory, nccl_buffer_mib=args.nccl_buffer_mib)
    if args.command == "train":
        from mimotron.cli.train import run_train

        return run_train(args.config, args.overrides)
    if args.command == "export":
        from mimotron.cli.export import run_export

        return run_export(args.checkpoint, args.out_dir, args.format, args.modules)
    if args.command == "generate":
        from mimotron.cli.generate import run_generate

        return run_generate(args)
    from mimotron.cli.plot import run_plot

    return run_plot(args.run_dirs, args.out)


if __name__ == "__main__":
    sys.exit(main())
