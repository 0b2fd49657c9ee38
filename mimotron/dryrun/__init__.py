"""The fake-device dry run: a rank's real training step on a fake accelerator.

See :mod:`mimotron.dryrun.harness` (:func:`dry_run`) and :mod:`mimotron.dryrun.tracker`
(device mixes, host reads). docs/design.md, "Device placement and the fake-device dry
run", describes what it proves.
"""

from mimotron.dryrun.harness import DryRunReport, StepReport, dry_run
from mimotron.dryrun.tracker import DeviceMixError, DeviceTracker, DryRunError

__all__ = ["DeviceMixError", "DeviceTracker", "DryRunError", "DryRunReport", "StepReport",
           "dry_run"]
