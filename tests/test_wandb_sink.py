"""``log.wandb``: an offline wandb run holds the records of ``metrics.jsonl``.

Training runs in a forked rank (wandb's service and threads never start in the test
process); the test reads the run folder's ``.wandb`` file itself: W&B's log format
(LevelDB's record framing: 32 KiB blocks, 7-byte chunk headers) of ``Record`` protobuf
messages, whose ``history`` records are the logged rows. The suite runs with
``WANDB_MODE=offline`` (tests/conftest.py). Skipped only when ``wandb`` is not installed
(``make`` installs it: the ``wandb`` extra).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mimotron.config import load_config
from mimotron.forked_ranks import run_ranks
from mimotron.runtime import init_runtime
from tests.common import BASE, DIGITS, ONE_RANK

pytest.importorskip("wandb")

_BLOCK, _HEADER = 32768, 7  # W&B's log: LevelDB log blocks and chunk headers
_FULL, _LAST = 1, 4  # chunk types that end a record


def _records(path: Path) -> list[bytes]:
    """The records of a ``.wandb`` file (chunks of a record joined)."""
    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert ident == b":W&B", path
    out, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and size == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + _HEADER:pos + _HEADER + size]
        pos += _HEADER + size
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def _history(run_dir: Path) -> list[dict]:
    """The rows logged to the wandb run in ``run_dir`` (wandb's own keys dropped)."""
    from wandb.proto import wandb_internal_pb2

    (file,) = run_dir.glob("run-*.wandb")
    rows = []
    for raw in _records(file):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def _train(rank: int, world: int, overrides: list[str]) -> None:
    from mimotron.training.loop import run_training

    run_training(load_config(DIGITS, BASE + overrides), init_runtime())


def test_offline_run_holds_the_records_and_a_resume_continues_it(tmp_path):
    """Iterations 1-2 with a checkpoint, then a resume to 4: two offline run folders of
    one wandb run id whose history rows are the train and eval records of metrics.jsonl
    (loss, grad norm, per-module lr, eval loss), each at its iteration."""
    over = [*ONE_RANK, "log.wandb=true", "log.wandb_project='mimotron-test'", "log.interval=1",
            "eval.interval=2", "eval.iters=1", "checkpoint.interval=2",
            f"log.dir='{tmp_path}'"]  # fmt: skip
    run_ranks(1, _train, [*over, "train.iters=2"], timeout_s=240)
    run_ranks(1, _train, [*over, "train.iters=4"], timeout_s=240)
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # wandb names each folder by the second it started (and adds "-1" when two start in the
    # same second); the transaction log inside is named by the run id.
    assert len(runs) == 2 and all((r / f"run-{run_id}.wandb").is_file() for r in runs)
    rows = [row for run in runs for row in _history(run)]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    assert [r["iteration"] for r in evals] == [2, 4]
    assert [(r["iteration"], r["loss"], r["grad_norm"], r["lr/language"]) for r in rows
            if "loss" in r] == [(r["iteration"], r["loss"], r["grad_norm"],
                                 r["lr"]["language"]) for r in train]  # fmt: skip
    assert [(r["iteration"], r["eval_loss"]) for r in rows if "eval_loss" in r] == [
        (r["iteration"], r["eval_loss"]) for r in evals]
    # Nested values are flattened; every numeric field of a record is there.
    first = next(r for r in rows if "loss" in r)
    assert {"module_time_s/language/forward", "peak_memory_bytes_per_rank/0",
            "consumed_samples"} <= set(first)
