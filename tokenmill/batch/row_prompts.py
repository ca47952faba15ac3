"""A job's rows' prompts, as the engine takes them.

A row's prompt is its token ids, its text, or its conversation rendered with the chat template
(`requests.RowRequest`). Rows prepared together (a read-ahead batch, `rows_ahead.RowsAhead`, or a
group run again apart) have their texts tokenized in one tokenizer call and their conversations
rendered and tokenized in one ``apply_chat_template`` call (per ``TOKENIZE_CHUNK``; conversations
with different chat options, `chat_options.ChatOptions`, in one call per options): the
tokenizer's batch path crosses into Rust once, on its threads (docs/perf.md 70). A conversation
that breaks the template costs its batch a few calls more (halves), and is left out; a row the
batch cannot serve goes to `row_prompt` alone, which raises that row's own error.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tokenmill.batch.chat_options import ChatOptions
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.requests import PromptSettings, RowRequest


def row_prompt(tokenizer: Any, request: "RowRequest", chat_template: str | None) -> Any:
    """One row's prompt: its token ids, its conversation rendered to token ids, or its text."""
    if request.messages is not None:
        from tokenmill.inputs import render_chat_prompt

        ids = render_chat_prompt(tokenizer, request.messages, where=request.messages_where,
                                 **_chat_keywords(request.chat, chat_template))
        return {"prompt_token_ids": ids}
    if request.prompt_token_ids is not None:
        return {"prompt_token_ids": request.prompt_token_ids}
    return request.prompt


def prepare_rows(raws: list["RawRow"], make_request: Callable[["RawRow"], "RowRequest"], tokenizer: Any,
                 chat_template: str | None, row_errors: tuple[type[BaseException], ...]) -> dict[int, tuple["RowRequest", Any]]:
    """The requests and prompts of rows made together, by row index. A row whose request or prompt
    could not be made here is left out: the job makes it alone when it submits it, and writes that
    row's own error."""
    if tokenizer is None or len(raws) < 2:
        return {}
    requests = {}
    for raw in raws:
        if raw.error is None:
            with contextlib.suppress(*row_errors):
                requests[raw.index] = make_request(raw)
    prompts = batch_prompts(tokenizer, requests, chat_template)
    return {index: (requests[index], prompt) for index, prompt in prompts.items()}


def batch_prompts(tokenizer: Any, requests: dict[int, "RowRequest"], chat_template: str | None) -> dict[int, Any]:
    """The prompts of ``requests`` (by row index) made together, as `row_prompt` makes each; rows
    whose text or conversation could not be made in the batch are left out."""
    from tokenmill.inputs import render_chat_prompts_each, tokenize_prompts

    prompts = {i: row_prompt(tokenizer, r, chat_template) for i, r in requests.items() if r.prompt_token_ids is not None}
    texts = {i: r.prompt for i, r in requests.items() if r.messages is None and r.prompt_token_ids is None}
    # Conversations rendered alike (the same chat options: most jobs' rows all have none) go together.
    groups: dict[str, list[int]] = {}
    for i, r in requests.items():
        if r.messages is not None:
            groups.setdefault(r.chat.key() if r.chat is not None else "", []).append(i)
    if texts:
        with contextlib.suppress(ValueError, TypeError):
            prompts.update(zip(texts, tokenize_prompts(list(texts.values()), tokenizer, {})))
    for rows in groups.values():
        with contextlib.suppress(Exception):  # settings no row renders with (no template): each row fails alone
            rendered = render_chat_prompts_each(tokenizer, [requests[i].messages for i in rows],
                                                wheres=[requests[i].messages_where for i in rows],
                                                **_chat_keywords(requests[rows[0]].chat, chat_template))
            prompts.update((i, {"prompt_token_ids": ids}) for i, ids in zip(rows, rendered) if not isinstance(ids, Exception))
    return prompts


def _chat_keywords(chat: "ChatOptions | None", chat_template: str | None) -> dict[str, Any]:
    """The rendering keywords of a row's chat options (none: the job's template, LLM.chat's defaults)."""
    return chat.render_keywords(chat_template) if chat is not None else {"chat_template": chat_template}


def check_chat_template(tokenizer: Any, template: str | None, prompt: "PromptSettings", fmt: str, model: str) -> None:
    """A chat template the job asks for but cannot use is a usage error before any row runs:
    otherwise every row of the job would be written as failed with the same message, and the
    output would need --overwrite once the flag was fixed."""
    if tokenizer is None:
        return
    from jinja2 import TemplateSyntaxError

    from tokenmill.inputs import render_chat_prompt

    wants_chat = prompt.chat or prompt.system is not None
    if template is None and wants_chat and fmt != "openai" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat and --system need a chat template, and the model {model} has none; "
                         "pass --chat-template FILE, or leave out --chat and --system to send the text as it is")
    if template is None:
        return
    try:  # a one-turn conversation: the smallest test that the template compiles
        render_chat_prompt(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
    except Exception as e:  # noqa: BLE001  (if it compiles, a row's own conversation decides whether it renders)
        syntax = e if isinstance(e, TemplateSyntaxError) else e.__cause__  # render_chat_prompt names the conversation
        if isinstance(syntax, TemplateSyntaxError):
            raise ValueError(f"--chat-template is not a valid Jinja template: {syntax.message} (line {syntax.lineno})") from None
