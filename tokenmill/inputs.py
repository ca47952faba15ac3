"""Prompt forms, tokenization and chat templates: everything between the user's input and token ids."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, Sequence, TypedDict

from tokenmill.chat_content import formatted_messages, resolve_content_format
from tokenmill.param_checks import is_integer


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized by the model's tokenizer (vLLM's ``TextPrompt``)."""

    prompt: str
    cache_salt: NotRequired[str]  # prompts share prefix-cache blocks only with prompts of the same salt


class TokensPrompt(TypedDict):
    """A prompt given as token ids (vLLM's ``TokensPrompt``); ``prompt`` is its text, if known."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


# Every form a prompt may take: text, a list of token ids, or one of the two dicts.
PromptType = str | list[int] | TextPrompt | TokensPrompt

# Prompt keys of vLLM's that need what tokenmill does not serve (images and audio, embeddings
# as input, encoder-decoder models), refused by name rather than ignored.
_UNSERVED_KEYS = {
    "multi_modal_data": "tokenmill serves text-only models",
    "multi_modal_uuids": "tokenmill serves text-only models",
    "mm_processor_kwargs": "tokenmill serves text-only models",
    "prompt_embeds": "prompts are text or token ids",
    "encoder_prompt": "tokenmill serves decoder-only and encoder-only models, not encoder-decoder ones",
    "decoder_prompt": "tokenmill serves decoder-only and encoder-only models, not encoder-decoder ones",
}


@dataclass
class ProcessedPrompt:
    prompt: str | None  # the text, when the user gave text
    token_ids: list[int]
    cache_salt: str | None = None
    # The tokenizer arguments that made token_ids from the text, when tokenmill tokenized it (None for
    # ids the user gave): a cut then re-tokenizes, as vLLM cuts text in the tokenizer (`truncated_ids`).
    encode_kwargs: dict[str, Any] | None = None


# The key under which `tokenize_prompts` leaves, in the prompt dicts it makes, the tokenizer
# arguments that made their ids (so a cut text prompt is not taken for a token prompt).
TOKENIZED_WITH = "_tokenmill_tokenized_with"


def prompt_list(prompts: Any) -> list:
    """One prompt or many, as a list. As in vLLM, a list whose first item is an int is one prompt
    of token ids; any other list (or iterable) holds several prompts."""
    if is_one_prompt(prompts):
        return [prompts]
    check_prompts_iterable(prompts)
    return list(prompts)


def check_prompts_iterable(prompts: Any) -> None:
    """Refuse what is neither one prompt nor an iterable of prompts (None, a number, bytes)."""
    if isinstance(prompts, (bytes, int, float)) or prompts is None or not hasattr(prompts, "__iter__"):
        raise ValueError(f"prompts must be a prompt (text, token ids or a prompt dict) or a list of them, "
                         f"got {type(prompts).__name__} {short_repr(prompts)}")


def is_one_prompt(prompts: Any) -> bool:
    """Whether ``prompts`` is a single prompt (text, a prompt dict, a list of token ids), not several."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))


def one_per_prompt(given: Any, count: int, single: type, name: str) -> list:
    """``given`` for each of ``count`` prompts: one ``single`` value repeated, or a list of exactly ``count``."""
    if isinstance(given, single):
        return [given] * count
    if not isinstance(given, (list, tuple)) or not all(isinstance(v, single) for v in given):
        raise ValueError(f"{name} must be a {single.__name__} or a list of them (one per prompt), got "
                         f"{type(given).__name__} {short_repr(given)}")
    values = list(given)
    if len(values) != count:
        raise ValueError(f"got {len(values)} {name} for {count} prompts; give one, or one per prompt")
    return values


def priority_per_prompt(priority: int | Sequence[int] | None, count: int) -> list[int] | None:
    """vLLM's ``priority``: None, one int for every prompt, or a list of exactly one int per prompt.
    vLLM checks only the list's length, so numpy's integers (a list of them, or an array read from a
    DataFrame) pass there; they are kept as the Python ints they equal."""
    if priority is None:
        return None
    if is_integer(priority):
        return [int(priority)] * count
    is_list = isinstance(priority, (list, tuple)) or (type(priority).__name__ == "ndarray" and priority.ndim == 1)
    if not is_list or len(priority) != count or not all(map(is_integer, priority)):
        raise ValueError(f"priority must be an integer or a list of {count} integers, one per prompt; "
                         f"got {priority!r:.100}")
    return [int(p) for p in priority]


def parse_prompt(prompt: Any, tokenizer: Any, index: int | None = None) -> ProcessedPrompt:
    """Accepts vLLM's prompt forms: "text", [token ids], {"prompt": "text"}, {"prompt_token_ids": [...]}."""
    where = f"prompts[{index}]" if index is not None else "prompt"
    if isinstance(prompt, str):
        return ProcessedPrompt(prompt, _tokenize(prompt, tokenizer, where), encode_kwargs={})
    if isinstance(prompt, list):
        if not is_token_list(prompt):
            raise ValueError(f"{where} is a list, so it must be token ids (integers), got {short_repr(prompt)}")
        return ProcessedPrompt(None, list(prompt))
    if isinstance(prompt, dict):
        salt = _cache_salt(prompt, where)
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not is_token_list(ids):
                raise ValueError(f"{where}.prompt_token_ids must be a list of integers, got {short_repr(ids)}")
            return ProcessedPrompt(prompt.get("prompt"), list(ids), salt, prompt.get(TOKENIZED_WITH))
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"{where}.prompt must be a string, got {type(text).__name__}")
            return ProcessedPrompt(text, _tokenize(text, tokenizer, where), salt, {})
        raise ValueError(f"{where} is a dict without 'prompt' or 'prompt_token_ids' (keys: {sorted(prompt)})")
    raise ValueError(
        f"{where} has type {type(prompt).__name__}; expected a string, a list of token ids, "
        "{'prompt': str} or {'prompt_token_ids': [int]}"
    )


def _cache_salt(prompt: dict, where: str) -> str | None:
    """The prompt's cache_salt, after refusing the keys of inputs tokenmill does not serve."""
    for key, why in _UNSERVED_KEYS.items():
        value = prompt.get(key)
        if value is not None and not (isinstance(value, dict) and not value):  # None or {}: nothing asked
            raise ValueError(f"{where}.{key} is not supported: {why}")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"{where}.cache_salt must be a non-empty string, got {short_repr(salt)}")
    return salt


# Texts a tokenizer call takes at most: the batch path's speed without holding a whole call's
# encodings (ids, tokens, offsets, masks of every prompt) at once for a call of millions of prompts.
TOKENIZE_CHUNK = 1024


# The tokenizer arguments of vLLM's tokenization_kwargs (its renderer's TokenizeParams.with_kwargs reads
# these and its own truncate_prompt_tokens / truncation_side, and drops any other key with a warning).
# Passed on to the tokenizer, another key could change the tokens (is_split_into_words) or do nothing.
TOKENIZER_ARGUMENTS = ("add_special_tokens", "truncation", "max_length", "padding")


def check_tokenization_kwargs(tokenization_kwargs: Any, also_allowed: tuple[str, ...] = ()) -> None:
    """Refuse what is not a dict of `TOKENIZER_ARGUMENTS` (and ``also_allowed``), naming the key."""
    if not isinstance(tokenization_kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict of tokenizer arguments, got {type(tokenization_kwargs).__name__}")
    allowed = (*TOKENIZER_ARGUMENTS, *also_allowed)
    for key, value in tokenization_kwargs.items():
        if key not in allowed:
            raise ValueError(f"tokenization_kwargs[{key!r}]={short_repr(value)} is not supported: the keys are "
                             f"{', '.join(allowed)} (vLLM ignores any other key, with a warning)")


def tokenize_prompts(prompts: Sequence[Any], tokenizer: Any, tokenization_kwargs: dict[str, Any]) -> list[Any]:
    """Text prompts tokenized with ``tokenizer(texts, **tokenization_kwargs)`` (vLLM's
    ``tokenization_kwargs``, e.g. ``{"add_special_tokens": False}`` or truncation), ``TOKENIZE_CHUNK``
    of them a call: the tokenizer's batch path crosses into Rust once, on its threads (2,048 short
    prompts on the dev CPU: 89 -> 51-64 us a prompt). A prompt that already has token ids, or whose
    text is not a string (`parse_prompt` says what is wrong with it), is left as it is."""
    for key in ("truncate_prompt_tokens", "truncation_side"):
        # vLLM 0.26's renderer keys, not the tokenizer's (which would ignore them without a word).
        if isinstance(tokenization_kwargs, dict) and key in tokenization_kwargs:
            raise ValueError(f"tokenization_kwargs[{key!r}]={tokenization_kwargs[key]!r} is not supported for generation: "
                             "use SamplingParams(truncate_prompt_tokens=k) (keeps the last k prompt tokens), or "
                             "tokenization_kwargs={'truncation': True, 'max_length': k} (the tokenizer's own side)")
    check_tokenization_kwargs(tokenization_kwargs)
    found, texts, places = list(prompts), [], []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            continue
        if tokenizer is None:
            raise ValueError(f"prompts[{i}] is text but the tokenizer was not loaded (skip_tokenizer_init=True)")
        texts.append(text)
        places.append(i)
    if not texts:
        return found
    # Padded together, texts would pad to the longest of them: then one at a time.
    chunk = 1 if "padding" in tokenization_kwargs else TOKENIZE_CHUNK
    for start in range(0, len(texts), chunk):
        try:
            ids = tokenizer(texts[start : start + chunk], **tokenization_kwargs)["input_ids"]
        except TypeError as exc:
            raise ValueError(f"tokenization_kwargs={tokenization_kwargs!r} are not tokenizer arguments: {exc}") from exc
        for i, text, row in zip(places[start : start + chunk], texts[start : start + chunk], ids):
            prompt = prompts[i]
            found[i] = {**(prompt if isinstance(prompt, dict) else {}), "prompt": text,
                        "prompt_token_ids": row if isinstance(row, list) else list(row),
                        TOKENIZED_WITH: tokenization_kwargs}
    return found


def load_chat_template(value: str | os.PathLike | None) -> str | None:
    """A chat template given as text, or the path of a file holding one (vLLM's chat_template=)."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ValueError(f"chat_template={short_repr(value)} is invalid: must be a Jinja template or the path of a file holding one")
    try:
        if Path(value).expanduser().is_file():
            return Path(value).expanduser().read_text(encoding="utf-8")
    except OSError:  # a template's text is no file name (longer than the system allows, say): it is the template
        pass
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat_template={value!r} is neither a file nor a Jinja template")
    return value


def truncated_ids(processed: ProcessedPrompt, keep: int, tokenizer: Any) -> list[int]:
    """The prompt's ids cut to its last ``keep`` tokens, as vLLM cuts: token ids given are sliced;
    text is tokenized again with truncation=True, max_length=keep, so that the tokenizer keeps its
    special tokens (BOS and the last keep-1 tokens) and cuts on its truncation side ("left" for
    generation, as vLLM loads the tokenizer)."""
    ids = processed.token_ids
    if len(ids) <= keep:
        return ids
    if processed.encode_kwargs is None or processed.prompt is None or tokenizer is None or keep < 1:
        return ids[-keep:] if keep > 0 else []
    kwargs = {**processed.encode_kwargs, "truncation": True, "max_length": keep}
    return list(tokenizer([processed.prompt], **kwargs)["input_ids"][0])


def validate_prompt_ids(token_ids: Sequence[int], vocab_size: int, max_model_len: int, where: str) -> None:
    if not token_ids:
        raise ValueError(f"{where} is empty: a prompt needs at least one token")
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"{where} has {len(token_ids)} tokens, more than max_model_len={max_model_len}; "
            "shorten it or raise max_model_len"
        )
    if min(token_ids) >= 0 and max(token_ids) < vocab_size:  # the common case, without a Python loop
        return
    bad = next((t for t in token_ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def render_chat_prompt(
    tokenizer: Any,
    messages: list[dict],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    where: str = "messages",
    chat_template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template.

    transformers renders templates in a sandboxed Jinja environment, so a template cannot reach
    Python objects it was not given. ``chat_template_kwargs`` are more variables for the template
    (e.g. Qwen3's ``enable_thinking``). Contents given as lists of parts reach the template as
    ``content_format`` says (`tokenmill.chat_content`).
    """
    (ids,) = render_chat_prompts(tokenizer, [messages], chat_template, add_generation_prompt, continue_final_message,
                                 tools, [where], chat_template_kwargs, content_format)
    return ids


def render_chat_prompts(
    tokenizer: Any,
    conversations: Sequence[list[dict]],
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict] | None,
    wheres: Sequence[str],
    chat_template_kwargs: dict[str, Any] | None = None,
    content_format: str = "auto",
) -> list[list[int]]:
    """`render_chat_prompt` for many conversations at once: each rendered, then tokenized
    ``TOKENIZE_CHUNK`` a call (the tokenizer's batch path: on the dev CPU 132 -> 69 us a short
    conversation). A conversation that fails the checks raises naming its ``wheres`` entry; one
    that breaks the template raises a ValueError naming it, with the template's own error (the
    first such conversation's, as rendering it alone raises it) as its message and cause."""
    options, template = _chat_options(tokenizer, chat_template, add_generation_prompt, continue_final_message, tools,
                                      chat_template_kwargs)
    fmt = resolve_content_format(content_format, template)
    checked = [_checked_messages(messages, where, fmt) for messages, where in zip(conversations, wheres)]
    rendered = _render_in_chunks(tokenizer, checked, options)
    failed = next((i for i, ids in enumerate(rendered) if isinstance(ids, Exception)), None)
    if failed is not None:
        error = rendered[failed]
        raise ValueError(f"{wheres[failed]}: the chat template refused it: {type(error).__name__}: {error}") from error
    return rendered  # type: ignore[return-value]  (no error among them)


def render_chat_prompts_each(
    tokenizer: Any,
    conversations: Sequence[list[dict]],
    chat_template: str | None,
    wheres: Sequence[str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[list[int] | Exception]:
    """`render_chat_prompts` for callers that go on past a bad conversation (the batch job): each
    conversation's token ids, or the error it raises rendered alone (a failed check, the
    template's own). One bad conversation costs its chunk a few more calls (halves), not every
    conversation of the chunk rendered alone. Settings no conversation could render with (no
    template) raise."""
    options, template = _chat_options(tokenizer, chat_template, add_generation_prompt, continue_final_message, tools,
                                      chat_template_kwargs)
    fmt = resolve_content_format("auto", template)
    results: list[list[int] | Exception] = []
    checked, places = [], []
    for messages, where in zip(conversations, wheres):
        try:
            checked.append(_checked_messages(messages, where, fmt))
            places.append(len(results))
            results.append([])
        except (ValueError, TypeError) as error:
            results.append(error)
    for place, ids in zip(places, _render_in_chunks(tokenizer, checked, options)):
        results[place] = ids
    return results


def _chat_options(
    tokenizer: Any, chat_template: str | None, add_generation_prompt: bool, continue_final_message: bool,
    tools: list[dict] | None, chat_template_kwargs: dict[str, Any] | None,
) -> tuple[dict[str, Any], str]:
    """apply_chat_template's keywords for a call's settings, and the template they name."""
    for name, flag in (("add_generation_prompt", add_generation_prompt), ("continue_final_message", continue_final_message)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={short_repr(flag)} is invalid: must be True or False")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) or callable(t) for t in tools)):
        raise ValueError(f"tools={short_repr(tools)} is invalid: must be None or a list of tools, each a JSON schema dict "
                         "({'type': 'function', 'function': {...}})")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "the tokenizer has no chat template; pass chat_template= or use generate() with plain prompts"
        )
    not_names = [key for key in chat_template_kwargs or {} if not isinstance(key, str)]
    if not_names:
        raise ValueError(f"chat_template_kwargs keys must be strings (template variable names), got {short_repr(not_names)}")
    reserved = sorted({"tokenize", "return_dict", "chat_template", "messages", "conversation"} & set(chat_template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: the engine tokenizes the rendered prompt, "
                         "the template itself is chat_template=, and the messages are the conversation's")
    # As vLLM merges them: the template variables, with the call's own arguments (those not None) on top.
    explicit = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tools=tools)
    options = {**(chat_template_kwargs or {}), **{k: v for k, v in explicit.items() if v is not None},
               "chat_template": template, "tokenize": True, "return_dict": False}
    return options, template


def _render_in_chunks(tokenizer: Any, checked: list[list[dict]], options: dict[str, Any]) -> list[list[int] | Exception]:
    """Checked conversations rendered ``TOKENIZE_CHUNK`` a call: each one's ids, or its own error."""
    rendered: list[list[int] | Exception] = []
    for start in range(0, len(checked), TOKENIZE_CHUNK):
        rendered += _render_halving(tokenizer, checked[start : start + TOKENIZE_CHUNK], options)
    return rendered


def _render_halving(tokenizer: Any, conversations: list[list[dict]], options: dict[str, Any]) -> list[list[int] | Exception]:
    """One apply_chat_template call for ``conversations``; if one of them breaks it, each half again,
    down to the conversation alone, rendered as `render_chat_prompt` renders it (its own error)."""
    if len(conversations) == 1:
        try:
            return [list(tokenizer.apply_chat_template(conversations[0], **options))]
        except Exception as error:  # noqa: BLE001  (a template raises what it likes: the caller decides)
            return [error]
    try:
        return [list(ids) for ids in tokenizer.apply_chat_template(conversations, **options)]
    except Exception:  # noqa: BLE001  (one conversation broke the template: find it by halves)
        half = len(conversations) // 2
        return _render_halving(tokenizer, conversations[:half], options) + _render_halving(tokenizer, conversations[half:], options)


def _checked_messages(messages: Any, where: str, content_format: str) -> list[dict]:
    if isinstance(messages, tuple):  # vLLM takes a tuple of messages as one conversation
        messages = list(messages)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string 'role', got {short_repr(message)}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"{where}[{i}].content must be a string or a list of parts, got {type(content).__name__}")
    return formatted_messages(messages, content_format, where)


def is_token_list(ids: Any) -> bool:
    """A list or tuple of ints (bools are not token ids). Checked by the set of element types
    first, a C loop; only a list holding other types (int subclasses, say) is looked at one by one."""
    if not isinstance(ids, (list, tuple)):
        return False
    return set(map(type, ids)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def _tokenize(text: str, tokenizer: Any, where: str) -> list[int]:
    if tokenizer is None:
        raise ValueError(f"{where} is text but the tokenizer was not loaded (skip_tokenizer_init=True); pass prompt_token_ids")
    return tokenizer.encode(text)


def short_repr(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
