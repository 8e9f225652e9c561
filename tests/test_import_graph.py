"""The import graph of python/freetoken, computed from the source with ``ast``: every import
statement counts, those inside functions too, except those under ``if TYPE_CHECKING:``.
The package's parts (subpackages and top-level modules) import one way: no cycle between
them, and the lower layers import nothing above them (docs/architecture.md). A ``__main__``
module is a part of its own: ``python -m`` runs it and nothing imports it, so it is in no
cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "python" / "freetoken"
PKG = "freetoken"

#: What each lower layer must not import.
FORBIDDEN = {
    "runtime/": {"models/", "engine/", "cli/", "server/", "llm"},
    "models/": {"engine/", "cli/", "server/", "llm"},
    "engine/": {"cli/", "server/", "llm"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        yield from _imports(node)


def _targets(
    module: str, is_pkg: bool, node: ast.Import | ast.ImportFrom, known: set[str]
) -> set[str]:
    """The freetoken modules an import statement loads."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name.split(".")[0] == PKG}
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_pkg else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    if base.split(".")[0] != PKG:
        return set()
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in known or alias.name == "_core" else base)
    return out


def _part(module: str) -> str:
    """The part of the package a module belongs to: ``name/`` for a subpackage, ``name`` for
    a top-level module, ``freetoken`` for the package's own ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1:
        return PKG
    if parts[-1] == "__main__":
        return module
    first = parts[1]
    return f"{first}/" if (ROOT / first).is_dir() else first


def _graph() -> dict[str, set[str]]:
    """Edges between parts, from every module's imports."""
    mods = _modules()
    known = set(mods)
    edges: dict[str, set[str]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        src = _part(module)
        edges.setdefault(src, set())
        for node in _imports(tree):
            for target in _targets(module, path.name == "__init__.py", node, known):
                dst = _part(target)
                if dst != src:
                    edges[src].add(dst)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_of_every_kind() -> None:
    """The parser finds top-level, in-function and relative imports and skips TYPE_CHECKING
    ones (a graph that saw nothing would pass every check below)."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import freetoken.errors\n"
        "from freetoken.runtime import moe\n"
        "if TYPE_CHECKING:\n    from freetoken.llm import LLM\n"
        "def f():\n    from freetoken.engine.placement import place_on_gpu\n"
        "    from . import layers\n"
    )
    known = set(_modules())
    found = set()
    for node in _imports(tree):
        found |= _targets("freetoken.models.x", False, node, known)
    assert found == {
        "freetoken.errors",
        "freetoken.runtime.moe",
        "freetoken.engine.placement",
        "freetoken.models.layers",
    }
    edges = _graph()
    assert "runtime/" in edges["models/"] and "engine/" in edges["llm"]


def test_no_cycle_between_the_package_parts() -> None:
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_import_nothing_above_them(layer: str) -> None:
    assert _graph()[layer] & FORBIDDEN[layer] == set()
