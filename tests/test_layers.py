"""The package's layers stay layered: no import cycle between its subpackages (lazy imports
inside functions count), no kind package importing another kind, and the kinds reach hivemind's
internals only through `hivekeeper.hivemind_ext`.

The sources are parsed in a process of their own: CPython 3.11 keeps `ast.parse`'s recursion
count per interpreter, so a parse racing another thread of the test session (a leftover peer's)
fails with "AST constructor recursion depth mismatch"."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "services" / "hivekeeper"
KINDS = ("swarm", "blocks", "experts")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST) -> set[str]:
    """Every hivekeeper module a source imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hivekeeper"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hivekeeper"))
    return found


def subpackage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def hivemind_overrides(path: Path, tree: ast.AST) -> list[str]:
    """Private methods of hivemind classes that classes in `path` override."""
    from_hivemind = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hivemind")
                     for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in from_hivemind:
                module, name = from_hivemind[base.id]
                inherited = set(dir(getattr(importlib.import_module(module), name)))
                found += [f"{path.name}: {node.name}.{f.name}" for f in node.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("_")
                          and not f.name.endswith("__") and f.name in inherited]
    return found


def analyse() -> dict:
    trees = {module_name(p): (p, ast.parse(p.read_text())) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    overrides, client_calls = [], []
    for name, (path, tree) in trees.items():
        for target in imports(tree) & trees.keys():
            if subpackage(target) != subpackage(name):
                graph[subpackage(name)].add(subpackage(target))
        if path.parent.name != "hivemind_ext":
            overrides += hivemind_overrides(path, tree)
            client_calls += [str(path)] if "._client." in path.read_text() else []
    return {"graph": {k: sorted(v) for k, v in graph.items()}, "overrides": overrides, "clientCalls": client_calls}


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
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


@pytest.fixture(scope="module")
def analysis() -> dict:
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]


def test_no_import_cycle_between_subpackages(analysis):
    assert cycles(analysis["graph"]) == []


def test_no_kind_imports_another_kind(analysis):
    for kind in KINDS:
        others = set(analysis["graph"].get(kind, ())) & (set(KINDS) - {kind})
        assert not others, f"{kind} imports {others}"


def test_no_type_ignore_between_kinds():
    for kind in KINDS:
        for path in (PACKAGE / kind).rglob("*.py"):
            assert "type: ignore[arg-type]" not in path.read_text(), path


def test_only_hivemind_ext_overrides_hivemind_internals(analysis):
    """Outside `hivekeeper.hivemind_ext`, no class derived from a hivemind class overrides one of
    its private methods, and nothing reaches into a P2P's daemon client."""
    assert analysis["overrides"] == [] and analysis["clientCalls"] == []


if __name__ == "__main__":
    print(json.dumps(analyse()))
