"""``mimotron plan --auto``: search layouts, predict their step time, pick the fastest.

:mod:`~mimotron.planner.devices` holds the device constants, :mod:`~mimotron.planner.cost`
the step-time model, :mod:`~mimotron.planner.search` the search and
:mod:`~mimotron.planner.report` what the command prints.
"""
