"""The import graph keeps its layers: read from the source with `ast` (nothing is imported).

For the layers every `import tokenmill...` counts, lazy ones inside functions and TYPE_CHECKING
ones too: a dependency is a dependency whether or not it runs at import time. Two modules stand
apart from their packages: the seam between scheduler and runner (engine/step.py) and the
pooling settings (pooling/config.py, resolved with the engine's settings before any engine runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"
SEAM = "tokenmill.engine.step"  # what the scheduler hands the runner and gets back
POOLING_CONFIG = "tokenmill.pooling.config"
# Packages whose modules must not import each other in a circle (the batch job's are its own).
ACYCLIC = ("tokenmill.engine", "tokenmill.worker", "tokenmill.distributed", "tokenmill.pooling", "tokenmill.config",
           "tokenmill.llm", "tokenmill.engine_factory")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _walk(node: ast.AST, type_checking: bool):
    for child in ast.iter_child_nodes(node):
        if type_checking or not _is_type_checking_block(child):
            yield child
            yield from _walk(child, type_checking)


def _imports(path: Path, type_checking: bool = True) -> set[str]:
    """The tokenmill modules a file imports (``type_checking=False``: leave out TYPE_CHECKING blocks)."""
    found = set()
    for node in _walk(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == "tokenmill" or name.startswith("tokenmill."))
    return found


GRAPH = {_module_name(path): _imports(path) for path in PACKAGE.rglob("*.py")}
RUNTIME_GRAPH = {_module_name(path): _imports(path, type_checking=False) for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> str:
    """A subpackage (tokenmill.engine), a top-level module (tokenmill.config), or a module standing apart."""
    return module if module in (SEAM, POOLING_CONFIG) else ".".join(module.split(".")[:2])


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, ()):
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

    for node in list(edges):
        if node not in index:
            visit(node)
    return found


def _layer_edges(layers: set[str]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        for target in imported:
            a, b = _layer(module), _layer(target)
            if a != b and a in layers and b in layers:
                edges.setdefault(a, set()).add(b)
    return edges


def test_the_seam_is_a_leaf():
    assert GRAPH[SEAM] <= {"tokenmill.sampling_params"}, GRAPH[SEAM]


def test_workers_know_only_the_seam_of_the_engine():
    for module, imported in GRAPH.items():
        if module.startswith("tokenmill.worker."):
            engine = {m for m in imported if m.startswith("tokenmill.engine")}
            assert engine <= {SEAM}, f"{module} imports {sorted(engine - {SEAM})}"


def test_the_generation_engine_knows_neither_workers_nor_pooling():
    for module, imported in GRAPH.items():
        if module.startswith("tokenmill.engine."):
            bad = {m for m in imported if _layer(m) in ("tokenmill.worker", "tokenmill.pooling", "tokenmill.llm")}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_engine_config_and_pooling_config_do_not_import_each_other():
    assert "tokenmill.config" not in GRAPH[POOLING_CONFIG]
    assert not any(_layer(m) == "tokenmill.pooling" for m in GRAPH["tokenmill.config"])


def test_no_cycles_between_the_engine_layers():
    assert _cycles(_layer_edges({SEAM, POOLING_CONFIG, *ACYCLIC})) == []


def test_no_module_imports_itself_back_at_run_time():
    """(Dataclasses that name each other's types under TYPE_CHECKING are fine.)"""
    mine = [cycle for cycle in _cycles(RUNTIME_GRAPH) if any(_layer(m) in ACYCLIC for m in cycle)]
    assert mine == []
