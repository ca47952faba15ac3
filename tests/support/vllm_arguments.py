"""vLLM's `LLM(...)` / `EngineArgs` keyword arguments and their defaults, read from vLLM's own source.

tests/test_engine_args_table.py checks tokenmill's table against them. vLLM is not importable
here (its compiled parts need its own torch and Python), so its source is read with `ast`:
`EngineArgs`' annotated fields and `LLM.__init__`'s keyword parameters, each default evaluated
when it is a literal, a `default_factory` of an empty container, or a field of one of vLLM's
config classes that is itself a literal. A default that cannot be evaluated that way is recorded
as unknown, not guessed.

The snapshot vllm_0_26_arguments.json keeps the test able to fail where vLLM's source is not at
hand; regenerate it from a vLLM source tree with
``python tests/support/vllm_arguments.py /path/to/site-packages/vllm``.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).with_name("vllm_0_26_arguments.json")
UNKNOWN = "<unknown>"
_FACTORIES = {"dict": dict, "list": list, "set": set, "tuple": tuple}


def read_arguments(root: Path) -> dict[str, Any]:
    """Every argument name of vLLM at ``root`` (the `vllm` package folder) -> its default or UNKNOWN."""
    classes: dict[str, dict[str, ast.expr | None]] = {}
    for path in [*sorted((root / "config").rglob("*.py")), root / "engine/arg_utils.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                fields = classes.setdefault(node.name, {})
                fields.update({s.target.id: s.value for s in node.body
                               if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)})
    arguments = {name: _evaluate(expr, classes) for name, expr in classes["EngineArgs"].items()}
    for node in ast.walk(ast.parse((root / "entrypoints/llm.py").read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "LLM":
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            positional = init.args.args[1:]  # without self
            defaults = [None] * (len(positional) - len(init.args.defaults)) + list(init.args.defaults)
            for arg, default in [*zip(positional, defaults), *zip(init.args.kwonlyargs, init.args.kw_defaults)]:
                arguments[arg.arg] = _evaluate(default, classes) if default is not None else UNKNOWN
    return arguments


def _evaluate(expr: ast.expr | None, classes: dict[str, dict[str, ast.expr | None]], depth: int = 0) -> Any:
    if expr is None or depth > 4:
        return UNKNOWN
    try:
        return ast.literal_eval(expr)
    except (ValueError, SyntaxError, TypeError):
        pass
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):  # ModelConfig.tokenizer_mode
        return _evaluate(classes.get(expr.value.id, {}).get(expr.attr), classes, depth + 1)
    if isinstance(expr, ast.Call):
        for keyword in expr.keywords:
            if keyword.arg == "default":
                return _evaluate(keyword.value, classes, depth + 1)
            if keyword.arg == "default_factory":
                factory = keyword.value
                if isinstance(factory, ast.Name) and factory.id in _FACTORIES:
                    return _FACTORIES[factory.id]()
                if isinstance(factory, ast.Lambda):
                    return _evaluate(factory.body, classes, depth + 1)
                return UNKNOWN
        if isinstance(expr.func, ast.Name) and expr.func.id == "get_field" and len(expr.args) == 2:
            owner, field = expr.args  # get_field(ModelConfig, "hf_overrides")
            if isinstance(owner, ast.Name) and isinstance(field, ast.Constant):
                return _evaluate(classes.get(owner.id, {}).get(field.value), classes, depth + 1)
    return UNKNOWN


def load_snapshot() -> dict[str, Any]:
    data = json.loads(SNAPSHOT.read_text())
    return {name: _from_json(value) for name, value in data["arguments"].items()}


def _to_json(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return {"__python__": type(value).__name__, "items": [_to_json(v) for v in value]}
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict) and "__python__" in value:
        return {"set": set, "frozenset": frozenset, "tuple": tuple}[value["__python__"]](value["items"])
    return value


if __name__ == "__main__":
    source = Path(sys.argv[1])
    version = next((line.split("=")[-1].strip(" '\"\n") for line in (source / "_version.py").read_text().splitlines()
                    if line.startswith("__version__ =")), "unknown")
    found = read_arguments(source)
    SNAPSHOT.write_text(json.dumps({"vllm_version": version, "read_by": "tests/support/vllm_arguments.py",
                                    "arguments": {n: _to_json(found[n]) for n in sorted(found)}}, indent=1) + "\n")
    print(f"{len(found)} arguments of vLLM {version} -> {SNAPSHOT}")
