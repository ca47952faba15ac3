"""The batch package's modules depend on each other in one direction only: no import cycle, counting
every import (module level, under TYPE_CHECKING and inside functions), read from the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill" / "batch"
PREFIX = "tokenmill.batch."


def batch_imports(path: Path) -> set[str]:
    """The batch modules ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:  # a relative import: resolve it against the package
                base = "tokenmill.batch" if node.level == 1 else "tokenmill"
                module = f"{base}.{node.module}"
            else:
                module = node.module
            if module.startswith(PREFIX):
                found.add(module[len(PREFIX):].split(".")[0])
            elif module == "tokenmill.batch":
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name[len(PREFIX):].split(".")[0] for a in node.names if a.name.startswith(PREFIX))
    found.discard(path.stem)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_batch_modules_import_without_cycles():
    graph = {p.stem: batch_imports(p) for p in PACKAGE.glob("*.py")}
    assert {"job", "requests", "openai_batch", "results"} <= set(graph)
    assert "requests" in graph["openai_batch"]  # the scan does see imports
    cycle = find_cycle(graph)
    assert cycle is None, "batch modules import each other: " + " -> ".join(cycle)
