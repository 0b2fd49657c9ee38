"""What the user docs name exists: files and folders of the repository, link targets and
their anchors, and `make` targets.

The README and docs/ are tried by new users as they read; a config, benchmark or test
they name that is not in the repository, a link that resolves to nothing (a link inside
docs/ is relative to docs/) or a `make` target the Makefile lacks is a broken promise.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A repository path as the docs write it: one of the project's top folders, then a path.
_PATH = re.compile(r"(?<![\w./-])((?:configs|docs|benchmarks|tests|mimotron|examples)/"
                   r"[A-Za-z0-9_./-]*[A-Za-z0-9_/])(\*?)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MAKE = re.compile(r"(?:^|`|\$ |\n)make ([a-z][a-z-]*)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\s-]", "", text)
    return text.replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in doc.read_text().splitlines()
            if line.startswith("#")}  # fmt: skip


def _code(text: str) -> str:
    """The code spans and fenced blocks of a Markdown text, joined by newlines."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return "\n".join(fenced + spans)


def _missing_paths(doc: Path) -> list[str]:
    missing = []
    for match in _PATH.finditer(doc.read_text()):
        name, glob = match.group(1).rstrip("."), match.group(2)
        found = any(ROOT.glob(name + "*")) if glob or name.endswith("_") else (ROOT / name).exists()
        if not found:
            missing.append(name + glob)
    return missing


def _broken_links(doc: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here (no network)
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        dangling = bool(anchor) and file.suffix == ".md" and anchor not in _anchors(file)
        if not file.exists() or dangling:
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_doc_names_exists(doc: Path) -> None:
    assert _missing_paths(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_link_resolves_from_the_doc_folder(doc: Path) -> None:
    assert _broken_links(doc) == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_make_target_a_doc_names_is_in_the_makefile(doc: Path) -> None:
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(_MAKE.findall(_code(doc.read_text())))
    assert named - targets == set()


def test_the_checks_see_a_missing_file_a_broken_link_and_an_unknown_target(tmp_path: Path
                                                                           ) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("Run `make demo-nothing` with configs/no_such.toml, see "
                   "[there](missing.md) and [here](page.md#no-such-heading).\n# A heading\n")
    assert _missing_paths(doc) == ["configs/no_such.toml"]
    assert _broken_links(doc) == ["missing.md", "page.md#no-such-heading"]
    assert _MAKE.findall(_code(doc.read_text())) == ["demo-nothing"]
    assert _anchors(doc) == {"a-heading"}
