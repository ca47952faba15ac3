"""docs/architecture.md names every module of the package, and every file it names exists.

A newcomer finds a file's room from the doc, so a module the doc never names is a room without a
door, and a path it names that is gone sends them nowhere. The doc names files three ways: a full
path (`tokenmill/engine/step.py`), a path below the package (`engine/step.py`), or a bare file
name beside its folder in the same table row or paragraph (`tokenmill/lora/request.py`,
`adapter.py`). Read from the text alone; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SEARCHED = ("tokenmill", "tests", "bench")  # where a path the doc names may live
FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
FOLDER = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+)(?![\w.-])")


def _entries(text: str) -> list[str]:
    """Table rows, bullets and paragraphs: the unit within which a bare file name finds its folder."""
    return [e for e in re.split(r"\n(?=[|-] )|\n\s*\n", text) if e.strip()]


def _resolve(path: str) -> Path | None:
    """A path with folders, as written at the repository root or below one of SEARCHED."""
    for base in (ROOT, *(ROOT / top for top in SEARCHED)):
        if (base / path).exists():
            return (base / path).resolve()
    return None


def _named_folders(entry: str) -> set[Path]:
    """The folders an entry names, directly or as the folder of a file path it names."""
    found = set()
    for path in FILE.findall(entry):
        if "/" in path and (resolved := _resolve(path)) is not None:
            found.add(resolved.parent)
    for folder in FOLDER.findall(entry):
        if (resolved := _resolve(folder)) is not None and resolved.is_dir():
            found.add(resolved)
    return found


def _named_modules(text: str) -> set[Path]:
    named = set()
    for entry in _entries(text):
        folders = _named_folders(entry)
        for path in FILE.findall(entry):
            if "/" in path:
                if (resolved := _resolve(path)) is not None:
                    named.add(resolved)
            else:
                named.update((folder / path).resolve() for folder in folders if (folder / path).exists())
    return named


def _defines_something(path: Path) -> bool:
    """An __init__.py that only re-exports (or is empty) has no room of its own to describe."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for node in tree.body)


def test_every_module_is_named():
    named = _named_modules(DOC.read_text())
    modules = [p.resolve() for p in sorted((ROOT / "tokenmill").rglob("*.py"))
               if p.name != "__init__.py" or _defines_something(p)]
    missing = [str(p.relative_to(ROOT)) for p in modules if p not in named]
    assert not missing, f"docs/architecture.md never names {missing}: add each to the row of its concept"


def test_every_named_file_exists():
    everywhere = {p.name for top in SEARCHED for p in (ROOT / top).rglob("*.py")}
    gone = sorted({path for path in FILE.findall(DOC.read_text())
                   if (_resolve(path) is None if "/" in path else path not in everywhere)})
    assert not gone, f"docs/architecture.md names files that do not exist: {gone}"
