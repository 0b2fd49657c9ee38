"""The plan's memory estimate against a measured peak, at real model sizes.

For LLaVA-1.5-7B (CLIP ViT-L/14-336 + Llama-2-7B) on 8 GPUs and Llama-2-70B + CLIP
ViT-L on 64 GPUs, several layouts each (split with pipeline stages, colocated, the
distributed optimizer, full recompute; bf16), this prints per measured rank the
estimate of ``mimotron plan`` (:func:`mimotron.estimate.memory.estimate_memory`),
the peak measured by running the rank's training steps in the fake-device dry run
under torch's memory tracker (:func:`mimotron.dryrun.memory_peak.measure_peak`), and
their ratio (target 0.85-1.15). The measured rank is the one with the largest
estimate, plus the vision rank 0 where it is on ranks of its own. Models are built
from config.json-only folders (``tests/data/hf_configs``): nothing is allocated or
downloaded, but each rank's step runs every op shape-only, minutes per rank on a CPU.

Usage::

    python benchmarks/plan_vs_measured.py                 # every layout
    python benchmarks/plan_vs_measured.py --layout 7b-split-tp --layout 70b-colocated
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mimotron.config import MimoConfig, load_config  # noqa: E402
from mimotron.dryrun.memory_peak import measure_peak  # noqa: E402
from mimotron.estimate.memory import estimate_memory  # noqa: E402
from mimotron.parallel.layout import check_layout  # noqa: E402

LLAVA_7B = "configs/llava15_7b_8gpu.toml"
LLAMA_70B = "configs/llama2_70b_vit_64gpu.toml"


@dataclass(frozen=True)
class Case:
    """One layout: a config, its overrides, the ranks measured and those feeding them."""

    config: str
    overrides: list[str] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)
    run_first: list[int] = field(default_factory=list)
    note: str = ""


CASES: dict[str, Case] = {
    # Vision DP 2 on 0-1; language TP 2 x PP 3 on 2-7 (rank 2: first stage, most in flight).
    "7b-split-pp": Case(LLAVA_7B, [], [0, 2], [1], "vision DP 2 | language TP 2 x PP 3"),
    # Vision DP 4 on 0-3; language TP 4 on 4-7.
    "7b-split-tp": Case(LLAVA_7B, [
        "modules.vision.parallel.data=4", "modules.language.parallel.tensor=4",
        "modules.language.parallel.pipeline=1", "modules.language.parallel.layers_per_stage=[]",
        "modules.language.parallel.rank_offset=4", "train.micro_batch_size=4",
        "train.global_batch_size=8",
    ], [0, 4], [1, 2, 3], "vision DP 4 | language TP 4"),
    # Both modules on ranks 0-7, DP 8 each (the language model ZeRO-1, full recompute).
    "7b-colocated": Case(LLAVA_7B, [
        "modules.vision.parallel.data=8", "modules.language.parallel.tensor=1",
        "modules.language.parallel.pipeline=1", "modules.language.parallel.data=8",
        "modules.language.parallel.layers_per_stage=[]", "modules.language.parallel.rank_offset=0",
        "modules.language.parallel.shard_optimizer=true", "modules.language.recompute=full",
        "train.micro_batch_size=8", "train.global_batch_size=16",
    ], [0], [], "colocated: vision DP 8, language DP 8 ZeRO-1, full recompute"),
    # Vision DP 2, language PP 3 x DP 2 (ZeRO-1 both, full recompute of the language model).
    "7b-zero-recompute": Case(LLAVA_7B, [
        "modules.vision.parallel.shard_optimizer=true", "modules.language.parallel.tensor=1",
        "modules.language.parallel.data=2", "modules.language.parallel.shard_optimizer=true",
        "modules.language.recompute=full",
    ], [0, 2], [1], "vision DP 2 ZeRO-1 | language PP 3 x DP 2, ZeRO-1, full recompute"),
    # Vision TP 8 on 0-7; language TP 8 (SP) x PP 7 on 8-63.
    "70b-split": Case(LLAMA_70B, [], [0, 8], list(range(1, 8)),
                      "vision TP 8 | language TP 8 SP x PP 7"),
    # Both on 0-63: vision DP 64, language TP 8 (SP) x DP 8, full recompute.
    "70b-colocated": Case(LLAMA_70B, [
        "modules.vision.parallel.tensor=1", "modules.vision.parallel.data=64",
        "modules.language.parallel.pipeline=1",
        "modules.language.parallel.data=8", "modules.language.parallel.layers_per_stage=[]",
        "modules.language.parallel.rank_offset=0", "modules.language.recompute=full",
        "train.micro_batch_size=64", "train.global_batch_size=64",
    ], [0], [], "colocated: vision DP 64, language TP 8 SP x DP 8, full recompute"),
    # Vision DP 8 on 0-7 (no TP); language TP 8 (SP) x PP 7 on 8-63, first stage measured.
    "70b-split-vision-dp": Case(LLAMA_70B, [
        "modules.vision.parallel.tensor=1", "modules.vision.parallel.data=8",
        "train.micro_batch_size=8", "train.global_batch_size=16",
    ], [8], list(range(8)), "vision DP 8 | language TP 8 SP x PP 7, micro-batch 8"),
    # As above with full recompute of the language model.
    "70b-split-vision-dp-recompute": Case(LLAMA_70B, [
        "modules.vision.parallel.tensor=1", "modules.vision.parallel.data=8",
        "train.micro_batch_size=8", "train.global_batch_size=16",
        "modules.language.recompute=full",
    ], [8], list(range(8)), "vision DP 8 | language TP 8 SP x PP 7, full recompute"),
    # Both on 0-63: vision TP 8 x DP 8, language TP 8 x DP 8 under FSDP2, full recompute.
    "70b-colocated-fsdp": Case(LLAMA_70B, [
        "modules.vision.parallel.data=8", "modules.language.parallel.data=8",
        "modules.language.parallel.pipeline=1", "modules.language.parallel.layers_per_stage=[]",
        "modules.language.parallel.rank_offset=0", "modules.language.parallel.fsdp=true",
        "modules.language.parallel.sequence_parallel=false", "modules.language.recompute=full",
        "train.global_batch_size=64", "train.micro_batch_size=8",
    ], [0], [], "colocated: vision TP 8 x DP 8, language TP 8 x DP 8 FSDP2, full recompute"),
    # The split layout with full recompute of the language model.
    "70b-split-recompute": Case(LLAMA_70B, ["modules.language.recompute=full"], [8],
                                list(range(8)), "as 70b-split, language full recompute"),
}


def estimate_totals(cfg: MimoConfig, ranks: list[int]) -> dict[int, int]:
    """``mimotron plan``'s total per rank (all modules it holds)."""
    from mimotron.config.vocab_size import padded_vocab_size
    from mimotron.data.run_data import build_tokenizer

    vocab = padded_vocab_size(build_tokenizer(cfg).vocab_size)
    per_rank = estimate_memory(cfg, check_layout(cfg), vocab, ranks)
    return {r: sum(e.total for e in items) for r, items in per_rank.items()}


def run_case(name: str, case: Case) -> list[tuple[str, int, int, int, str]]:
    """``(layout, rank, estimate, measured, breakdown)`` per measured rank."""
    cfg = load_config(str(ROOT / case.config), case.overrides)
    estimates = estimate_totals(cfg, case.measured)
    measured = measure_peak(cfg, case.measured, run_first=case.run_first)
    rows = []
    for rank in case.measured:
        m = measured[rank]
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in m.breakdown.items() if v)
        rows.append((name, rank, estimates[rank], m.peak, parts))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the chosen layouts and print the table (GiB)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", action="append", choices=sorted(CASES),
                        help="a layout to run (repeatable; default: all)")
    args = parser.parse_args(argv)
    print("| layout | rank | estimate GiB | measured GiB | estimate / measured | "
          "measured at the peak (GiB) |")
    print("|---|---|---|---|---|---|")
    worst = 1.0
    for name in args.layout or list(CASES):
        start = time.perf_counter()
        for layout, rank, est, peak, parts in run_case(name, CASES[name]):
            ratio = est / peak
            worst = max(worst, abs(ratio - 1) + 1)
            print(f"| {layout} ({CASES[name].note}) | {rank} | {est / 2**30:.2f} | "
                  f"{peak / 2**30:.2f} | {ratio:.3f} | {parts} |", flush=True)
        print(f"<!-- {name}: {time.perf_counter() - start:.0f} s -->", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
