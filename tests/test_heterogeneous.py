"""Heterogeneous layouts beyond parity: schedules agree, data has text-only samples, and
incompatible layouts are rejected before any process group exists.

Parity of every layout class with the plain PyTorch loop is in ``tests/test_parity.py``.
"""

from __future__ import annotations

import torch.distributed as dist

from mimotron.cli.train import run_train
from mimotron.forked_ranks import run_ranks
from tests.common import DIGITS, NUM_ITERS, noncolocated
from tests.common import colocated as _colocated
from tests.common import train_steps as _train


def test_no_pipelining_schedule_matches_1f1b():
    layout = noncolocated({"pipeline": 2}, {}, {"pipeline": 2}) + ["modules.vision.num_layers=2"]
    one = run_ranks(5, _train, layout, 3, timeout_s=120)
    other = run_ranks(5, _train, layout + ["train.schedule=no_pipelining"], 3, timeout_s=120)
    assert [r[:2] for r in one[-1]] == [r[:2] for r in other[-1]]


def _batch_kinds(rank: int, world: int) -> list[int]:
    """Text-only samples per global batch of the parity runs (the data is layout-free)."""
    from mimotron.config import load_config
    from mimotron.data import build_datasets
    from mimotron.data.tokenizer import CharTokenizer
    from tests.common import BASE

    cfg = load_config(DIGITS, BASE + _colocated(1))
    task, _ = build_datasets(cfg, CharTokenizer())
    stream = task.stream(cfg.train.seed)
    g = cfg.train.global_batch_size
    return [sum(1 for s in stream.samples(k * g, g) if s["image"] is None and s["audio"] is None)
            for k in range(NUM_ITERS)]


def test_parity_batches_contain_text_only_samples():
    # The cases above are only meaningful for text-only samples if the batches have some.
    assert sum(_batch_kinds(0, 1)) > 0


def test_incompatible_dp_rejected_before_any_process_group(tmp_path, capsys):
    code = run_train(str(DIGITS), noncolocated({"data": 3}, {}, {"data": 2})
                     + ["train.micro_batch_size=6", "train.global_batch_size=12"])
    assert code == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err
    assert "modules.vision.parallel.data=3 is invalid" in err
