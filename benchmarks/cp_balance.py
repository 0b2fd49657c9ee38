"""Packing with context parallelism: balance the packed row, or each document?

``python benchmarks/cp_balance.py [--rows N] [--json OUT]``

Issue 16 asks to measure and choose how a packed row is split over the CP group. Two
candidates, both with causal load balancing (each rank a head chunk and a tail chunk):

* **row**: the packed row is cut into ``2c`` chunks as an unpacked sequence is
  (:func:`mimotron.parallel.context_parallel.load_balanced_positions`); documents are
  cut wherever the chunk boundaries fall. Nothing changes in the data path.
* **document**: every document is padded to a multiple of ``2c`` and cut into ``2c``
  chunks of its own, rank ``r`` holding chunks ``r`` and ``2c - 1 - r`` of every
  document (Megatron-Core's and Transformer Engine's THD layout). Documents then take
  more room in a row (the padding), so fewer fit.

The figure of merit is the *useful* attention work of each rank: the (query, key)
pairs its queries may attend to (same document, key not after query), which is what a
kernel that skips masked blocks (flash/ring attention) computes. mimotron's own CP
attention computes the dense ``[S / c, S]`` score block on every rank, so its cost is
balanced by construction either way; the choice matters for such kernels and for the
padding the document split adds. Rows are the demo data (``configs/digits.toml``)
packed as training packs them; imbalance = busiest rank's pairs / mean pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import digits_raw, make_config  # noqa: E402
from mimotron.data import build_datasets  # noqa: E402
from mimotron.data.packing import pack_rows  # noqa: E402
from mimotron.data.run_data import build_tokenizer  # noqa: E402
from mimotron.parallel.context_parallel import load_balanced_positions  # noqa: E402


def doc_lengths(seq_length: int, num_rows: int) -> list[list[int]]:
    """Document lengths of the first ``num_rows`` packed training rows of the demo data."""
    cfg = make_config(digits_raw(), [f"data.seq_length={seq_length}", "data.packing=true"])
    train_task, _ = build_datasets(cfg, build_tokenizer(cfg))
    stream = train_task.stream(cfg.train.seed)
    rows, _ = pack_rows(stream.samples, 0, num_rows, seq_length)
    return [[int(s["tokens"].numel()) for s in row] for row in rows]


def _pairs_per_query(lengths: list[int]) -> torch.Tensor:
    """Useful keys of each position of a row laid out as ``lengths`` (padding: 0)."""
    return torch.cat([torch.arange(1, n + 1) for n in lengths])


def row_split(lengths: list[int], seq_length: int, cp: int) -> list[int]:
    """Useful pairs per CP rank when the packed row is split like one sequence."""
    work = torch.zeros(seq_length, dtype=torch.long)
    real = _pairs_per_query(lengths)
    work[:real.numel()] = real
    return [int(work[load_balanced_positions(seq_length, cp, r)].sum()) for r in range(cp)]


def document_split(lengths: list[int], cp: int) -> tuple[list[int], int]:
    """Useful pairs per CP rank when each document is split on its own; padding added."""
    per_rank = [0] * cp
    padding = 0
    for n in lengths:
        padded = -(-n // (2 * cp)) * 2 * cp
        padding += padded - n
        work = torch.zeros(padded, dtype=torch.long)
        work[:n] = torch.arange(1, n + 1)
        for r in range(cp):
            per_rank[r] += int(work[load_balanced_positions(padded, cp, r)].sum())
    return per_rank, padding


def imbalance(per_rank: list[int]) -> float:
    """Busiest rank's work over the mean (1.0 = perfectly balanced)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean else 1.0


def measure(seq_length: int, cp: int, num_rows: int) -> dict[str, Any]:
    """Mean imbalance of both splits over the rows, and the document split's padding."""
    rows = doc_lengths(seq_length, num_rows)
    row_imb, doc_imb, pad, overflow = [], [], 0, 0
    for lengths in rows:
        row_imb.append(imbalance(row_split(lengths, seq_length, cp)))
        per_rank, added = document_split(lengths, cp)
        doc_imb.append(imbalance(per_rank))
        pad += added
        overflow += sum(lengths) + added > seq_length  # the row no longer fits
    real = sum(sum(r) for r in rows)
    return {"seq_length": seq_length, "cp": cp, "rows": len(rows),
            "docs_per_row": sum(len(r) for r in rows) / len(rows),
            "row_split_imbalance_mean": sum(row_imb) / len(row_imb),
            "row_split_imbalance_max": max(row_imb),
            "document_split_imbalance_mean": sum(doc_imb) / len(doc_imb),
            "document_split_imbalance_max": max(doc_imb),
            "document_split_padding_fraction": pad / real,
            "document_split_rows_overflowing": overflow}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="packed rows per setting")
    p.add_argument("--json", metavar="OUT", help="write the measurements here")
    args = p.parse_args(argv)
    results = [measure(s, cp, args.rows) for s in (64, 128, 256) for cp in (2, 4)]
    for r in results:
        print(f"seq {r['seq_length']:>4} cp {r['cp']}: {r['docs_per_row']:.1f} docs/row; "
              f"imbalance row split {r['row_split_imbalance_mean']:.3f} "
              f"(max {r['row_split_imbalance_max']:.3f}), document split "
              f"{r['document_split_imbalance_mean']:.3f} "
              f"(max {r['document_split_imbalance_max']:.3f}) + "
              f"{100 * r['document_split_padding_fraction']:.1f}% padding, "
              f"{r['document_split_rows_overflowing']} rows no longer fit")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
