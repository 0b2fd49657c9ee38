"""The config docs have one source: field docstrings, rendered into docs/configuration.md."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mimotron.config import MimoConfig, OptimizerConfig, ParallelConfig
from mimotron.config.docs import (
    END,
    START,
    config_classes,
    field_docs,
    main,
    missing_docs,
    render_table,
    update_readme,
)

README = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_config_field_has_a_docstring():
    assert OptimizerConfig in config_classes() and ParallelConfig in config_classes()
    assert missing_docs() == [], "config fields without a docstring (add one below the field)"


def test_readme_table_matches_the_dataclasses():
    text = README.read_text()
    assert START in text and END in text, f"docs/configuration.md lacks the markers {START} / {END}"
    table = text[text.index(START) + len(START):text.index(END)].strip()
    assert table == render_table(), "docs/configuration.md's table is out of date: run `make docs`"


def test_field_docs_reads_attribute_docstrings():
    docs = field_docs(OptimizerConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert docs["momentum"].startswith("SGD momentum")
    assert "\n    " not in docs["clip_grad"]  # cleaned of the class indentation


def test_table_has_a_row_per_key_with_its_default():
    table = render_table()
    rows = table.splitlines()[2:]
    n_keys = sum(len(dataclasses.fields(c)) for c in config_classes())
    # Every MimoConfig field but ``name`` and ``hf_path`` (its sections and ``modules``)
    # and ModuleConfig.parallel and .lora are tables, not rows; ModuleConfig.optimizer is
    # one row.
    containers = (len(dataclasses.fields(MimoConfig)) - 2) + 2
    assert len(rows) == n_keys - containers
    assert "| | `momentum` | `0.0` | SGD momentum" in table
    assert "| `scheduler` | `warmup_iters` | `0` |" in table
    assert "| | `min_lr` | unset |" in table
    assert "| | `no_decay` | `[\"norm\", \"bias\"]` |" in table


def test_update_readme_replaces_only_between_markers(tmp_path):
    text = f"intro\n{START}\nold table\n{END}\noutro\n"
    new = update_readme(text)
    assert new == f"intro\n{START}\n{render_table()}\n{END}\noutro\n"
    assert update_readme(new) == new
    with pytest.raises(ValueError, match="markers"):
        update_readme("no markers here")
    path = tmp_path / "README.md"
    path.write_text(text)
    assert main([str(path), "--check"]) == 1 and path.read_text() == text
    assert main([str(path)]) == 0 and path.read_text() == new
    assert main([str(path), "--check"]) == 0
