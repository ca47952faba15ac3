"""A job's rows' prompts, as the engine takes them.

A row's prompt is its token ids, its text, or its conversation rendered with the chat template
(`requests.RowRequest`). Rows submitted together (a refill of the engine: up to ``max_inflight``
rows at the start, then the rows that finished in a step) have their texts tokenized in one
tokenizer call and their conversations rendered and tokenized in one ``apply_chat_template``
call: the tokenizer's batch path crosses into Rust once, on its threads (docs/perf.md 70). A row
the batch cannot serve is left to `row_prompt`, alone, which raises that row's own error.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.batch.requests import PromptSettings, RowRequest


def row_prompt(tokenizer: Any, request: "RowRequest", chat_template: str | None) -> Any:
    """One row's prompt: its token ids, its conversation rendered to token ids, or its text."""
    if request.messages is not None:
        from tokenmill.inputs import render_chat_prompt

        ids = render_chat_prompt(tokenizer, request.messages, chat_template=chat_template, where=request.messages_where)
        return {"prompt_token_ids": ids}
    if request.prompt_token_ids is not None:
        return {"prompt_token_ids": request.prompt_token_ids}
    return request.prompt


def batch_prompts(tokenizer: Any, requests: dict[int, "RowRequest"], chat_template: str | None) -> dict[int, Any]:
    """The prompts of ``requests`` (by row index) made together, as `row_prompt` makes each; rows
    whose text or conversation could not be made in the batch are left out."""
    from tokenmill.inputs import render_chat_prompts, tokenize_prompts

    prompts = {i: row_prompt(tokenizer, r, chat_template) for i, r in requests.items() if r.prompt_token_ids is not None}
    texts = {i: r.prompt for i, r in requests.items() if r.messages is None and r.prompt_token_ids is None}
    chats = {i: r.messages for i, r in requests.items() if r.messages is not None}
    if texts:
        with contextlib.suppress(ValueError, TypeError):
            prompts.update(zip(texts, tokenize_prompts(list(texts.values()), tokenizer, {})))
    if chats:
        with contextlib.suppress(Exception):  # a row that breaks the template: each then renders alone
            rendered = render_chat_prompts(tokenizer, list(chats.values()), chat_template, True, False, None,
                                           [requests[i].messages_where for i in chats])
            prompts.update((i, {"prompt_token_ids": ids}) for i, ids in zip(chats, rendered))
    return prompts


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
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e.message} (line {e.lineno})") from None
    except Exception:  # noqa: BLE001  (it compiles; a row's own conversation decides whether it renders)
        pass
