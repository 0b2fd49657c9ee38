"""``mimotron plan --device-memory``: the size forms it reads, the verdict per rank.

The verdict compares each rank's estimated peak (the sum of its modules' totals from
``estimate_memory``) with the device: checked row by row against the estimate, with a
device between two ranks' totals so both verdicts appear; the summary counts every rank
of the layout, also past the rank map's limit, where rows are summarised; a plan that
does not fit still exits 0.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mimotron.cli.device_fit import parse_device_memory
from mimotron.cli.main import main
from mimotron.config import load_config
from mimotron.estimate.memory import estimate_memory
from mimotron.parallel.layout import check_layout
from tests.common import DIGITS, noncolocated


@pytest.mark.parametrize("text,size", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("81920MiB", 80 * 2**30),
    ("85899345920", 80 * 2**30), ("79.5 gib", int(79.5 * 2**30)), ("1.5TB", 15 * 10**11),
    ("512KiB", 2**19), ("3B", 3),
])
def test_sizes_in_every_accepted_form(text: str, size: int) -> None:
    assert parse_device_memory(text) == size


@pytest.mark.parametrize("text", ["80G", "80XB", "", "GB", "-1GB", "0", "0.0001B", "80GB x",
                                  "1e9"])
def test_bad_sizes_name_the_value_and_the_forms(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_device_memory(text)
    message = str(info.value)
    assert message.startswith(f"--device-memory={text!r} is invalid") and "81920MiB" in message
    assert "\n" not in message


def test_a_bad_size_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--device-memory", "80 gigs", str(DIGITS)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mimotron plan: invalid option: --device-memory='80 gigs'")
    assert len(err.splitlines()) == 1


def _rows(out: str) -> dict[int, tuple[float, float, str]]:
    """``rank -> (total MiB, headroom MiB, verdict)`` of the fit block."""
    block = out.split("fit on a device of ")[1]
    rows = re.findall(r"^\s*(\d+)  \S.*? (-?[\d,]+\.\d\d) +(-?[\d,]+\.\d\d)  (fits|does not fit)$",
                      block, re.M)
    return {int(r): (float(t.replace(",", "")), float(h.replace(",", "")), v)
            for r, t, h, v in rows}


def test_verdict_and_headroom_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    overrides = [f"log.dir={tmp_path}"]
    cfg = load_config(DIGITS, overrides)
    est = estimate_memory(cfg, check_layout(cfg), 64)
    totals = {rank: sum(e.total for e in items) for rank, items in est.items()}
    # Between the audio rank's total and the vision rank's: some fit, some do not.
    device = (totals[1] + totals[0]) // 2
    # The estimate's verdict alone: the demo's ranks use gloo (no NCCL buffers).
    assert main(["plan", "--device-memory", str(device), "--nccl-buffer-mib", "0",
                 str(DIGITS), *overrides]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert sorted(rows) == sorted(totals)
    for rank, (total, headroom, verdict) in rows.items():
        assert total == pytest.approx(totals[rank] / 2**20, abs=0.006)
        assert headroom == pytest.approx((device - totals[rank]) / 2**20, abs=0.006)
        assert verdict == ("fits" if totals[rank] <= device else "does not fit")
    short = [r for r in totals if totals[r] > device]
    worst = min(totals, key=lambda r: (device - totals[r], r))
    assert 0 < len(short) < len(totals)
    summary = next(x for x in out.splitlines() if x.startswith("fit: "))
    assert summary.startswith(f"fit: {len(short)} of {len(totals)} ranks do not fit; "
                              f"the worst is rank {worst} (language)"), summary


def test_summary_counts_every_rank_past_the_rank_map(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    """66 ranks (language DP 64): rows are summarised, the count is not."""
    overrides = [*noncolocated({}, {}, {"data": 64}), "train.micro_batch_size=64",
                 "train.global_batch_size=64", f"log.dir={tmp_path}"]
    cfg = load_config(DIGITS, overrides)
    est = estimate_memory(cfg, check_layout(cfg), 64, [0, 1, 2])
    vision, audio, language = (est[r][0].total for r in (0, 1, 2))
    assert audio < language < vision  # the whole micro-batch on each encoder rank
    device = (audio + language) // 2  # only the audio rank fits
    assert main(["plan", "--device-memory", f"{device}B", "--nccl-buffer-mib", "0",
                 str(DIGITS), *overrides]) == 0
    out = capsys.readouterr().out
    assert "ranks not shown" in out.split("fit on a device of ")[1]
    assert "fit: 65 of 66 ranks do not fit; the worst is rank 0 (vision)" in out
    ample = f"{(vision + 2**20) / 2**30:.6f}GiB"
    assert main(["plan", "--device-memory", ample, "--nccl-buffer-mib", "0", str(DIGITS),
                 *overrides]) == 0
    assert "fit: all 66 ranks fit; the tightest is rank 0 (vision)" in capsys.readouterr().out
