"""``mimotron plan --auto --calibrate``'s measurements: figures, JSON file, cache rules."""

from __future__ import annotations

import json
import math
import os

import pytest

from mimotron.config import load_config
from mimotron.planner.calibration import (
    CALIBRATION_FILE,
    CalibrationOptions,
    calibrate_cached,
    fit_link,
    group_sizes,
    load_calibration,
)
from mimotron.planner.cost import COLLECTIVES, Calibration, model_vocabulary
from mimotron.planner.devices import device_table
from mimotron.planner.terms import chunk_compute, tp_efficiency
from tests.common import DIGITS, SMALL_MODEL

# Few repeats and two buffer sizes: the figures are checked for sense, not precision.
QUICK = CalibrationOptions(warmup=1, repeats=2, comm_rounds=2, comm_calls=1, core_rounds=1,
                           buffer_bytes=(1024, 64 * 1024))


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    points = [(b, 2e-4 + b / 5e8) for b in (1e3, 1e5, 1e6, 4e6)]
    link = fit_link(points)
    assert link.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert link.bytes_per_s == pytest.approx(5e8, rel=1e-6)
    # Noise that makes time shrink with bytes still gives a physical (positive) link.
    noisy = fit_link([(1e3, 3e-3), (1e6, 1e-3)])
    assert noisy.latency_s > 0 and noisy.bytes_per_s > 0
    with pytest.raises(ValueError, match="2 distinct buffer sizes"):
        fit_link([(1e3, 1e-3), (1e3, 2e-3)])


def test_group_sizes() -> None:
    assert group_sizes(1) == []
    assert group_sizes(4) == [2, 4]
    assert group_sizes(6) == [2, 4, 6]
    assert group_sizes(64, max_ranks=8) == [2, 4, 8]


def test_calibration_figures_file_and_cache(tmp_path) -> None:
    run_dir = tmp_path / "run"
    cfg = load_config(DIGITS, [*SMALL_MODEL, f"log.dir={run_dir}"])
    cal, reused = calibrate_cached(cfg, 2, QUICK)
    assert not reused
    assert set(cal.module_seconds) == {"vision", "audio", "language"}
    for name, (fwd, bwd) in cal.module_seconds.items():
        assert 0 < fwd < 10 and 0 < bwd < 10, (name, fwd, bwd)
    # The part that does not scale with the samples: within [0, the time].
    assert set(cal.module_fixed_seconds) == set(cal.module_seconds)
    for name, fixed in cal.module_fixed_seconds.items():
        for part, whole in zip(fixed, cal.module_seconds[name], strict=True):
            assert 0 <= part <= whole, (name, fixed)
    assert set(cal.collectives) == set(COLLECTIVES)
    for kind, by_size in cal.collectives.items():
        link = by_size[2]
        assert 0 < link.latency_s < 1 and 0 < link.bytes_per_s < math.inf, (kind, link)
        assert link.seconds(2**20) > link.seconds(0)
    # The cores 2 busy ranks got: at least 1, at most what this process may use.
    assert cal.device == "cpu" and 1 <= cal.host_cores <= len(os.sched_getaffinity(0))

    # The file: the calibration, read back equal, with what was measured.
    path = run_dir / CALIBRATION_FILE
    doc = json.loads(path.read_text())
    assert doc["measured"]["train"]["micro_batch_size"] == 8
    assert Calibration.from_json(cal.to_json()) == cal
    assert load_calibration(run_dir) == cal
    written = path.stat().st_mtime_ns

    # Another layout of the same modules: the cache is reused, the file untouched.
    moved = load_config(DIGITS, [*SMALL_MODEL, f"log.dir={run_dir}",
                                 "modules.language.parallel.data=1"])
    again, reused = calibrate_cached(moved, 2, QUICK)
    assert reused and again == cal and path.stat().st_mtime_ns == written
    assert load_calibration(run_dir, doc["fingerprint"]) == cal
    assert load_calibration(run_dir, "another") is None

    # A module's shape changed: measured again, the file replaced.
    wider = load_config(DIGITS, [*SMALL_MODEL, f"log.dir={run_dir}",
                                 "modules.language.hidden_size=96"])
    fresh, reused = calibrate_cached(wider, 2, QUICK)
    assert not reused
    assert json.loads(path.read_text())["fingerprint"] != doc["fingerprint"]
    assert json.loads(path.read_text())["measured"]["modules"]["language"]["hidden_size"] == 96
    assert load_calibration(run_dir) == fresh

    # A damaged file is no calibration (measured again by the next --calibrate).
    path.write_text("{not json")
    assert load_calibration(run_dir) is None


def test_fixed_seconds_are_paid_whole_per_micro_batch() -> None:
    """The measured time's fixed part is paid by every rank per micro-batch; the rest is
    shared by data (samples) and tensor (FLOPs) parallelism."""
    fixed = Calibration("cpu", {"language": (1.0, 2.0)}, samples=8,
                        module_fixed_seconds={"language": (0.2, 0.4)})
    scaled = Calibration("cpu", {"language": (1.0, 2.0)}, samples=8)
    cpu = device_table()["cpu"]
    for overrides, share, rate in (([], 1.0, 1.0), (["modules.language.parallel.data=2"], 0.5, 1.0),
                                   (["modules.language.parallel.tensor=2"], 1.0,
                                    2 * tp_efficiency(2))):
        cfg = load_config(DIGITS, [*SMALL_MODEL, "modules.language.parallel.data=1", *overrides])
        vocab = model_vocabulary(cfg)
        f, b = chunk_compute(cfg, "language", 0, 0, vocab, cpu, fixed)
        assert f == pytest.approx(0.8 * share / rate + 0.2)
        assert b == pytest.approx(1.6 * share / rate + 0.4)
        f, b = chunk_compute(cfg, "language", 0, 0, vocab, cpu, scaled)
        assert (f, b) == pytest.approx((1.0 * share / rate, 2.0 * share / rate))
    assert Calibration.from_json(fixed.to_json()) == fixed
