"""The package's layers stay layered: no import cycle between its subpackages (lazy imports
inside functions count), no kind package importing another kind, and the kinds reach hivemind's
internals only through `hivekeeper.hivemind_ext`."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "services" / "hivekeeper"
KINDS = ("swarm", "blocks", "experts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every hivekeeper module `path` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hivekeeper"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hivekeeper"))
    return found


def subpackage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in imports(path) & modules.keys():
            if subpackage(target) != subpackage(name):
                graph[subpackage(name)].add(subpackage(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_subpackages():
    assert cycles(package_graph()) == []


def test_no_kind_imports_another_kind():
    graph = package_graph()
    for kind in KINDS:
        assert not graph.get(kind, set()) & (set(KINDS) - {kind}), f"{kind} imports {graph[kind] & set(KINDS)}"


def test_no_type_ignore_between_kinds():
    for kind in KINDS:
        for path in (PACKAGE / kind).rglob("*.py"):
            assert "type: ignore[arg-type]" not in path.read_text(), path


def test_only_hivemind_ext_overrides_hivemind_internals():
    """Outside `hivekeeper.hivemind_ext`, no class derived from a hivemind class overrides one of
    its private methods, and nothing reaches into a P2P's daemon client."""
    import importlib

    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "hivemind_ext":
            continue
        tree = ast.parse(path.read_text())
        from_hivemind = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                         if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind")
                         for alias in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in from_hivemind:
                    module, name = from_hivemind[base.id]
                    inherited = set(dir(getattr(importlib.import_module(module), name)))
                    private = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                               and f.name.startswith("_") and not f.name.endswith("__") and f.name in inherited]
                    assert not private, f"{path}: {node.name} overrides hivemind's {private}"
        assert "._client." not in path.read_text(), path
