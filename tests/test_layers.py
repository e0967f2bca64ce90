"""Imports run one way: every module of structgen/ and structgen_server/ is read with `ast`
(module-level and function-level imports alike) and checked against the layers

    errors(0) <- schema(1) <- types(2) <- grammar(3) <- engine(4)
    <- api / remote / tools / completion(5) <- server / cli(6)

where a module may import its own layer and those below it, never one above; and the module
graph has no import circle. Imports under `if TYPE_CHECKING:` are left out of both checks: they
never run, so they order nothing at import time. `structgen/__init__.py` is exempt (it
re-exports the public API from every layer). An import `a.b.c` counts as an edge to the module
it names, not to its parent packages.

What the re-layout (issue 28) has not removed yet is listed in `KNOWN_VIOLATIONS`; the tests
fail on a violation not in that list AND on an entry that no longer occurs, so the list only
shrinks."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("structgen", "structgen_server")
EXEMPT = {"structgen"}  # the package's __init__ re-exports every layer on purpose

LAYER_NAMES = ("errors", "schema", "types", "grammar", "engine", "api", "server")


@dataclass(frozen=True)
class Known:
    """An import the re-layout has not removed yet: `importer` imports `imported` against the
    layers or on a circle, `why` it is there, and the issue item that removes it."""

    importer: str
    imported: str
    why: str
    removed_by: str


# Each entry breaks a layer or closes a circle today; delete it once its import is gone.
KNOWN_VIOLATIONS: tuple[Known, ...] = ()


def layer_of(module: str) -> int:
    """The layer index of a module (see the module docstring); unassigned modules fail."""
    parts = module.split(".")
    if module in ("structgen.errors", "structgen.csrc"):  # csrc: where the native sources lie
        return 0
    if parts[:2] == ["structgen", "schema"]:
        return 1
    if module in ("structgen.types", "structgen.arguments", "structgen.sampling"):
        return 2
    if parts[:2] == ["structgen", "grammar"]:
        return 3
    if parts[:2] == ["structgen", "engine"]:
        return 4
    if module in ("structgen.api", "structgen.async_bridge", "structgen.remote", "structgen.tools", "structgen.completion",
                  "structgen.tool_format", "structgen.tool_runs", "structgen.docstrings", "structgen.repair",
                  "structgen.prompt_encoding") or parts[:2] == ["structgen", "partial"]:
        return 5
    if parts[0] == "structgen_server" or module in ("structgen.cli", "structgen.__main__"):
        return 6
    raise AssertionError(f"{module} has no layer: add it to layer_of() in tests/test_layers.py")


def module_files() -> dict[str, Path]:
    """Every module of the two packages by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node` that can run, at any depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:  # the else branch of `if TYPE_CHECKING:` does run
                yield from _runtime_imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _runtime_imports(child)


def _targets(stmt: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: dict[str, Path]) -> Iterator[str]:
    """The project modules one import statement names."""
    if isinstance(stmt, ast.Import):
        yield from (alias.name for alias in stmt.names if alias.name in modules)
        return
    base = stmt.module or ""
    if stmt.level:  # relative: resolved against the importer's package
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = package[: len(package) - (stmt.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    for alias in stmt.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:  # `from pkg import submodule`
            yield submodule
        elif base in modules:
            yield base


def import_graph() -> dict[str, set[str]]:
    """importer -> the project modules it imports at run time (TYPE_CHECKING left out)."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {
            target
            for stmt in _runtime_imports(tree)
            for target in _targets(stmt, name, is_package, modules)
            if target != name
        }
    return graph


def layer_violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        (importer, imported)
        for importer, imports in graph.items() if importer not in EXEMPT
        for imported in imports if imported not in EXEMPT and layer_of(importer) < layer_of(imported)
    }  # fmt: skip


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components with more than one module: each one is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _without_exempt(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in bs if b not in EXEMPT} for a, bs in graph.items() if a not in EXEMPT}


def _describe(edges: set[tuple[str, str]]) -> str:
    return "\n".join(
        f"  {a} ({LAYER_NAMES[layer_of(a)]}) imports {b} ({LAYER_NAMES[layer_of(b)]})"
        for a, b in sorted(edges)
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _without_exempt(import_graph())


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer_of(module)


def test_no_module_imports_a_higher_layer(graph):
    known = {(k.importer, k.imported) for k in KNOWN_VIOLATIONS}
    new = layer_violations(graph) - known
    assert not new, (
        "imports against the layers errors <- schema <- types <- grammar <- engine <- "
        "api/remote/tools <- server/cli; move the code to the lower module, or import under "
        "`if TYPE_CHECKING:` where only annotations need it:\n" + _describe(new)
    )


def test_no_import_circle_outside_the_known_list(graph):
    known = {(k.importer, k.imported) for k in KNOWN_VIOLATIONS}
    pruned = {a: {b for b in bs if (a, b) not in known} for a, bs in graph.items()}
    circles = strongly_connected(pruned)
    assert not circles, "import circles (each set imports itself around): " + "; ".join(
        " <-> ".join(sorted(c)) for c in circles
    )


def test_every_known_violation_still_occurs(graph):
    """An entry whose import is gone, or no longer breaks a layer nor closes a circle, must go."""
    against_layers = layer_violations(graph)
    on_circle = {frozenset(c) for c in strongly_connected(graph)}
    stale = [
        k for k in KNOWN_VIOLATIONS
        if (k.importer, k.imported) not in against_layers
        and not any({k.importer, k.imported} <= c for c in on_circle)
    ]  # fmt: skip
    assert not stale, "remove from KNOWN_VIOLATIONS (fixed): " + ", ".join(
        f"{k.importer} -> {k.imported}" for k in stale
    )


def test_the_checker_sees_function_level_imports_and_skips_type_checking():
    """The reader itself on a small module: a function's import counts, TYPE_CHECKING's don't."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from structgen.api import LLM\n"
        "else:\n    import structgen.errors\n"
        "def f():\n    from structgen.engine import engine\n"
    )
    modules = module_files()
    tree = ast.parse(source)
    found = {t for s in _runtime_imports(tree) for t in _targets(s, "structgen.x", False, modules)}
    assert found == {"structgen.errors", "structgen.engine.engine"}
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
