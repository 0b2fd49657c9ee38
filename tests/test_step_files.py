"""One training step passes through at most ten engine files, in one direction.

``benchmarks/step_files.py`` traces one ``train_step`` of the digits demo on one rank
(its docstring defines engine files, leaves and jumps precisely). The step must enter at
most ten engine files, never re-enter a file it called out of (no cycle among its
jumps, so ``step.py`` is entered once), and every engine file must be one that
docs/design.md's "The data path of one training step" names, in a list of at most ten
files. The library itself never calls the Megatron-Bridge compatibility layer.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from mimotron.forked_ranks import run_ranks
from tests.common import ONE_RANK, SMALL_MODEL

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_files import StepTrace, traced_step  # noqa: E402

DESIGN = REPO / "docs" / "design.md"
STEP = "training/step.py"


def _documented_files() -> list[list[str]]:
    """The numbered list opening "The data path of one training step": files per item."""
    text = DESIGN.read_text()
    section = text.split("## The data path of one training step", 1)[1]
    listing = section.strip().split("\n\n")[1]  # the paragraph after the section's first
    items = re.split(r"\n(?=\d+\. )", listing.strip())
    assert all(re.match(r"\d+\. ", item) for item in items), listing
    return [re.findall(r"`([\w/]+\.py)`", item) for item in items]


def _trace(tmp_path: Path) -> StepTrace:
    (trace,) = run_ranks(1, traced_step, [*SMALL_MODEL, *ONE_RANK, f"log.dir={tmp_path}"],
                         timeout_s=180)
    return trace


def test_one_step_passes_through_at_most_ten_engine_files_in_one_direction(tmp_path):
    trace = _trace(tmp_path)
    assert trace.files[0] == STEP
    assert trace.cycles() == [], trace.cycles()
    assert not [j for j in trace.jumps if j[2] == STEP], "step.py is re-entered"
    assert len(trace.engine_files) <= 10, trace.engine_files
    documented = _documented_files()
    assert 0 < len(documented) <= 10
    named = {f for item in documented for f in item}
    missing = [f for f in trace.engine_files if f not in named]
    assert not missing, f"engine files the design's list does not name: {missing}"


def test_the_library_never_imports_the_compatibility_layer():
    importers = []
    for path in sorted((REPO / "mimotron").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.endswith("megatron_compat") for n in names):
                importers.append(str(path.relative_to(REPO)))
    assert importers == []
