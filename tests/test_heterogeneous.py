"""Heterogeneous layouts (per-module TP/PP/DP, both placements) train like one process.

Each case runs the real engine for a few fp32 iterations on forked gloo ranks and
compares every rank's per-iteration loss and global grad norm with a one-rank run of
the same config (DESIGN.md §3: relative difference <= 1e-4).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from mimotron.cli.train import run_train
from mimotron.testing import run_ranks
from tests.common import DIGITS, NUM_ITERS
from tests.common import colocated as _colocated
from tests.common import par as _par
from tests.common import train_steps as _train


def _noncolocated(vision: dict, audio: dict, language: dict) -> list[str]:
    """Blocks in order vision | audio | language, each with its own degrees."""
    out, offset = [], 0
    for name, par in (("vision", vision), ("audio", audio), ("language", language)):
        par = {"data": 1, **par}
        out += _par(name, rank_offset=offset, **par)
        offset += par["data"] * par.get("tensor", 1) * par.get("pipeline", 1)
    return out


CASES = {
    # name: (layout overrides, extra model/batch overrides shared with the reference)
    "language-tp2": (_noncolocated({}, {}, {"tensor": 2}), []),
    "vision-tp2-language-tp1": (_noncolocated({"tensor": 2}, {}, {}), []),
    "language-pp2": (_noncolocated({}, {}, {"pipeline": 2}), []),
    "vision-pp2-language-pp2": (_noncolocated({"pipeline": 2}, {}, {"pipeline": 2}),
                                ["modules.vision.num_layers=2"]),
    "language-pp2-many-microbatches": (_noncolocated({}, {}, {"pipeline": 2}),
                                       ["train.micro_batch_size=2"]),
    "language-pp2-one-microbatch": (_noncolocated({}, {}, {"pipeline": 2}),
                                    ["train.micro_batch_size=16"]),
    "language-tp2-dp2-fan-out": (_noncolocated({}, {}, {"tensor": 2, "data": 2}), []),
    "colocated-vision-dp4-language-tp2-dp2": (
        _par("vision", data=4, rank_offset=0) + _par("audio", data=4, rank_offset=0)
        + _par("language", tensor=2, data=2, rank_offset=0),
        []),
}

_REFERENCES: dict[tuple[str, ...], list[tuple]] = {}


def _reference(extra: list[str]) -> list[tuple]:
    key = tuple(extra)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(1, _train, _colocated(1) + extra, NUM_ITERS,
                                     timeout_s=120)[0]
    return _REFERENCES[key]


def _world(overrides: list[str]) -> int:
    from mimotron.config import load_config
    from mimotron.parallel.layout import plan_layout
    from tests.common import BASE

    return plan_layout(load_config(DIGITS, BASE + overrides)).world_size


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_one_process(name):
    layout, extra = CASES[name]
    ref = _reference(extra)
    results = run_ranks(_world(layout + extra), _train, layout + extra, NUM_ITERS,
                        timeout_s=240)
    for rank, res in enumerate(results):
        for it, (got, want) in enumerate(zip(res, ref, strict=True)):
            assert got[3] == want[3], f"rank {rank} iter {it}: token counts differ"
            assert got[0] == pytest.approx(want[0], rel=1e-4), f"rank {rank} iter {it} loss"
            assert got[1] == pytest.approx(want[1], rel=1e-4), f"rank {rank} iter {it} norm"


def test_no_pipelining_schedule_matches_1f1b():
    layout = _noncolocated({"pipeline": 2}, {}, {"pipeline": 2}) + ["modules.vision.num_layers=2"]
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
    code = run_train(str(DIGITS), _noncolocated({"data": 3}, {}, {"data": 2})
                     + ["train.micro_batch_size=6", "train.global_batch_size=12"])
    assert code == 2
    assert not dist.is_initialized()
    err = capsys.readouterr().err
    assert "modules.vision.parallel.data=3 is invalid" in err
