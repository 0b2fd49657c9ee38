"""mimotron benchmarks: ``python benchmarks/run.py [--quick] [--json OUT]`` (see run.py)."""
