"""The package's import graph: every module imports, and no two modules import each other,
directly or through others, at module level or inside a function (docs/architecture.md:
data flows one way, mesh + placements -> layout -> DTensor -> redistribute / inference)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "placements2jax"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports anywhere in its code (TYPE_CHECKING blocks aside)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                found.add(submodule if submodule in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name: str) -> None:
    if name.endswith("interop.torch"):
        pytest.importorskip("torch")
    importlib.import_module(name)


def test_the_import_graph_has_no_cycle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    # The package's __init__ gathers the public names; no module may import it back.
    importing_root = sorted(name for name, targets in graph.items() if "placements2jax" in targets)
    assert not importing_root, f"modules importing the package root: {importing_root}"
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                walk(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)


def test_the_core_never_imports_interop_or_the_command_line() -> None:
    core = ("placements", "mesh", "layout", "dtensor", "physical", "programs", "chunking", "foreign", "caches")
    for short in core:
        name = f"placements2jax.{short}"
        imported = _imports(name, MODULES[name])
        assert not {m for m in imported if m.startswith(("placements2jax.interop", "placements2jax.cli"))}, name
