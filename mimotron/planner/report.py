"""What ``mimotron plan --auto`` prints: the ranked layouts, the model's error, the TOML.

:func:`format_report` renders a :class:`~mimotron.planner.search.SearchResult`: a header
(the device, the limit, what the search did), one row per candidate (placement,
micro-batch, each module's layout, predicted step, peak memory against the limit,
bottleneck), a remark when the leading candidates are closer than the model's error,
``--explain``'s terms per candidate, and the best layout as a TOML snippet plus the
same as ``key=value`` overrides for ``mimotron train``.
"""

from __future__ import annotations

from mimotron.planner.options import ModuleOption, module_settings, toml_value
from mimotron.planner.search import Candidate, SearchRequest, SearchResult

ERROR_CONSTANTS = 0.15
"""The model's assumed error from device constants: the sustained FLOP/s is a rule of
thumb (dense transformer layers reach roughly 35-65 % of the datasheet peak, the table
takes 50 %) and collectives run at a nominal bus bandwidth."""
ERROR_CALIBRATED = 0.10
"""The model's assumed error with a calibration: the module times and collectives are
measured on the machine, what remains is their spread between runs and what the model
leaves out (kernel launch overheads that do not scale with the shapes, the allocator)."""


CPU_UNCALIBRATED = (
    "device constants on a CPU are not a meaningful step time: what a CPU rank spends "
    "is mostly fixed per-call overhead and small-shape matmul speed, not FLOPs over a "
    "rate (the demo on 4 CPU ranks, 2026-12-02: 0.6-2.3x the measured seconds, their "
    "order a rank correlation of 0.75 with the measured), so the seconds are not a "
    "forecast and the order is a rough guide; run with --calibrate to measure this host")
"""The remark for ``--device cpu`` without a calibration (no ±X %: none is known)."""


def model_error(request: SearchRequest) -> float | None:
    """The relative error assumed for this search's predictions; None where no error
    is known (a CPU priced from device constants: see :data:`CPU_UNCALIBRATED`)."""
    if request.calibration is not None:
        return ERROR_CALIBRATED
    if request.device.host_cores or request.device.name == "cpu":
        return None
    return ERROR_CONSTANTS


_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def memory_unit(limit: float) -> tuple[int, str]:
    """The binary unit for amounts up to ``limit``: the largest in which it is >= 1."""
    return next((size, name) for size, name in _UNITS if limit >= size or size == 1)


def _amount(n: float, unit: tuple[int, str]) -> str:
    return f"{n / unit[0]:.2f}"


def _layout_cell(name: str, option: ModuleOption) -> str:
    return f"{name}: {option.describe()}"


def format_table(result: SearchResult, request: SearchRequest) -> list[str]:
    """One row per candidate, best first."""
    unit = memory_unit(request.memory_limit)
    lines = [f"{'#':>2}  {'placement':<11} {'mbs':>4}  {'step s':>8}  {'MFU':>5}  "
             f"{'tok/s/dev':>9}  {'peak ' + unit[1]:>8} / {'limit':<6}  "
             f"{'bottleneck':<32} layout"]
    limit = _amount(request.memory_limit, unit)
    for i, cand in enumerate(result.candidates[:request.top], 1):
        assert cand.cost is not None
        layout = "; ".join(_layout_cell(n, o) for n, o in cand.options.items())
        place = cand.placement
        peak = _amount(cand.peak, unit)
        mfu = predicted_mfu(cand, request)
        mfu_cell = "-" if mfu is None else f"{mfu:.0%}"
        per_device = cand.tokens / cand.cost.total / request.world
        lines.append(f"{i:>2}  {place:<11} {cand.micro_batch:>4}  {cand.cost.total:>8.4g}  "
                     f"{mfu_cell:>5}  {per_device:>9,.0f}  {peak:>8} / {limit:<6}  "
                     f"{cand.cost.bottleneck:<32} {layout}")
    return lines


def batch_remark(best: Candidate, request: SearchRequest) -> str:
    """A warning where the global batch is smaller than the world: fewer samples than
    ranks in a step leave pipelines unfilled and push the model onto more tensor or
    pipeline ranks than it uses well; with the MFU the best layout implies."""
    if best.samples >= request.world:
        return ""
    mfu = predicted_mfu(best, request)
    implied = "" if mfu is None else f"; the best layout found implies MFU {mfu:.0%}"
    return (f"warning: a global batch of {best.samples} samples cannot keep {request.world:,}"
            f" ranks busy ({best.samples / request.world:.2g} samples per rank per step)"
            f"{implied}; raise train.global_batch_size or plan for fewer ranks")


def predicted_mfu(cand: Candidate, request: SearchRequest) -> float | None:
    """Model FLOPs per step over the predicted step and the world's datasheet peak
    (``None`` where the device's peak is unknown)."""
    peak = request.device.peak_flops_per_s
    if not peak or cand.cost is None or cand.cost.total <= 0:
        return None
    return cand.model_flops / cand.cost.total / (peak * request.world)


def uncertainty_remark(result: SearchResult, request: SearchRequest) -> str:
    """Which leading candidates the model cannot tell apart (within its error)."""
    error = model_error(request)
    if error is None:
        return CPU_UNCALIBRATED[0].upper() + CPU_UNCALIBRATED[1:] + "."
    shown = result.candidates[:request.top]
    if len(shown) < 2:
        return ""
    best = shown[0].cost.total if shown[0].cost else 0.0
    close = [i for i, c in enumerate(shown, 1) if c.cost and c.cost.total <= best * (1 + error)]
    calibrated = request.calibration is not None
    source = "calibrated" if calibrated else "device constants"
    if len(close) < 2:
        return (f"#1 is more than the model's error (±{error:.0%}, {source}) faster than "
                f"#2: a clear choice by this model.")
    # A calibrated report was measured already: only training steps tell them apart.
    how = "a few training steps each" if calibrated else (
        "--calibrate, or a few training steps each")
    return (f"#{', #'.join(map(str, close))} are within the model's error (±{error:.0%}, "
            f"{source}) of #1: indistinguishable by this model; measure them "
            f"({how}) to choose.")


def explain_lines(cand: Candidate) -> list[str]:
    """``--explain``: one candidate's terms, in seconds per step."""
    assert cand.cost is not None
    out = [f"    {label:<44} {seconds:>10.4f} s" for label, seconds in cand.cost.terms()]
    module, stage = cand.cost.critical
    out.append(f"    {'step (ends on ' + module + ' stage ' + str(stage) + ')':<44} "
               f"{cand.cost.total:>10.4f} s")
    return out


def snippet(cand: Candidate) -> str:
    """The candidate as TOML: ``[train]``'s micro-batch, encoder batching and each module's
    recompute keys
    to set, and each module's ``[modules.<m>.parallel]`` table to replace the config's
    (keys left out take their defaults)."""
    defaults = module_settings(ModuleOption(), 0)
    lines = ["[train]", f"micro_batch_size = {cand.micro_batch}",
             f"encoder_batching = {toml_value(cand.encoder_batching)}"]
    for name, option in cand.options.items():
        settings = module_settings(option, cand.offsets[name])
        lines += ["", f"[modules.{name}]",
                  f"recompute = {toml_value(settings['recompute'])}"]
        if option.recompute != "none":
            lines.append("recompute_num_layers = 0")
        lines += ["", f"[modules.{name}.parallel]"]
        lines += [f"{key.split('.')[1]} = {toml_value(value)}"
                  for key, value in settings.items() if key.startswith("parallel.")
                  and (value != defaults[key] or key in ("parallel.data",
                                                         "parallel.rank_offset"))]
    return "\n".join(lines)


def format_report(result: SearchResult, request: SearchRequest, explain: bool = False,
                  calibration_note: str = "") -> str:
    """The whole report (see the module docstring)."""
    d = request.device
    unit = memory_unit(request.memory_limit)
    usable = _amount(request.usable_memory, unit)
    lines = [f"plan --auto: {request.config} on {request.world} x {d.name} "
             f"({_amount(request.memory_limit, unit)} {unit[1]} each; layouts fit in "
             f"{usable} {unit[1]}, {request.headroom:.0%} kept free as headroom)",
             f"step-time model: {calibration_note + '; ' if calibration_note else ''}"
             f"device constants{' where it measured nothing' if calibration_note else ''}: "
             f"{d.flops_per_s:.3g} FLOP/s sustained, {d.intra_node_bytes_per_s:.3g} B/s "
             f"in a node of {d.devices_per_node}, {d.inter_node_bytes_per_s:.3g} B/s across",
             f"searched {result.scored:,} module options, composed {result.composed:,} "
             f"layouts, checked {result.checked} ({result.refused} refused by the validator, "
             f"{result.too_big} over the memory limit) in {result.seconds:.1f} s"]
    if not result.candidates:
        lines.append("no layout fits: every candidate the search checked was refused by "
                     "the validator or needs more memory than the limit less the headroom; raise "
                     "--device-memory, --world, lower --headroom or "
                     "train.micro_batch_size")
        return "\n".join(lines)
    lines += ["", *format_table(result, request)]
    remark = uncertainty_remark(result, request)
    if remark:
        lines += ["", remark]
    busy = batch_remark(result.candidates[0], request)
    if busy:
        lines += ["", busy]
    if explain:
        lines += ["", "terms per step (modules run side by side: terms do not add up):"]
        for i, cand in enumerate(result.candidates[:request.top], 1):
            lines += [f"  #{i}", *explain_lines(cand)]
    best = result.candidates[0]
    lines += ["", "best layout (#1) as TOML: set [train] micro_batch_size and "
              "encoder_batching and each module's recompute, replace each "
              "[modules.<m>.parallel] table",
              "", snippet(best), "", "or as overrides of the config:",
              f"  mimotron train {request.config} " + " ".join(best.changes)]
    return "\n".join(lines)
