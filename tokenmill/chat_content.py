"""Message contents as a chat template expects them (vLLM's ``chat_template_content_format``).

OpenAI-style messages may carry their content as a list of parts
(``[{"type": "text", "text": "..."}]``). Most models' templates print ``message['content']`` as a
string, so a list there renders as a Python repr or fails inside Jinja; a few templates loop over
the parts. vLLM's rule, kept here: ``"string"`` joins a message's text parts with newlines,
``"openai"`` hands the template a list of ``{"type": "text", "text": ...}`` parts (a string content
becomes one part), and ``"auto"`` picks ``"openai"`` only for a template that loops over a
message's content. tokenmill serves text-only models, so image, audio and other parts are refused
by name.
"""

from __future__ import annotations

import functools
import json
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")
# Part types that carry text, and the key holding it (vLLM's text-like parts).
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
# Parts vLLM leaves out when their text is missing or null, rather than refusing them.
_SKIPPED_WITHOUT_TEXT = ("text", "refusal")


def resolve_content_format(content_format: str, template: str) -> str:
    """``"string"`` or ``"openai"`` for this template."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format={content_format!r} is invalid: must be one of {CONTENT_FORMATS}")
    if content_format != "auto":
        return content_format
    return "openai" if template_loops_over_content(template) else "string"


@functools.lru_cache(maxsize=16)
def template_loops_over_content(template: str) -> bool:
    """Whether the template iterates over a message's content (``{% for part in message['content'] %}``,
    directly or through a variable set from it). A template Jinja cannot parse counts as a string reader.

    Cached per template text: parsing takes ~0.5 ms, three quarters of rendering a short conversation,
    and a job renders every row with the same template."""
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError:
        return False
    holders: set[str] = set()  # variables assigned some message's content
    for assign in tree.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _reads_content(assign.node, holders):
            holders.add(assign.target.name)
    # A loop over a variable named ``content`` counts too (a macro's argument, as in Qwen3.5's
    # template): vLLM's detection counts it since vllm-project/vllm#42660.
    return any(_reads_content(loop.iter, holders | {"content"}) for loop in tree.find_all(nodes.For))


def _reads_content(node: Any, holders: set[str]) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):  # message['content'] | selectattr(...) and the like
        return node.node is not None and _reads_content(node.node, holders)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Name) and node.name in holders


def formatted_messages(messages: list[dict], content_format: str, where: str) -> list[dict]:
    """Copies of the messages as a chat template expects them, as vLLM prepares them: list contents in
    ``content_format`` ("string" or "openai"), a null or missing content empty ("" or []), a tool's
    result always a string (tool turns' templates print it), and an assistant's tool calls as
    tool-use templates render them (`_tool_calls`). Messages needing none of it are passed through."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        # vLLM hands a tool's result to the template as a string whatever the format (its text parts
        # joined): clients send results as parts, and most templates print a tool's content.
        parts = content_format == "openai" and message.get("role") != "tool"
        if content is None:
            message = {**message, "content": [] if parts else ""}
        elif parts and isinstance(content, str):
            message = {**message, "content": [{"type": "text", "text": content}]}
        elif isinstance(content, list):
            texts = [_part_text(part, f"{where}[{i}].content[{j}]") for j, part in enumerate(content)]
            texts = [t for t in texts if t is not None]
            if content_format == "string":
                texts = [t for t in texts if t]  # as vLLM joins them: an empty text adds no blank line
            joined: Any = [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)
            message = {**message, "content": joined}
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            message = _tool_calls(message, f"{where}[{i}]")
        out.append(message)
    return out


def _tool_calls(message: dict, where: str) -> dict:
    """An assistant message with its tool calls as vLLM hands them to the template: an empty list
    left out (Llama 3.1's template tests ``'tool_calls' in message`` and raises on none), and each
    call's ``function.arguments`` given as a JSON string (the OpenAI form) parsed to the object
    templates render."""
    if not message["tool_calls"]:
        return {key: value for key, value in message.items() if key != "tool_calls"}
    return {**message, "tool_calls": [_tool_call(call, f"{where}.tool_calls[{j}]")
                                      for j, call in enumerate(message["tool_calls"])]}


def _tool_call(call: Any, where: str) -> Any:
    """A tool call whose ``function.arguments`` is a JSON string (or empty) with them as an object.
    Arguments that are no JSON are refused by name (vLLM's json.loads fails on them too)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, (dict, list)):
        return call
    if arguments in (None, ""):
        parsed: Any = {}
    elif isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError as e:
            raise ValueError(f"{where}.function.arguments must be JSON (the OpenAI form) or an object: {e}; "
                             f"got {arguments[:60]!r}") from None
    else:
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object, got {type(arguments).__name__}")
    return {**call, "function": {**function, "arguments": parsed}}


def _part_text(part: Any, where: str) -> str | None:
    """A part's text; None for a text or refusal part without one (vLLM leaves those out)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ValueError(f"{where} must be a string or a {{'type': 'text', 'text': ...}} part, got {type(part).__name__}")
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
    if key is None:
        raise ValueError(f"{where} has type {kind!r}: tokenmill serves text-only models, so a message part must be "
                         f"one of {sorted(_TEXT_PARTS)}")
    text = part.get(key)
    if text is None and kind in _SKIPPED_WITHOUT_TEXT:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{where}.{key} must be a string, got {type(text).__name__}")
    return text
