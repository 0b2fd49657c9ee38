"""What ``mimotron train``'s launcher says when a signal stop meets a failure.

The verdict is computed from the launcher's result, the ranks' stop record and the
failure records (:func:`mimotron.cli.train._report`); these tests give it the records a
real run leaves in each case (the process-level tests are in ``test_faults_process.py``)
and check the line and the exit code. No processes: the cases where the timing of a
second signal decides (during the save, after it) cannot be produced on demand by a
launch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mimotron.checkpoint.files import write_latest
from mimotron.cli.launch import LaunchResult
from mimotron.cli.train import _report
from mimotron.config import load_config
from mimotron.failures import FailureRecord
from tests.common import DIGITS


@pytest.fixture
def cfg(tmp_path):
    return load_config(DIGITS, [f"log.dir={tmp_path}", f"checkpoint.dir={tmp_path}/ckpt"])


def _lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def test_a_failure_after_a_complete_stop_save_reports_the_save(cfg, capsys):
    """The stop saved iteration 6, then rank 1 failed on the way out (e.g. in the final
    eval): the report names both, never "not saved"."""
    Path(cfg.checkpoint_dir).mkdir()
    write_latest(Path(cfg.checkpoint_dir), 6)
    result = LaunchResult(exit_codes={0: 0, 1: 1}, signal_name="SIGTERM")
    records = [FailureRecord(0, 1, "error", "OSError: disk full", 1)]
    stop = {"signal": "SIGTERM", "iteration": 6, "saved": 6, "began": True}
    assert _report(result, set(), stop, records, 2, cfg) == 1
    (line,) = _lines(capsys)
    assert line.startswith(f"mimotron train: stopped by SIGTERM; saved iteration 6 to "
                           f"{cfg.checkpoint_dir}, then rank 1 failed (exit code 1): "
                           "OSError: disk full"), line


def test_a_signal_before_training_began_blames_no_rank(cfg, capsys):
    """Ranks that stopped in set-up leave a record with ``began`` false: nothing to save,
    exit 1, and no rank is named."""
    result = LaunchResult(exit_codes={0: 0, 1: 0}, signal_name="SIGTERM")
    stop = {"signal": "SIGTERM", "iteration": 0, "saved": None, "began": False}
    assert _report(result, set(), stop, [], 2, cfg) == 1
    assert _lines(capsys) == [
        "mimotron train: stopped by SIGTERM before training began: nothing to save"]


def test_a_save_aborted_by_a_second_sigint_is_reported_as_such(cfg, capsys):
    """A second SIGINT during the stop's save: each rank records an "aborted" outcome;
    the report says so instead of "exited with code 1 without reporting an error"."""
    result = LaunchResult(exit_codes={0: 1, 1: 1}, signal_name="SIGINT")
    summary = "aborted during the save of iteration 9 by a second SIGINT"
    records = [FailureRecord(0, 1, "aborted", summary, 1),
               FailureRecord(1, 0, "aborted", summary, 1)]
    assert _report(result, set(), None, records, 2, cfg) == 1
    (line,) = _lines(capsys)
    assert line.startswith(f"mimotron train: stopped by SIGINT, then {summary}: not saved ("),\
        line
    assert "without reporting" not in line
