"""The configuration table of docs/configuration.md, generated from the config dataclasses.

Every config field carries an attribute docstring: a string literal right after the
field, as in torchtitan's ``JobConfig`` (:mod:`mimotron.config.schema`). Python keeps no
such docstring at runtime, so :func:`field_docs` reads it from the class source with
:mod:`ast`: an annotated assignment followed directly by a string-expression statement.
:func:`render_table` turns the fields into a Markdown table (table, key, default,
meaning = the docstring's first paragraph) and :func:`update_readme` writes it between
the ``<!-- config-table:start -->`` / ``<!-- config-table:end -->`` markers of
docs/configuration.md. ``make docs`` runs ``python -m mimotron.config.docs docs/configuration.md``;
``--check`` only reports whether the file is up to date. tests/test_config_docs.py
fails when the table differs from the generated one or a field has no
docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

from mimotron.config.lora import LoraConfig
from mimotron.config.schema import MimoConfig, ModuleConfig, ParallelConfig

START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"
HEADER = "| table | key | default | meaning |\n|---|---|---|---|"
# ModuleConfig fields that are tables of their own, not keys of [modules.<m>].
_MODULE_SUBTABLES = ("parallel", "optimizer", "lora")
_PER_MODULE_KEY = "any `[optimizer]` or `[scheduler]` key"


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source with ``ast``.

    Args:
        cls: a class whose fields are followed by string literals.

    Returns:
        Field name -> its docstring, cleaned with :func:`inspect.cleandoc`; fields
        without a docstring are absent.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef), f"{cls.__name__}: source is not a class"
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def config_classes() -> list[type]:
    """Every config dataclass: ``MimoConfig`` and the dataclasses nested in it."""
    seen: list[type] = []
    todo: list[type] = [MimoConfig, ModuleConfig]
    while todo:
        cls = todo.pop(0)
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        todo += [hints[f.name] for f in dataclasses.fields(cls)
                 if dataclasses.is_dataclass(hints[f.name])]
    return seen


def missing_docs() -> list[str]:
    """``Class.field`` for every config field without an attribute docstring."""
    return [f"{cls.__name__}.{f.name}" for cls in config_classes()
            for f in dataclasses.fields(cls) if f.name not in field_docs(cls)]


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line, as Markdown for a table cell."""
    first = doc.split("\n\n", 1)[0]
    return " ".join(first.split()).replace("``", "`").replace("|", "\\|")


def _toml(value: Any) -> str:
    """A default value as it would be written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else repr(value)
    return repr(value)


def _default(f: dataclasses.Field[Any]) -> str:
    """A field's default as a table cell: TOML in backticks, or ``unset`` for None."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    else:
        assert f.default_factory is not dataclasses.MISSING, f"{f.name} has no default"
        value = f.default_factory()
    return "unset" if value is None else f"`{_toml(value)}`"


def _rows(cls: type, table: str, skip: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """One row per field of ``cls``: (table, key, default, meaning)."""
    docs = field_docs(cls)
    return [(table, f"`{f.name}`", _default(f), summary(docs.get(f.name, "")))
            for f in dataclasses.fields(cls) if f.name not in skip]


def config_rows() -> list[tuple[str, ...]]:
    """The table's rows in ``MimoConfig`` order; ``modules`` expands to its four tables."""
    hints = typing.get_type_hints(MimoConfig)
    top_docs = field_docs(MimoConfig)
    module_docs = field_docs(ModuleConfig)
    rows: list[tuple[str, ...]] = []
    for f in dataclasses.fields(MimoConfig):
        if f.name == "modules":
            rows += _rows(ModuleConfig, "`modules.<m>`", skip=_MODULE_SUBTABLES)
            rows += _rows(ParallelConfig, "`modules.<m>.parallel`")
            rows += _rows(LoraConfig, "`modules.<m>.lora`")
            rows.append(("`modules.<m>.optimizer`", _PER_MODULE_KEY, "—",
                         summary(module_docs["optimizer"])))
        elif dataclasses.is_dataclass(hints[f.name]):
            rows += _rows(hints[f.name], f"`{f.name}`")
        else:
            rows.append(("(top)", f"`{f.name}`", _default(f), summary(top_docs[f.name])))
    return rows


def render_table() -> str:
    """The Markdown configuration table (the table name only on its first row)."""
    lines = [HEADER]
    previous = None
    for table, key, default, meaning in config_rows():
        shown = " " if table == previous else f" {table} "
        previous = table
        lines.append(f"|{shown}| {key} | {default} | {meaning} |")
    return "\n".join(lines)


def update_readme(text: str) -> str:
    """``text`` with the part between the table markers replaced by :func:`render_table`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README is invalid: expected the markers {START} ... {END} in order")
    return f"{text[:start]}{START}\n{render_table()}\n{text[end:]}"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) the configuration table of a README.

    Returns:
        0 when the file is (now) up to date; 1 with ``--check`` when it is not.
    """
    parser = argparse.ArgumentParser(prog="python -m mimotron.config.docs",
                                     description=__doc__.split("\n", 1)[0])
    parser.add_argument("readme", nargs="?", default="docs/configuration.md", type=Path)
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 when the table is out of date")
    args = parser.parse_args(argv)
    missing = missing_docs()
    if missing:
        print(f"config fields without a docstring: {', '.join(missing)}", file=sys.stderr)
        return 1
    text = args.readme.read_text()
    new = update_readme(text)
    if new == text:
        print(f"{args.readme}: configuration table is up to date")
        return 0
    if args.check:
        print(f"{args.readme}: configuration table is out of date; run `make docs`",
              file=sys.stderr)
        return 1
    args.readme.write_text(new)
    print(f"{args.readme}: configuration table written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
