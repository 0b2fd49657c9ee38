"""The library's layers import downward only (docs/design.md, *Layers*).

Every module under ``mimotron/`` is parsed; each import of mimotron code, at module level
or inside a function (an import hidden in a function still ties the two files together),
is an edge. ``TYPE_CHECKING`` imports are not edges: they never run. The CLI may import
anything (its lazy imports keep the launcher light), and nothing below it imports it.

An edge from a lower layer to a higher one fails, and so does any cycle of files, unless
it is listed in ``KNOWN_UPWARD`` with the reason it is still there. That list only shrinks:
an entry that no longer matches an edge fails too, so a move that fixes one is recorded.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mimotron"

# Bottom to top: top-level names under mimotron/, or dotted module paths; a module belongs
# to the layer of its longest matching entry.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("names", "runtime", "lazy", "failures", "host_sync", "lifeline", "outputs", "run_files",
     "commcheck", "forked_ranks"),
    ("config", "config_schema", "config_numbers", "config_paths", "config_limits",
     "config_docs", "validation", "setup_rules"),
    ("data",),
    # The distributed primitives a model's forward calls (context-parallel positions and
    # key gathering, sequence-parallel regions, tensor-parallel plans, the vocabulary-
    # parallel embedding, virtual-pipeline chunks): below the models, beside nothing else
    # of parallel/.
    ("parallel.context_parallel", "parallel.context_attention", "parallel.sequence_parallel",
     "parallel.sequence_saved", "parallel.tensor_parallel", "parallel.vocab_embedding",
     "parallel.main_grad", "parallel.virtual_pipeline"),
    ("models",),
    ("parallel",),
    ("pipeline",),
    ("optim",),
    ("estimate",),
    ("checkpoint", "run_dir", "run_lock"),
    ("training",),
    ("planner", "dryrun", "generate", "demo"),
    ("cli", "__main__", "__init__"),
)

# (importer, imported): upward edges still to be moved, each with why it is there.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    """``{mimotron.x.y: path}`` of every module under ``package``."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module an import of ``name`` loads (the longest existing prefix)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class _Imports(ast.NodeVisitor):
    """Every mimotron import of one module: ``(target, line)``."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, int]] = []

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(a.name, node.lineno) for a in node.names
                       if a.name.startswith("mimotron")]  # fmt: skip

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.startswith("mimotron"):
            self.found += [(f"{source}.{a.name}", node.lineno) for a in node.names]


def import_edges(modules: dict[str, Path]) -> Iterator[tuple[str, str, int]]:
    """``(importer, imported, line)`` for every mimotron import in the package."""
    for name, path in modules.items():
        visitor = _Imports(name, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text()))
        for target, line in visitor.found:
            resolved = _resolve(target, modules)
            if resolved and resolved != name:
                yield name, resolved, line


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a module (``mimotron.x.y``)."""
    rel = module.partition(".")[2] or "__init__"
    found = [(len(entry), i) for i, layer in enumerate(LAYERS) for entry in layer
             if rel == entry or rel.startswith(entry + ".")]  # fmt: skip
    assert found, f"{module} is in no layer: add its top-level name to LAYERS"
    return max(found)[1]


def upward_edges(modules: dict[str, Path]) -> dict[tuple[str, str], int]:
    """Edges into a higher layer, with the first line, outside the CLI."""
    edges: dict[tuple[str, str], int] = {}
    for src, dst, line in import_edges(modules):
        if not src.startswith("mimotron.cli") and layer_of(dst) > layer_of(src):
            edges.setdefault((src, dst), line)
    return edges


def file_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _ in import_edges(modules):
        graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_module_is_in_a_layer() -> None:
    for name in _modules():
        layer_of(name)


def test_no_import_goes_up_a_layer() -> None:
    edges = upward_edges(_modules())
    new = {f"{a} -> {b} (line {line})" for (a, b), line in edges.items()
           if (a, b) not in KNOWN_UPWARD}  # fmt: skip
    assert new == set(), "imports into a higher layer (docs/design.md, Layers)"
    gone = set(KNOWN_UPWARD) - set(edges)
    assert gone == set(), "KNOWN_UPWARD lists edges that no longer exist: remove them"


def test_no_cycle_of_files() -> None:
    assert file_cycles(_modules()) == []


def test_no_library_module_imports_the_cli() -> None:
    modules = _modules()
    top = len(LAYERS) - 1
    bad = {(a, b) for a, b, _ in import_edges(modules)
           if b.startswith("mimotron.cli") and layer_of(a) < top}
    assert bad == set()


@pytest.mark.parametrize("where", ["module", "function"])
def test_a_planted_upward_import_fails(tmp_path: Path, where: str) -> None:
    """The check sees an upward import at module level and inside a function."""
    package = tmp_path / "mimotron"
    (package / "models").mkdir(parents=True)
    (package / "training").mkdir()
    for init in ("__init__.py", "models/__init__.py", "training/__init__.py"):
        (package / init).write_text("")
    (package / "training" / "loop.py").write_text("X = 1\n")
    body = ("from mimotron.training.loop import X\n" if where == "module" else
            "def f():\n    from mimotron.training import loop\n    return loop\n")
    (package / "models" / "blocks.py").write_text(body)
    edges = upward_edges(_modules(package))
    assert ("mimotron.models.blocks", "mimotron.training.loop") in edges


def imported_test_files(folder: Path) -> list[str]:
    """``file:line module`` for each import of a ``tests.test_*`` module by a file of
    ``folder`` (at module level or inside a function), absolute or relative."""
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # Every file of the folder is in the package ``tests``: ``.x`` is ``tests.x``.
                base = ".".join(filter(None, ["tests" if node.level else "", node.module]))
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {name}" for name in names
                      if name.startswith("tests.test_")]
    return found


def test_no_test_file_imports_another() -> None:
    """A helper that several test files share lives in a helper module (``tests/common.py``,
    ``tests/parity.py``, ...), never in a ``test_*.py`` file that others import."""
    assert imported_test_files(ROOT / "tests") == []
