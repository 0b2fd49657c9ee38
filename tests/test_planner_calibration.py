"""``mimotron plan --auto --calibrate``'s measurements: figures, JSON file, cache rules."""

from __future__ import annotations

import json
import math
import os

import pytest

from mimotron.cli.main import main
from mimotron.config import load_config
from mimotron.parallel.layout import check_layout
from mimotron.planner.calibration import (
    CALIBRATION_FILE,
    CalibrationOptions,
    calibrate_cached,
    core_probe_ranks,
    fingerprint,
    fingerprint_digest,
    fit_link,
    group_sizes,
    load_calibration,
    measure_host_cores,
)
from mimotron.planner.calibration_data import COLLECTIVES, Calibration
from mimotron.planner.cost import model_vocabulary, step_cost
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


def _cache(run_dir, calibration: dict, measured: dict) -> None:
    """A cache file as ``save_calibration`` writes it, holding ``calibration`` as given."""
    path = run_dir / CALIBRATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": fingerprint_digest(measured),
                                "measured": measured, "calibration": calibration}))


GOOD = {"device": "cpu", "module_seconds": {"language": [0.5, 0.0]},
        "module_fixed_seconds": {"language": [0.0, 0.0]},
        "collectives": {"all_reduce": {"2": [1e-4, 1e9]}}, "host_cores": 2, "samples": 8}


@pytest.mark.parametrize(("field", "value", "shown"), [
    (("module_seconds", "language", 0), math.nan, "module_seconds.language.forward=nan"),
    (("module_seconds", "language", 0), -0.5, "module_seconds.language.forward=-0.5"),
    (("module_seconds", "language", 0), 0.0, "module_seconds.language.forward=0.0"),
    (("module_seconds", "language", 1), math.inf, "module_seconds.language.backward=inf"),
    (("module_fixed_seconds", "language", 1), -1.0,
     "module_fixed_seconds.language.backward=-1.0"),
    (("collectives", "all_reduce", "2", 1), 0.0, "collectives.all_reduce.2.bytes_per_s=0.0"),
    (("collectives", "all_reduce", "2", 0), math.inf, "collectives.all_reduce.2.latency_s=inf"),
    (("host_cores",), math.inf, "host_cores=inf"),
    (("samples",), -8, "samples=-8"),
])
def test_cached_values_are_range_checked(tmp_path, field, value, shown) -> None:
    doc = json.loads(json.dumps(GOOD))
    at = doc
    for key in field[:-1]:
        at = at[key]
    at[field[-1]] = value
    measured = {"what": "this config"}
    _cache(tmp_path, GOOD, measured)
    assert load_calibration(tmp_path, fingerprint_digest(measured)).module_seconds == {
        "language": (0.5, 0.0)}  # a frozen module's backward of 0 is a measurement
    _cache(tmp_path, doc, measured)
    with pytest.raises(ValueError) as info:
        load_calibration(tmp_path, fingerprint_digest(measured))
    message = str(info.value)
    assert message.startswith(f"calibration cache {tmp_path / CALIBRATION_FILE}: "
                              f"calibration.{shown} is invalid")
    assert "\n" not in message and "delete the file to measure again" in message
    # Another config's cache is not read at all (it is measured again).
    assert load_calibration(tmp_path, "another") is None


def test_plan_auto_refuses_a_cache_out_of_range(tmp_path, capsys) -> None:
    overrides = [*SMALL_MODEL, f"log.dir={tmp_path}"]
    cfg = load_config(DIGITS, overrides)
    doc = json.loads(json.dumps(GOOD))
    doc["module_seconds"]["language"][0] = math.inf
    _cache(tmp_path, doc, fingerprint(cfg, 2, CalibrationOptions()))
    assert main(["plan", "--auto", str(DIGITS), *overrides, "--world", "2",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mimotron plan --auto: invalid calibration: calibration cache "
                   f"{tmp_path / CALIBRATION_FILE}: calibration.module_seconds.language."
                   "forward=inf is invalid: expected finite seconds > 0; delete the file "
                   "to measure again")


def test_step_time_of_huge_measured_times_is_finite() -> None:
    # A cache of 1e12 s a micro-batch is in range: the replay must still end (its clock
    # at 1e13 s no longer moves by the compute's float residue).
    cfg = load_config(DIGITS, SMALL_MODEL)
    huge = Calibration("cpu", {n: (1e12, 2e12) for n in cfg.modules}, samples=8)
    cost = step_cost(cfg, check_layout(cfg), device_table()["cpu"], huge)
    assert 1e12 < cost.total < math.inf


def test_core_probe_forks_a_bounded_number_of_ranks() -> None:
    # A 300-rank plan forked 300 probe ranks (1,202 processes on a 2-core host): now no
    # more than the cores (or 16), the figure scaled up to min(world, cores).
    started = []

    def spawn(world, fn, rounds, timeout_s):  # the probe's results, without forking
        started.append(world)
        # Rank 0 alone: 1 s a round; all at once: 2 s each, i.e. world / 2 cores' worth.
        return [([1.0] * rounds if rank == 0 else [], [2.0] * rounds) for rank in range(world)]

    assert measure_host_cores(300, 3, cores=2, spawn=spawn) == 1.0  # 2 ranks got 1 core
    assert measure_host_cores(300, 3, cores=64, spawn=spawn) == 32.0  # 16 got 8; x 64 / 16
    assert measure_host_cores(3, 1, cores=64, spawn=spawn) == 1.5  # the world itself
    assert started == [2, 16, 3]
    assert core_probe_ranks(10**6, cores=1) == 2 and core_probe_ranks(1, cores=8) == 1
