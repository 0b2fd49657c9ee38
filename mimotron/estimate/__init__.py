"""Estimates computed from the config alone: memory per rank, activation terms,
pipeline in-flight counts and FLOPs.

``mimotron plan``, the layout planner and the training metrics (MFU) import these
downward; nothing here builds a process group or runs a step.
"""
