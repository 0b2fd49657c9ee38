"""``mimotron plan --auto``: search layouts, predict their step time, pick the fastest.

:mod:`~mimotron.planner.devices` holds the device constants, :mod:`~mimotron.planner.cost`
the step-time model (priced from the constants or from what
:mod:`~mimotron.planner.calibration` measured, :mod:`~mimotron.planner.calibration_data`),
:mod:`~mimotron.planner.search` the search, :mod:`~mimotron.planner.fit` whether each
rank's memory estimate fits a device and :mod:`~mimotron.planner.report` what the
command prints.
"""
