"""``mimotron plan --auto``: search the layouts of a config, print the fastest.

The config (with its overrides) is checked as ``mimotron plan`` checks it (the
validator, the run directory, the data), then :func:`mimotron.planner.search.search`
tries every module's layout on ``--world`` ranks of ``--device`` and
:func:`mimotron.planner.report.format_report` prints the top ``--top``; exit 0, or 2
with one line naming the problem (an option, the config, no layout that fits).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mimotron.checkpoint.files import CheckpointError
from mimotron.cli.device_fit import parse_device_memory
from mimotron.config.load import load_config
from mimotron.config.schema import MimoConfig
from mimotron.planner.cost import Calibration


@dataclass(frozen=True)
class AutoOptions:
    """The command line of ``plan --auto``."""

    world: int | None
    device: str = "h100"
    device_table: str | None = None
    device_memory: str | None = None
    top: int = 5
    explain: bool = False
    calibrate: bool = False
    headroom: float = 0.05
    """Fraction of the device memory kept free (allocator fragmentation, the estimate's
    own error): layouts must fit in the rest."""
    nccl_buffer_mib: float = 128.0
    """Device memory reserved per NCCL communicator a rank joins (``--nccl-buffer-mib``)."""


def _fail(kind: str, message: str) -> int:
    print(f"mimotron plan --auto: {kind}: {message}", file=sys.stderr)
    return 2


def run_plan_auto(config: str, overrides: list[str], options: AutoOptions) -> int:
    """Print the best layouts of ``config`` on ``options.world`` ranks; 0, or 2.

    Args:
        config: the TOML config.
        overrides: ``key=value`` overrides applied before the search (the search's
            own come after them).
        options: the world, the device and what to print.
    """
    from mimotron.planner.devices import device_table
    from mimotron.planner.report import format_report
    from mimotron.planner.search import MAX_WORLD, SearchRequest, search
    from mimotron.planner.simulate import SimulationError

    try:
        if options.world is None or not 1 <= options.world <= MAX_WORLD:
            raise ValueError(f"--world={options.world} is invalid: --auto needs the number "
                             f"of ranks, 1 to {MAX_WORLD:,}, e.g. --world 8")
        if not options.nccl_buffer_mib >= 0.0:
            return _fail("invalid option", f"--nccl-buffer-mib={options.nccl_buffer_mib} is "
                         "invalid: expected a number of MiB >= 0")
        if not 0.0 <= options.headroom < 1.0:
            raise ValueError(f"--headroom={options.headroom} is invalid: expected a fraction "
                             "of the device memory in [0, 1), e.g. 0.05")
        if options.top < 1:
            raise ValueError(f"--top={options.top} is invalid: expected >= 1")
        table = device_table(options.device_table)
        if options.device not in table:
            raise ValueError(f"--device={options.device!r} is invalid: expected one of "
                             f"{', '.join(sorted(table))} (or add it with --device-table)")
        device = table[options.device]
        _check_calibrate(options)
        limit = (device.memory_bytes if options.device_memory is None
                 else parse_device_memory(options.device_memory))
    except ValueError as exc:
        return _fail("invalid option", str(exc))
    try:
        cfg = load_config(config, overrides)
        from mimotron.data.run_data import check_data
        from mimotron.run_dir import describe_run_dir

        describe_run_dir(cfg)  # checkpoint.load checked as train checks it
        check_data(cfg)  # the tokenizer and (llava) every sample, as plan and train
    except (ValueError, CheckpointError) as exc:
        return _fail("invalid config", str(exc))
    try:
        calibration, note = _calibration(cfg, options)
    except ValueError as exc:  # a cached calibration holding a value out of range
        return _fail("invalid calibration", str(exc))
    request = SearchRequest(config, list(overrides), options.world, device, limit,
                            calibration, options.top, headroom=options.headroom,
                            nccl_buffer_bytes=int(options.nccl_buffer_mib * 2**20))
    try:
        result = search(request)
    except SimulationError as exc:  # a duration the device or calibration priced at inf
        return _fail("step-time model", str(exc))
    except ValueError as exc:
        return _fail("invalid config", str(exc))
    print(format_report(result, request, options.explain, note))
    return 0 if result.candidates else 2


def _check_calibrate(options: AutoOptions) -> None:
    """Raise ``ValueError`` on ``--calibrate`` for another device than the one it measures."""
    from mimotron.planner.calibration import DEVICE

    if options.calibrate and options.device != DEVICE:
        raise ValueError(f"--calibrate measures this host (device {DEVICE!r}); "
                         f"--device={options.device!r} is invalid with it: use "
                         f"--device {DEVICE}")


def _calibration(cfg: MimoConfig, options: AutoOptions) -> tuple[Calibration | None, str]:
    """The calibration to price with (measured with ``--calibrate``, else one cached in
    the run directory for this config and world), and how the report names it.

    Raises:
        ValueError: the cached calibration holds a value out of range (one line naming
            the file and the field).
    """
    from mimotron.planner import calibration as cal

    if options.calibrate:
        measured, reused = cal.calibrate_cached(cfg, options.world or 1,
                                                log=lambda line: print(line, flush=True))
        where = cal.calibration_path(cfg.log_dir)
        return measured, f"calibrated ({'cached' if reused else 'measured'}: {where})"
    digest = cal.fingerprint_digest(cal.fingerprint(cfg, options.world or 1,
                                                    cal.CalibrationOptions()))
    cached = cal.load_calibration(cfg.log_dir, digest)
    if cached is None or cached.device != options.device:
        return None, ""
    return cached, f"calibrated (cached: {cal.calibration_path(cfg.log_dir)})"
