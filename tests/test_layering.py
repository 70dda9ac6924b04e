"""The packages form the DAG that docs/architecture.md states, and no module closes an import circle.

Every import counts, those inside functions included; imports under `if TYPE_CHECKING:` do not.
Entry points run with `python -m` (a package's `__main__`, the `bench` modules) may import any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Top to bottom: a package may import only packages after it.
LAYERS = ["deploy", "cluster", "openai_api", "actors", "engine", "kernels"]
ENTRY_POINTS = {"cluster.__main__", "cluster.bench", "engine.__main__", "engine.bench", "engine.gpu_bench"}
# SGLang's own pair: a ScheduleBatch builds its ForwardBatch, which reads the batch it came from.
ALLOWED_CIRCLES = [{"engine.forward_batch", "engine.schedule_batch"}]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in LAYERS for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported_names(path: Path, name: str) -> list[tuple[str, int]]:
    """(imported dotted name, line) for every import in the file, outside `if TYPE_CHECKING:`."""
    found: list[tuple[str, int]] = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            test = node.test
            if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.extend((alias.name, node.lineno) for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            found.extend((f"{module}.{alias.name}", node.lineno) for alias in node.names)

    Visitor().visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: line}; `from pkg import name` resolves to pkg.name
    when that is a module, else to pkg."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        targets: dict[str, int] = {}
        for imported, line in imported_names(path, name):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                targets.setdefault(".".join(parts), line)
        graph[name] = targets
    return graph


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for name, targets in graph.items():
        if name in ENTRY_POINTS:
            continue
        for target, line in targets.items():
            if LAYERS.index(target.split(".")[0]) < LAYERS.index(name.split(".")[0]):
                out.append(f"{name}:{line} imports {target}")
    return sorted(out)


def circles(graph: dict[str, dict[str, int]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_packages_import_only_layers_below():
    assert upward_imports(import_graph(project_modules())) == []


def test_no_module_closes_an_import_circle():
    assert [c for c in circles(import_graph(project_modules())) if c not in ALLOWED_CIRCLES] == []


@pytest.mark.parametrize("source, expected", [
    ("def f():\n    from deploy.app import AppArgs\n", ["engine.x:2 imports deploy.app"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deploy.app import AppArgs\n", []),
    ("import kernels.moe\n", []),
])
def test_the_checker_sees_imports_inside_functions_and_skips_type_checking(tmp_path, source, expected):
    modules = {}
    for name, text in {"engine.x": source, "deploy.app": "", "kernels.moe": ""}.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    assert upward_imports(import_graph(modules)) == expected


def test_the_checker_finds_a_circle():
    graph = {"a.x": {"a.y": 1}, "a.y": {"a.z": 1}, "a.z": {"a.x": 1}, "a.w": {"a.x": 1}}
    assert circles(graph) == [{"a.x", "a.y", "a.z"}]
