"""The import graph (issue 37): no circles, kernels import no engine, the engine core imports no family.

Read from the source with `ast` (every import, also those inside functions), not by importing, so a
lazy import that hides a circle at run time still counts.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fluxlab"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """fluxlab module -> the fluxlab modules it imports (`from pkg import mod` counts as pkg.mod when mod is one)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_package_parent(importer: str, imported: str) -> bool:
    # `import fluxlab.a.b` runs fluxlab/__init__ and fluxlab/a/__init__: a package's own __init__ is not an edge back
    return importer.startswith(imported + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    g = import_graph()
    return {m: {t for t in ts if not _is_package_parent(m, t)} for m, ts in g.items()}


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_kernels_import_no_engine(graph):
    upward = {(m, t) for m, ts in graph.items() if m.startswith("fluxlab.kernels") for t in ts
              if not t.startswith("fluxlab.kernels")}
    assert upward == set()


def test_engine_core_imports_no_family(graph):
    """The core reaches a family through fluxlab.models.registry only (it names modules as strings)."""
    core = ("fluxlab.engine", "fluxlab.kernels")
    into_family = {(m, t) for m, ts in graph.items() if m.startswith(core) for t in ts
                   if t.startswith("fluxlab.models") and t not in ("fluxlab.models", "fluxlab.models.registry")}
    assert into_family == set()
