"""A chat row's own chat-template arguments, as ``LLM.chat`` takes them.

An OpenAI batch line's ``/v1/chat/completions`` body may carry what vLLM's ChatCompletionRequest
hands its chat template: ``tools``, ``documents``, ``chat_template``, ``chat_template_kwargs``
(e.g. ``{"enable_thinking": false}`` for Qwen3), ``add_generation_prompt``,
``continue_final_message`` and ``reasoning_effort``; a generic row whose prompt is its own ``messages`` may carry
``tools``, ``documents`` and ``chat_template_kwargs`` beside them (in CSV, each a cell of JSON
text). They are checked here, per row (a bad value is that row's error, naming the field), and
reach the same rendering ``LLM.chat`` uses (`tokenmill.inputs.render_chat_prompt`).

``tool_choice``: vLLM's run_batch has no tool-call parser, so no line gets ``tool_calls`` back.
``"none"`` and ``"auto"`` are accepted as rendering only: the tools are in the prompt, and the
model's reply (a tool call in its own text format, or an answer) is the message's ``content``.
``"required"`` and a named function need the output constrained to a tool call and returned
as ``tool_calls``, which this job does not do: they are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.inputs import short_repr

# Fields of a chat line's body (an OpenAI batch line) that set the rendering.
BODY_FIELDS = ("tools", "tool_choice", "documents", "chat_template", "chat_template_kwargs", "add_generation_prompt",
               "continue_final_message", "reasoning_effort")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's
# Fields of a generic row with ``messages`` that set it (Parquet and CSV give every row every column).
ROW_FIELDS = ("tools", "documents", "chat_template_kwargs")
_RENDERING_TOOL_CHOICES = ("none", "auto")


@dataclass(frozen=True)
class ChatOptions:
    """How one row's conversation is rendered, beyond the job's ``--chat-template``."""

    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None  # the row's own template text, over the job's
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None

    def render_keywords(self, job_template: str | None) -> dict[str, Any]:
        """`render_chat_prompt`'s keywords. As vLLM merges them, the fields go over the same keys of
        ``chat_template_kwargs``: ``documents`` reach the template as apply_chat_template's own
        argument, ``reasoning_effort`` as a variable, which also turns ``enable_thinking`` on (off
        for "none") unless ``chat_template_kwargs`` sets it (templates such as Gemma's think only
        when asked)."""
        variables = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            variables["documents"] = self.documents
        if self.reasoning_effort is not None:
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
            variables["reasoning_effort"] = self.reasoning_effort
        return {"chat_template": self.chat_template or job_template, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "tools": self.tools,
                "chat_template_kwargs": variables or None}

    def key(self) -> str:
        """Equal for rows rendered alike (rows are rendered together by their options)."""
        return json.dumps(asdict(self), default=repr)


def body_chat_options(body: dict[str, Any], where: str) -> ChatOptions | None:
    """The chat options of a ``/v1/chat/completions`` body (None: none set); raises ValueError naming
    the body field at fault (the caller makes it the row's error)."""
    if all(body.get(name) is None for name in BODY_FIELDS):
        return None
    tools = _tools(body.get("tools"), f"{where}: body.tools")
    tools = [_as_vllm_server_dumps_it(tool) for tool in tools] if tools is not None else None
    _check_tool_choice(body.get("tool_choice"), tools, f"{where}: body.tool_choice")
    flags = {name: _flag(body, name, default, where)
             for name, default in (("add_generation_prompt", True), ("continue_final_message", False))}
    if flags["add_generation_prompt"] and flags["continue_final_message"]:
        raise ValueError(f"{where}: body.add_generation_prompt and body.continue_final_message cannot both be true "
                         "(continue_final_message goes on with the last message, add_generation_prompt starts a new one); "
                         "set add_generation_prompt to false")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ValueError(f"{where}: body.reasoning_effort={short_repr(effort)} is invalid: must be one of "
                         f"{', '.join(map(repr, REASONING_EFFORTS))}")
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise ValueError(f"{where}: body.chat_template={short_repr(template)} is invalid: must be a Jinja chat template "
                         "(its text)")
    return ChatOptions(tools=tools, documents=_documents(body.get("documents"), f"{where}: body.documents"),
                       chat_template=template, reasoning_effort=effort,
                       chat_template_kwargs=_variables(body.get("chat_template_kwargs"), f"{where}: body.chat_template_kwargs"),
                       **flags)


def row_chat_options(record: dict[str, Any], where: str) -> ChatOptions | None:
    """The chat options of a generic row with ``messages`` (None: none set). A cell may hold its
    value as JSON text (CSV); a null or empty cell is not set, and so is a null variable in
    ``chat_template_kwargs`` (a Parquet struct gives every row the keys any row set)."""
    values = {name: _json_cell(record.get(name), f"{where}: {name!r}") for name in ROW_FIELDS}
    if all(value is None for value in values.values()):
        return None
    variables = values["chat_template_kwargs"]
    if isinstance(variables, dict):
        variables = {key: value for key, value in variables.items() if value is not None} or None
    return ChatOptions(tools=_tools(values["tools"], f"{where}: 'tools'"),
                       documents=_documents(values["documents"], f"{where}: 'documents'"),
                       chat_template_kwargs=_variables(variables, f"{where}: 'chat_template_kwargs'"))


def _json_cell(value: Any, where: str) -> Any:
    if value is None or value == "":
        return None
    if isinstance(value, str):  # CSV cells hold text
        try:
            return json.loads(value)
        except ValueError:
            raise ValueError(f"{where} is not JSON: {short_repr(value)}") from None
    return value


def _tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI's tools: a non-empty list of ``{"type": "function", "function": {"name": ..., ...}}``
    (vLLM refuses an empty list, as OpenAI does)."""
    if tools is None:
        return None
    shape = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}={short_repr(tools)} is invalid: must be a non-empty list of tools, each {shape}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"{where}[{i}]={short_repr(tool)} is invalid: a tool is {shape}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"{where}[{i}].type={short_repr(tool['type'])} is invalid: must be 'function'")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}[{i}].function.description={short_repr(description)} is invalid: must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"{where}[{i}].function.parameters={short_repr(parameters)} is invalid: must be a JSON schema "
                             "object")
    return tools


def _as_vllm_server_dumps_it(tool: dict[str, Any]) -> dict[str, Any]:
    """A line's tool as vLLM's server hands it to the template (its request model, dumped): the
    tool's type and function, the function's name, description and parameters (null when not
    given), strict and defer_loading only when set, in that order (templates print tools with
    ``tojson``, which keeps the order), other keys dropped. ``LLM.chat`` (and a generic row) hands
    the tools over as given, as vLLM's ``LLM.chat`` does."""
    function = tool["function"]
    dumped = {"name": function["name"], "description": function.get("description"), "parameters": function.get("parameters")}
    defer = function.get("defer_loading")
    if defer is None:  # vLLM copies the tool's down to the function
        defer = tool.get("defer_loading")
    dumped.update((key, value) for key, value in (("strict", function.get("strict")), ("defer_loading", defer))
                  if value is not None)
    out = {"type": "function", "function": dumped}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def _check_tool_choice(choice: Any, tools: list | None, where: str) -> None:
    if choice is None or choice == "none":
        return
    if choice == "auto":
        if tools is None:  # as vLLM's request check
            raise ValueError(f"{where}='auto' needs tools: set body.tools, or leave tool_choice out")
        return
    if choice == "required" or isinstance(choice, dict):
        raise ValueError(f"{where}={short_repr(choice)} is not supported: a tokenmill batch renders the tools into the "
                         "prompt and answers with the model's text as the message's content; it does not force a tool call "
                         f"or return tool_calls (supported: {', '.join(map(repr, _RENDERING_TOOL_CHOICES))})")
    raise ValueError(f"{where}={short_repr(choice)} is invalid: must be 'none', 'auto', 'required' or "
                     '{"type": "function", "function": {"name": ...}}')


def _documents(documents: Any, where: str) -> list[dict[str, Any]] | None:
    """Retrieval documents for a RAG template: a list of objects of strings (vLLM's
    ``list[dict[str, str]]``; e.g. ``{"title": ..., "text": ...}``)."""
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise ValueError(f"{where}={short_repr(documents)} is invalid: must be a list of objects of strings, "
                         'e.g. [{"title": "...", "text": "..."}]')
    return documents


def _variables(variables: Any, where: str) -> dict[str, Any] | None:
    if variables is None:
        return None
    if not isinstance(variables, dict):
        raise ValueError(f"{where}={short_repr(variables)} is invalid: must be an object of template variables, "
                         'e.g. {"enable_thinking": false}')
    return variables


def _flag(body: dict[str, Any], name: str, default: bool, where: str) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{where}: body.{name}={short_repr(value)} is invalid: must be true or false")
    return value
