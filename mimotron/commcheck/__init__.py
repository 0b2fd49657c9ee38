"""Communication checks: record each rank's calls, replay them under NCCL's rules."""

from mimotron.commcheck.record import (
           CHECK_ENV,
           TRACE_ENV,
           CommRecorder,
           finish_recording,
           start_recording,
)
from mimotron.commcheck.replay import ReplayReport, replay, replay_folder

__all__ = ["CHECK_ENV", "TRACE_ENV", "CommRecorder", "ReplayReport", "finish_recording",
           "replay", "replay_folder", "start_recording"]
