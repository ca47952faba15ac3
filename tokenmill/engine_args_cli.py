"""`EngineArgs.add_cli_args`: one command-line option per engine argument, as vLLM's parser has.

vLLM's offline examples build their options with ``EngineArgs.add_cli_args(parser)`` and hand
the result to ``LLM(**vars(args))`` or ``EngineArgs.from_cli_args(args)``. Every argument gets
``--dashed-name`` and ``--underscored_name`` (vLLM's parser takes both), its EngineArgs default,
and a parser chosen from its type: booleans take ``--x`` / ``--no-x``, numbers and strings
parse as such, and the rest (dicts, lists, unknown types) as JSON, or as text when not JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Callable, Iterable

from tokenmill.engine_args_table import VLLM_ARGUMENTS, Handling


def add_engine_options(parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field]) -> argparse.ArgumentParser:
    group = parser.add_argument_group("engine arguments (vLLM's names; tokenmill/engine_args_table.py)")
    for field in fields:
        if field.name.startswith("_"):
            continue  # vLLM's private arguments have no option either
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        names = [f"--{field.name.replace('_', '-')}"]
        if "_" in field.name:
            names.append(f"--{field.name}")
        kind = _parser_for(field, default)
        common: dict[str, Any] = {"dest": field.name, "default": default, "help": _help(field.name)}
        if kind is bool:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(*names, type=kind, **common)
    return parser


def _parser_for(field: dataclasses.Field, default: Any) -> Callable[[str], Any] | type:
    annotation = field.type if isinstance(field.type, str) else ""
    first = annotation.split("|")[0].strip()
    if first == "bool" or isinstance(default, bool):
        return bool
    if first in ("int", "float", "str"):
        return {"int": int, "float": float, "str": str}[first]
    if type(default) in (int, float, str):
        return type(default)
    return _json_or_text


def _json_or_text(text: str) -> Any:
    """'{"a": 1}' -> a dict, '[1, 2]' -> a list, '3' -> 3; anything that is not JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _help(name: str) -> str:
    argument = VLLM_ARGUMENTS.get(name)
    if argument is None or argument.handling is Handling.IMPLEMENTED:
        return "see EngineArgs"
    if argument.handling is Handling.NO_EFFECT:
        return f"accepted, no effect: {argument.note}"
    return f"only {argument.default!r}: {argument.note}"
