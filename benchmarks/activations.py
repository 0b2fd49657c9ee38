"""Activation bytes per layer at Llama-2-7B's shape vs the published analysis.

``python benchmarks/activations.py [--json OUT]`` builds one transformer layer of the
language model at Llama-2-7B's shape (hidden 4096, 32 heads, SwiGLU 11008, 4096 tokens,
micro-batch 1, bf16) under ``FakeTensorMode`` and counts what autograd keeps for
backward on one rank (:func:`mimotron.dryrun.saved_bytes.layer_activation_bytes`: TP
and sequence parallelism applied with DTensor over a ``fake`` group), for no
parallelism, TP 8 and TP 8 + SP, and the same with ``train.fp32_residual_connection``
and with activation recompute. Beside each: Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") adjusted for SwiGLU, no dropout
and flash attention (``16h + 8f`` bytes per token, the norm and linear-input ``8h``
whole under TP without SP), and ``mimotron plan``'s per-layer figure
(:func:`mimotron.estimate.memory.layer_bytes_per_token`). Nothing is allocated: it runs
in seconds on a laptop.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mimotron.config import load_config  # noqa: E402
from mimotron.dryrun.saved_bytes import layer_activation_bytes  # noqa: E402
from mimotron.estimate.memory import layer_bytes_per_token  # noqa: E402

DIGITS = Path(__file__).resolve().parents[1] / "configs" / "digits.toml"
H, F, SEQ = 4096, 11008, 4096
SHAPE = ["modules.language.hidden_size=4096", "modules.language.num_heads=32",
         "modules.language.ffn_hidden_size=11008", "modules.language.num_layers=32",
         f"data.seq_length={SEQ}", "train.micro_batch_size=1", "train.precision=bf16"]
TP8 = ["modules.language.parallel.tensor=8"]
SP = ["modules.language.parallel.sequence_parallel=true"]
PUBLISHED = {"none": (16 * H + 8 * F) * SEQ,
             "TP 8": (8 * H + (8 * H + 8 * F) // 8) * SEQ,
             "TP 8 + SP": (16 * H + 8 * F) // 8 * SEQ}
ROWS = [
    ("none", [], "none"), ("TP 8", TP8, "TP 8"), ("TP 8 + SP", TP8 + SP, "TP 8 + SP"),
    ("none, fp32 residual", ["train.fp32_residual_connection=true"], None),
]


def measure() -> list[dict[str, object]]:
    """One row per layout: measured, published (where there is one) and plan bytes."""
    rows = []
    for label, extra, published in ROWS:
        cfg = load_config(DIGITS, SHAPE + extra)
        measured = layer_activation_bytes(cfg)
        whole, split = layer_bytes_per_token(cfg, "language")
        plan = SEQ * (whole + split // cfg.modules["language"].parallel.tensor)
        pub = PUBLISHED.get(published) if published else None
        rows.append({"layout": label, "measured_mib": measured / 2**20,
                     "published_mib": None if pub is None else pub / 2**20,
                     "ratio": None if pub is None else measured / pub,
                     "plan_mib": plan / 2**20})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="OUT", help="write the rows here")
    args = p.parse_args(argv)
    rows = measure()
    print("| per layer, Llama-2-7B shape, seq 4096, micro-batch 1, bf16 | measured | "
          "published | ratio | plan |")
    print("|---|---|---|---|---|")
    for r in rows:
        pub = "-" if r["published_mib"] is None else f"{r['published_mib']:.1f} MiB"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['layout']} | {r['measured_mib']:.1f} MiB | {pub} | {ratio} | "
              f"{r['plan_mib']:.1f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
