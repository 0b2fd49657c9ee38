"""Smoke test of the LLaVA loading benchmark: it runs and reports its figures (tiny size).

The numbers themselves are not checked (they measure wall time on a shared machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Options  # noqa: E402
from benchmarks.llava_loading import run_case  # noqa: E402


def test_llava_loading_case_reports_both_sides():
    result = run_case(Options(quick=True, size="tiny", reps=1), num_workers=2)
    names = [f.name for f in result.figures]
    assert names == ["samples_per_s_sync", "samples_per_s_workers", "loading_speedup",
                     "step_wait_fraction"]
    assert all(f.value > 0 for f in result.figures[:3])
    assert 0 <= result.figures[3].value <= 1
    assert result.measurements["num_workers"] == 2
