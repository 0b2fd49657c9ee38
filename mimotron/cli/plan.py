"""``mimotron plan``: validate a config, print the rank map and a memory estimate.

The config is checked by the same validator as ``mimotron train`` (``load_config``, then
:func:`~mimotron.parallel.layout.check_layout` with the rules a rank's set-up applies), so
a config ``plan`` accepts is one ``train`` starts. With ``--device-memory`` each rank's
estimated peak is compared with one device (:mod:`mimotron.planner.fit`): a verdict
per rank and a summary line; the exit status stays 0 either way.
"""

from __future__ import annotations

import sys
from typing import Any

from mimotron.checkpoint.files import CheckpointError
from mimotron.cli.device_fit import parse_device_memory
from mimotron.config.context_length import context_length_note
from mimotron.config.load import load_config
from mimotron.config.moe_config import moe_options
from mimotron.config.schema import MimoConfig, ModuleConfig
from mimotron.config.vocab_size import padded_vocab_size
from mimotron.estimate.memory import (
    estimate_memory,
    microbatches_in_flight,
    stage_expert_counts,
    stage_parameter_counts,
)
from mimotron.estimate.native_memory import native_count_lines
from mimotron.parallel.expert_layout import format_expert_layout
from mimotron.parallel.layout import Layout, check_layout, format_skipped
from mimotron.pipeline.communicators import NCCL_BUFFER_BYTES, communicators_of
from mimotron.planner.fit import fit_lines

LEGEND = """\
activ: saved tensors of the forwards held at the peak of the rank's plan (in fl.: their
number: the 1F1B warm-up + 1, under virtual_pipeline model-chunk forwards; a frozen
encoder: its outputs only, a frozen tower: its projector's); bwd ws: the backward's
largest temporary; grads, optim, bucket, gather: of what trains;
bucket: the gradient reduction's buffers (one bucket, or every bucket with
train.overlap_grad_reduce); gather: a ZeRO-1 module's parameter all-gather
buffers (every bucket with train.overlap_param_gather); total = weights + grads
  + optim + max(activ + bwd ws, bucket, gather)"""


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f}"


def run_plan(config: str, overrides: list[str], dry_run: bool = False,
             ranks: list[int] | None = None, device_memory: str | None = None,
             nccl_buffer_mib: float = NCCL_BUFFER_BYTES / 2**20) -> int:
    """Print the plan; exit 0, or 2 with one line naming the problem.

    With ``device_memory`` (``80GB``, ``80GiB``, ``81920MiB``, bytes:
    :func:`~mimotron.cli.device_fit.parse_device_memory`), also whether each rank's
    estimate fits one device of that size, with its headroom, and a summary line; a
    plan that does not fit still exits 0. With ``dry_run``, then run ``ranks`` (None:
    all) on a fake accelerator (:func:`mimotron.dryrun.dry_run`) and print each rank's
    host syncs; exit 1 on a device mix or a step the dry run cannot stand in for. The
    fit adds ``nccl_buffer_mib`` per NCCL communicator a rank joins
    (:mod:`mimotron.pipeline.communicators`) to its estimate.
    """
    try:
        device = None if device_memory is None else parse_device_memory(device_memory)
        if not nccl_buffer_mib >= 0.0:
            raise ValueError(f"--nccl-buffer-mib={nccl_buffer_mib} is invalid: expected a "
                             "number of MiB >= 0")
    except ValueError as exc:
        print(f"mimotron plan: invalid option: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, overrides)
        layout = check_layout(cfg)
        from mimotron.run_dir import describe_run_dir

        run_dir = describe_run_dir(cfg)  # checkpoint.load checked as train checks it
        from mimotron.data.run_data import check_data

        tokenizer = check_data(cfg)  # The tokenizer and (llava) every sample, as train.
    except (ValueError, CheckpointError) as exc:
        print(f"mimotron plan: invalid config: {exc}", file=sys.stderr)
        return 2
    vocab = padded_vocab_size(tokenizer.vocab_size)
    note = context_length_note(cfg)
    if note:
        print(note)
    print(layout.format_rank_map())
    print()
    _print_modules(cfg, vocab)
    experts_table = format_expert_layout(cfg)
    if experts_table:
        print()
        print(experts_table)
    print()
    _print_memory(cfg, layout, vocab)
    if device is not None:
        print()
        buffers = int(nccl_buffer_mib * 2**20)
        print("\n".join(fit_lines(
            layout, lambda wanted: _rank_totals(cfg, layout, vocab, wanted, buffers),
            device, layout.shown_ranks(), device_memory or "")))
    print(f"\nmicro-batches per step: {cfg.num_microbatches} "
          f"(global batch {cfg.train.global_batch_size}, micro-batch {cfg.train.micro_batch_size})")
    if cfg.train.encoder_batching:
        print(f"encoder batching: each encoder runs the step's {cfg.num_microbatches} "
              f"micro-batches in one forward; its activations above hold all of them "
              f"(x{cfg.num_microbatches})")
    print(f"run directory: {run_dir}")
    return _dry_run(cfg, ranks) if dry_run else 0


def _frozen_note(mod: ModuleConfig) -> str:
    """The module row's note on ``freeze``: nothing trains, or only its projector."""
    if mod.fully_frozen:
        return "  (frozen)"
    return "  (tower frozen, projector trains)" if mod.tower_frozen else ""


def _print_modules(cfg: MimoConfig, vocab: int) -> None:
    """One row per module: kind, parameters per stage, degrees, CP / SP / MoE notes."""
    print(f"{'module':<10} {'kind':<9} {'params':>10}  tp pp dp  stages (params)")
    for name, mod in cfg.modules.items():
        stages = stage_parameter_counts(cfg, name, vocab)
        p = mod.parallel
        print(f"{name:<10} {mod.kind:<9} {sum(stages):>10,}  {p.tensor:>2} {p.pipeline:>2} "
              f"{p.data:>2}  {stages}{_frozen_note(mod)}")
        if p.context > 1:
            print(f"{'':<10} context parallel: each of {p.context} CP ranks holds seq / "
                  f"{p.context} = {cfg.data.seq_length // p.context} positions (2 chunks)")
        if p.sequence_parallel:
            local = cfg.data.seq_length // p.context
            print(f"{'':<10} sequence parallel: norm regions hold {local} / {p.tensor} "
                  f"= {local // p.tensor} positions per rank")
        moe = stage_expert_counts(cfg, name, vocab)
        if moe:
            experts, whole = sum(e for e, _ in moe), sum(w for _, w in moe)
            opts = moe_options(mod)
            assert opts is not None
            print(f"{'':<10} mixture of experts: {opts.num_experts} experts, top_k {opts.top_k}; "
                  f"routed expert params {experts:,}, router + shared {whole:,}, dense "
                  f"{sum(stages) - experts - whole:,}")


def _print_memory(cfg: MimoConfig, layout: Layout, vocab: int) -> None:
    """The per-rank memory table (summarised past the rank map's limit) and its legend."""
    print(f"memory estimate per rank (MiB, precision {cfg.train.precision}):")
    print(f"{'rank':>4}  {'module':<10} {'weights':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
          f"{'in fl.':>6} {'bwd ws':>8} {'bucket':>8} {'gather':>8} {'total':>8}")
    shown, previous = layout.shown_ranks(), -1  # A million ranks: a summary, not rows.
    flights: dict[tuple[str, int], int] = {}  # One plan replay per module stage.
    for rank, items in estimate_memory(cfg, layout, vocab, shown).items():
        if rank > previous + 1:
            print(format_skipped(rank - previous - 1))
        previous = rank
        roles = {role.module: role for role in layout.roles(rank)}
        for i, e in enumerate(items):
            r = f"{rank:>4}" if i == 0 else " " * 4
            key = (e.module, roles[e.module].pp)
            if key not in flights:
                flights[key] = microbatches_in_flight(cfg, layout, *key)
            print(f"{r}  {e.module:<10} {_mib(e.weights)} {_mib(e.grads)} {_mib(e.optimizer)} "
                  f"{_mib(e.activations)} {flights[key]:>6} {_mib(e.workspace)} "
                  f"{_mib(e.reduce_bucket)} {_mib(e.param_gather)} {_mib(e.total)}")
    if previous < layout.world_size - 1:
        print(format_skipped(layout.world_size - 1 - previous))
    print(LEGEND)
    for line in native_count_lines(cfg, layout):  # which image counts it used
        print(line)


def _rank_totals(cfg: MimoConfig, layout: Layout, vocab: int, ranks: list[int],
                 buffer_bytes: int = 0) -> dict[int, list[tuple[str, int]]]:
    """``rank -> [(module, estimated peak bytes)]`` for ``ranks``, and the NCCL buffers
    of its communicators (``buffer_bytes`` each) as one more entry."""
    mbs = cfg.train.micro_batch_size
    out = {rank: [(e.module, e.total) for e in items]
           for rank, items in estimate_memory(cfg, layout, vocab, ranks).items()}
    if buffer_bytes:
        for rank, items in out.items():
            items.append(("NCCL buffers", buffer_bytes * communicators_of(
                layout, rank, mbs, cfg.data.balance_encoders)))
    return out


def _dry_run(cfg: Any, ranks: list[int] | None) -> int:
    from mimotron.dryrun import DeviceMixError, DryRunError, dry_run

    print()
    try:
        for report in dry_run(cfg, ranks):
            print(report.format())
    except ValueError as exc:
        print(f"mimotron plan: invalid --rank: {exc}", file=sys.stderr)
        return 2
    except (DeviceMixError, DryRunError) as exc:
        print(f"mimotron plan: dry run failed: {exc}", file=sys.stderr)
        return 1
    return 0
