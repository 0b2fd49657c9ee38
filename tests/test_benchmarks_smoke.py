"""Smoke test of the benchmark entry point: one tiny case end to end, plus its helpers.

The benchmark itself is not part of the test suite (it measures wall time); this only
checks that ``benchmarks/run.py`` runs and writes the figures it promises.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import Figure, interleave, summarize  # noqa: E402


def test_overhead_case_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "run.py"),
            "--quick",
            "--case",
            "overhead",
            "--size",
            "tiny",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| overhead | `overhead_ratio` |" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["options"] == {"quick": True, "size": "tiny", "reps": 5}
    assert set(doc["figures"]) == {"overhead_ratio", "host_syncs_per_step"}
    # Counted by the fake-device dry run: the loss-token count and the optimizer's world
    # sums are the step's only device-to-host reads on one colocated rank.
    assert doc["cases"]["overhead"]["figures"]["host_syncs_per_step"]["value"] == 2
    fig = doc["cases"]["overhead"]["figures"]["overhead_ratio"]
    assert fig["value"] > 0 and fig["min"] <= fig["max"] and fig["target"] == "<= 1.05"
    meas = doc["cases"]["overhead"]["measurements"]
    for side in ("mimotron_step_s", "plain_step_s"):
        assert len(meas[side]["values"]) == 5
        assert meas[side]["min"] <= meas[side]["median"] <= meas[side]["max"]
    # The plain loop trains the same model on the same batches: same losses.
    assert meas["max_loss_rel_diff"] < 1e-4


def test_reps_below_five_are_rejected(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--reps", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--reps=3 is invalid" in proc.stderr


@pytest.mark.parametrize(
    ("value", "target", "passed"),
    [
        (1.04, "<= 1.05", True),
        (1.06, "<= 1.05", False),
        (0.96, ">= 0.95", True),
        (0.9, ">= 0.95", False),
        (1.004, "<= 1.00", True),
        (2.0, "", None),
        (1.254, "0.80-1.25", True),
        (1.26, "0.80-1.25", False),
        (0.79, "0.80-1.25", False),
    ],
)
def test_figure_target(value, target, passed):
    assert Figure("x", value, target).passed is passed


def test_interleave_alternates_order_and_summarize():
    calls: list[str] = []
    out = interleave(
        4, {"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 3.0}
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [1.0] * 4, "b": [3.0] * 4}
    s = summarize([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)


def test_median_interval_brackets_the_median():
    from benchmarks.overlap import median_interval

    assert median_interval([3.0]) == (3.0, 3.0)
    values = [float(v) for v in range(40, 0, -1)]
    lo, hi = median_interval(values)
    assert lo < 20.5 < hi and (lo, hi) != (1.0, 40.0)  # narrower than min-max


def test_gpu_check_cpu_smoke(tmp_path):
    """``benchmarks/gpu_check.py --cpu-smoke``: the training paths run on the CPU at a tiny
    size, the figures land in the JSON, and the GPU parts say why they were skipped."""
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke",
         "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mode"] == "cpu-smoke"
    thr = doc["parts"]["throughput"]
    assert thr["status"] == "ok", thr.get("reason")
    assert thr["measured"]["tokens_per_second"] > 0
    assert thr["measured"]["model_flops_per_iteration"] > 0
    assert thr["plan"]["estimate_bytes"] > 0 and thr["plan"]["total_params"] > 0
    cmp = doc["parts"]["cpu_vs_gpu"]
    assert len(cmp["cpu_losses"]) == 3 and all(0 < x < 100 for x in cmp["cpu_losses"])
    layouts = doc["parts"]["layouts"]["status"]
    assert cmp["status"].startswith("skipped: ") and layouts.startswith("skipped: ")
    if doc["gpu"]["count"] == 0:
        assert cmp["status"] == layouts == "skipped: no GPU"
        assert "| cpu_vs_gpu | skipped: no GPU |" in proc.stdout


def test_gpu_check_config_is_about_1b_and_losses_compare():
    from benchmarks.gpu_check import CONFIG_1B, compare_losses, peak_tflops, plan_numbers

    plan = plan_numbers(CONFIG_1B, [])
    assert 0.9e9 <= plan["total_params"] <= 1.1e9, plan["params"]
    assert set(plan["params"]) == {"vision", "language"}
    assert compare_losses([4.01, 3.9], [4.0, 3.91], 0.02)["ok"]
    assert not compare_losses([4.2, 3.9], [4.0, 3.9], 0.02)["ok"]
    assert not compare_losses([4.0], [4.0, 3.9], 0.02)["ok"]
    assert not compare_losses([float("nan")], [4.0], 0.02)["ok"]
    assert peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", None) == 312.0
    assert peak_tflops("some GPU", None) is None and peak_tflops("x", 100.0) == 100.0
