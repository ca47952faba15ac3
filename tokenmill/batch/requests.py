"""From an input row to what the engine is asked: a prompt (text, token ids or chat messages) and sampling values.

A generic row (JSONL, CSV, Parquet) finds its prompt, in this order of precedence:
  1. ``--prompt-template "...{field}..."``: the template filled with the row's fields;
  2. ``--text-field F``: the row's field F;
  3. the row's own ``messages`` (chat), ``prompt`` (text) or ``prompt_token_ids``, the first that is
     not null (Parquet gives every row every column).
Text becomes a chat turn with ``--chat`` (or ``--system``, which needs a chat). A row may override
sampling values in a ``sampling_params`` object (a JSON string in CSV); a null value there means
"not set" (Parquet structs fill the keys a row did not set with nulls). A row's ``lora`` field names
the LoRA adapter it runs with (``--lora-modules``; null or empty: the base model; see lora_modules.py).
A row with ``messages`` may carry ``tools``, ``documents`` and ``chat_template_kwargs`` for its
chat template (chat_options.py).

Everything here is checked before the engine sees it; a problem raises `RowError`, which the job
turns into an error row. The OpenAI batch format has its own translation in `openai_batch.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from string import Formatter
from typing import TYPE_CHECKING, Any

from tokenmill.batch.chat_options import ChatOptions, row_chat_options
from tokenmill.inputs import is_token_list, short_repr

if TYPE_CHECKING:
    from tokenmill.batch.readers import RawRow
    from tokenmill.sampling_params import SamplingParams


ADAPTER_FIELD = "lora"  # a generic row's LoRA adapter name (--lora-modules)


class RowError(ValueError):
    """A row that cannot run, with the id it carries (when it has one) for its error row. For an
    OpenAI line's error body: ``param``, the body field at fault where the raise knows it (others
    are found from the message, see openai_lines.error_param), and ``status``, the HTTP status
    (400; 404 for a model the job does not serve, as vLLM's server and OpenAI answer)."""

    def __init__(self, message: str, row_id: Any = None, *, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.row_id = row_id
        self.param = param
        self.status = status


@dataclass(frozen=True)
class PromptSettings:
    """The job's choices that turn rows into prompts (part of the resume fingerprint)."""

    chat: bool = False
    system: str | None = None
    prompt_template: str | None = None
    id_field: str | None = None
    text_field: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_template is not None:
            template_fields(self.prompt_template)  # fail fast on a malformed template
        if self.prompt_template is not None and self.text_field is not None:
            raise ValueError("--prompt-template and --text-field both say where the prompt is; pass one of them")


@dataclass(frozen=True)
class OpenAIMeta:
    """What an OpenAI batch line's output needs from its request (see openai_batch.py)."""

    custom_id: str
    url: str
    top_logprobs: int | None  # chat: how many alternatives per token, when logprobs were asked
    encoding_format: str = "float"  # embeddings: "float" (lists of numbers) or "base64" (float32 bytes)
    queries: int = 0  # score and rerank lines: how many of the line's first texts (data_1, the query) there are
    documents: tuple[str, ...] = ()  # rerank lines: the documents, each named in its result
    top_n: int = 0  # rerank lines: how many results to keep, best first (0: all)


@dataclass
class RowRequest:
    """A row ready for the engine. Exactly one of prompt, prompt_token_ids and messages is set."""

    index: int
    row_id: Any
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat: ChatOptions | None = None  # how ``messages`` are rendered beyond the job's template (chat_options.py)
    overrides: dict[str, Any] = field(default_factory=dict)  # sampling values set by the row
    openai: OpenAIMeta | None = None
    # The LoRA adapter the row names (a generic row's 'lora', an OpenAI line's body.model), None for
    # none; the job's adapters decide what it means (lora_modules.JobAdapters.for_row).
    adapter: str | None = None
    where: str = ""  # where a person finds the row ("line 12"), for errors found after it was read

    @property
    def messages_where(self) -> str:
        return f"{self.where or f'row {self.index}'} messages"


def template_fields(template: str) -> list[str]:
    """The field names a prompt template uses; raises ValueError for a malformed template."""
    try:
        parsed = list(Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"--prompt-template {template!r} is malformed: {e} (write a literal brace as {{{{ or }}}})") from None
    names = [name for _, name, _, _ in parsed if name is not None]
    if any(name == "" or name.isdigit() for name in names):
        raise ValueError(f"--prompt-template {template!r} has a positional field {{}}; name the row field, e.g. {{title}}")
    if not names:
        raise ValueError(f"--prompt-template {template!r} uses no row field; put one in braces, e.g. {{title}}")
    return names


def build_row_request(raw: "RawRow", settings: PromptSettings) -> RowRequest:
    """Translate one generic row; raises RowError naming the field at fault. A "" text goes on to the
    engine, as LLM.generate and LLM.embed take it: it runs as the tokenizer's special tokens (a
    Llama's BOS, BERT's [CLS] [SEP]) or the chat template's, and the engine refuses it by name when
    that leaves no token (vLLM: the prompt cannot be empty)."""
    record = raw.record
    assert record is not None
    where = raw.where or f"row {raw.index}"
    row_id = row_id_of(record, raw.index, settings.id_field, where)
    request = RowRequest(index=raw.index, row_id=row_id, overrides=_row_overrides(record, where, row_id), where=where,
                         adapter=row_adapter_name(record, where, row_id))
    if settings.prompt_template is not None:
        text = _fill_template(settings.prompt_template, record, where, row_id)
    elif settings.text_field is not None:
        text = _text_field(record, settings.text_field, where, row_id)
    # A null prompt field counts as absent: Parquet (and a JSONL made from a table) gives every
    # row every column, so a row with a prompt carries "messages": null and the reverse.
    elif record.get("messages") is not None:
        request.messages = parse_messages(record["messages"], where, row_id, settings.system)
        try:
            request.chat = row_chat_options(record, where)
        except ValueError as e:
            raise RowError(str(e), row_id) from None
        return request
    elif record.get("prompt") is not None:
        prompt = record["prompt"]
        if isinstance(prompt, list) and prompt and is_token_list(prompt):
            request.prompt_token_ids = list(prompt)
            return request
        if not isinstance(prompt, str):
            raise RowError(f"{where}: 'prompt' must be a string (or a list of token ids), got {type(prompt).__name__} "
                           f"{short_repr(prompt)}", row_id)
        text = prompt
    elif record.get("prompt_token_ids") is not None:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not is_token_list(ids):
            raise RowError(f"{where}: 'prompt_token_ids' must be a list of integers", row_id)
        request.prompt_token_ids = list(ids)
        return request
    else:
        nulls = sorted(name for name in ("prompt", "messages", "prompt_token_ids") if name in record)
        null_note = f" ({' and '.join(map(repr, nulls))} {'is' if len(nulls) == 1 else 'are'} null)" if nulls else ""
        raise RowError(
            f"{where} has no prompt: it needs a 'prompt', 'messages' or 'prompt_token_ids' field that is not "
            f"null{null_note} (fields: {sorted(record)[:12]}{_misspelt_prompt_fields(map(str, record))}); or pass "
            "--text-field or --prompt-template",
            row_id,
        )
    if settings.chat or settings.system is not None:
        request.messages = _with_system([{"role": "user", "content": text}], settings.system)
    else:
        request.prompt = text
    return request


def did_you_mean(unknown: list[str], known: Iterable[str], cutoff: float = 0.6) -> str:
    """' (did you mean 'max_tokens'?)' for the names of ``known`` close to an unknown one (a typo; case and
    '-' for '_' aside), else ''. A higher ``cutoff`` guesses only at near misses: where an unknown name
    may be a real field that is refused (an OpenAI body's), a loose guess would point at the wrong one."""
    spelled = {name.lower().replace("-", "_"): name for name in sorted(known)}
    close = [spelled[match] for name in unknown
             for match in difflib.get_close_matches(name.lower().replace("-", "_"), list(spelled), n=1, cutoff=cutoff)]
    return f" (did you mean {', '.join(map(repr, close))}?)" if close else ""


def row_id_of(record: dict[str, Any], index: int, id_field: str | None, where: str | None = None) -> Any:
    if id_field is not None:
        if id_field not in record or record[id_field] is None:
            raise RowError(f"{where or f'row {index}'} has no id field {id_field!r} (--id-field; its fields: "
                           f"{sorted(record)[:12]})", None)
        value = record[id_field]
    elif record.get("id") is not None:
        value = record["id"]
    else:
        return index
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else str(value)


def _row_overrides(record: dict[str, Any], where: str, row_id: Any) -> dict[str, Any]:
    overrides = record.get("sampling_params")
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, str):  # CSV cells hold text: accept a JSON object
        try:
            overrides = json.loads(overrides)
        except ValueError:
            raise RowError(f"{where}: 'sampling_params' is not a JSON object: {overrides[:80]!r}", row_id) from None
    if not isinstance(overrides, dict):
        raise RowError(f"{where}: 'sampling_params' must be an object, got {type(overrides).__name__}", row_id)
    return {k: v for k, v in overrides.items() if v is not None}


def row_adapter_name(record: dict[str, Any], where: str, row_id: Any) -> str | None:
    """A generic row's ``lora`` field: an adapter's name, or None for the base model (missing, null or
    empty: CSV and Parquet give every row every column)."""
    value = record.get(ADAPTER_FIELD)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise RowError(f"{where}: {ADAPTER_FIELD!r} must be a LoRA adapter's name (a string), got "
                       f"{type(value).__name__}", row_id)
    return value


def _fill_template(template: str, record: dict[str, Any], where: str, row_id: Any) -> str:
    names = [name.split(".")[0].split("[")[0] for name in template_fields(template)]
    missing = [name for name in names if name not in record]
    if missing:
        raise RowError(f"{where} has no field(s) {missing} used by --prompt-template (fields: {sorted(record)[:12]})", row_id)
    # A null would be filled in as the text "None" and the row generated for a prompt it never had.
    nulls = sorted({name for name in names if record[name] is None})
    if nulls:
        raise RowError(f"{where}: field(s) {nulls} used by --prompt-template are null; the template needs a value "
                       "in each", row_id)
    values = {k: _as_text(v) for k, v in record.items()}
    try:
        return template.format_map(values)
    except (KeyError, IndexError, AttributeError, ValueError) as e:
        raise RowError(f"{where}: --prompt-template could not be filled: {e!r}", row_id) from None


def _as_text(value: Any) -> Any:
    # Lists of features read better as "a, b, c" than as Python's "['a', 'b', 'c']".
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        return ", ".join(str(v) for v in value)
    return value


def _text_field(record: dict[str, Any], name: str, where: str, row_id: Any) -> str:
    if name not in record:
        raise RowError(f"{where} has no field {name!r} (--text-field; fields: {sorted(record)[:12]})", row_id)
    value = record[name]
    if not isinstance(value, str):
        raise RowError(f"{where}: field {name!r} must be a string, got {type(value).__name__}", row_id)
    return value


def parse_messages(messages: Any, where: str, row_id: Any, system: str | None) -> list[dict[str, Any]]:
    if isinstance(messages, str):  # CSV cells hold text
        try:
            messages = json.loads(messages)
        except ValueError:
            raise RowError(f"{where}: 'messages' is not a JSON list of messages", row_id) from None
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects", row_id)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"{where}: messages[{i}] must be an object with a string 'role'", row_id)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RowError(f"{where}: messages[{i}].content must be a string, got {type(content).__name__}", row_id)
    # Parquet structs carry every key of every message (None where absent); templates test presence.
    cleaned = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]
    return _with_system(cleaned, system)


def _with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    if system is None or (messages and messages[0].get("role") == "system"):
        return messages
    return [{"role": "system", "content": system}, *messages]


# --- sampling ----------------------------------------------------------------------------------


@functools.cache
def sampling_field_names() -> frozenset[str]:
    from tokenmill.sampling_params import ENGINE_FILLED_FIELDS, SamplingParams

    # Python callables cannot come from a data file.
    return frozenset({f.name for f in dataclasses.fields(SamplingParams) if f.init} - ENGINE_FILLED_FIELDS - {"logits_processors"})


def shared_sampling_params(
    base: dict[str, Any], overrides: dict[str, Any], index: int, row_id: Any = None, where: str | None = None,
    made: dict[str, "SamplingParams"] | None = None,
) -> "SamplingParams":
    """A row's SamplingParams but its per-row seed: the job's values, then the row's own. Whatever
    ``output_kind`` the row names, the job reads whole outputs (CUMULATIVE): it writes each row once,
    complete.

    ``made``: the caller's SamplingParams already built and checked for ``base`` (the same every
    call), by the row's own values: a job's rows mostly repeat a few, and the rows with the same
    values share one object, not a build and every check again each (~25 µs on the dev CPU), nor
    a copy each (the engine's steps read every row's params: one object for all ran the steps of
    short rows ~4% faster, docs/perf.md 87). The engine never changes a request's params in place.
    """
    from tokenmill.sampling_params import RequestOutputKind, SamplingParams

    where = where or f"row {index}"
    unknown = sorted(set(overrides) - sampling_field_names()) if overrides else None
    if unknown:
        raise RowError(f"{where}: unknown sampling parameter(s) {unknown} in sampling_params{did_you_mean(unknown, sampling_field_names())}; "
                       f"allowed: {sorted(sampling_field_names())}", row_id)
    key = (_values_key(overrides) if overrides else "") if made is not None else None  # most rows set none
    checked = made.get(key) if made is not None and key is not None else None
    if checked is None:
        try:
            checked = SamplingParams(**{**base, **overrides})
        except (ValueError, TypeError) as e:
            raise RowError(f"{where}: {e}", row_id) from None
        checked.output_kind = RequestOutputKind.CUMULATIVE
        if made is not None and key is not None:
            if len(made) >= _PARAMS_KEPT:
                made.clear()
            made[key] = checked
    return checked


def row_seed(params: "SamplingParams", base_seed: int, index: int) -> int | None:
    """The seed a row draws with: its own (``params.seed``), else for a sampled (temperature > 0) row
    one derived from the job seed and the row index, so that its samples do not depend on which
    rows share its batch: a resumed run samples exactly what an uninterrupted one would have.
    Greedy rows need none."""
    if params.seed is not None:
        return params.seed
    return derive_seed(base_seed, index) if params.temperature > 0 else None


_PARAMS_KEPT = 1024  # distinct rows' values kept by shared_sampling_params's ``made``


def _values_key(values: dict[str, Any]) -> str | None:
    try:  # keys in their order: a JSON schema's property order is part of its constraint
        return json.dumps(values)
    except (TypeError, ValueError):  # not JSON (a Parquet cell's own types): built every time
        return None


def check_engine_limits(params: "SamplingParams", max_model_len: int, max_num_seqs: int,
                        cap_max_tokens: bool = False) -> None:
    """Refuse values no run of this engine can serve (a ValueError naming the field and the limit):
    more samples than run in one batch, or, unless ``cap_max_tokens``, more tokens than a sequence
    may hold. With ``cap_max_tokens`` (a job's rows, as LLM.generate) such a max_tokens runs until
    the sequence fills max_model_len; an OpenAI line is refused as vLLM's server refuses it."""
    if not cap_max_tokens and params.max_tokens is not None and params.max_tokens > max_model_len:
        raise ValueError(f"SamplingParams.max_tokens={params.max_tokens} is invalid: must be <= max_model_len "
                         f"({max_model_len}), the most tokens a sequence holds")
    if params.num_samples > max_num_seqs:
        name = "best_of" if params.best_of is not None else "n"
        raise ValueError(f"SamplingParams.{name}={params.num_samples} is invalid: must be <= max_num_seqs "
                         f"({max_num_seqs}), since a row's samples run in one batch")


def check_prompt_room(params: "SamplingParams", prompt: Any, max_model_len: int, where: str, row_id: Any) -> None:
    """Refuse (a RowError) a request whose prompt and max_tokens together pass max_model_len, as vLLM's
    server refuses it, where LLM.generate caps it: the job applies it to OpenAI lines whose max_tokens
    the line or --max-tokens set. Only a prompt already tokenized is measured (text the batch tokenizer
    refused is tokenized by the engine, which caps it); one too long alone is the engine's to refuse."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if params.max_tokens is None or not isinstance(ids, list):
        return
    used = len(ids)
    if params.truncate_prompt_tokens is not None:  # -1: max_model_len
        used = min(used, max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens)
    if used < max_model_len < used + params.max_tokens:
        raise RowError(f"{where}: max_tokens={params.max_tokens} is too large: the prompt has {used} tokens and "
                       f"max_model_len is {max_model_len}, leaving {max_model_len - used} for the completion "
                       "(vLLM's server refuses such a request too)", row_id)


PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")  # where a row's own prompt is, without --text-field


def _misspelt_prompt_fields(names: Iterable[str]) -> str:
    """'; is 'promt' meant to be 'prompt'?' for each name close to a prompt field, else ''."""
    misspelt = [(name, close[0]) for name in sorted(names) for close in [difflib.get_close_matches(name, PROMPT_FIELDS, n=1)]
                if close]
    return "".join(f"; is {name!r} meant to be {field!r}?" for name, field in misspelt[:3])


def check_columns(columns: list[str], settings: PromptSettings, source: str) -> None:
    """For inputs with a schema (CSV header, Parquet): the columns the prompt settings read must exist.

    Checked before the model loads, so a typo costs a second, not a model load and a file of error rows.
    """
    have = set(columns)
    shown = sorted(columns)[:20]
    if settings.id_field is not None and settings.id_field not in have:
        raise ValueError(f"{source} has no column {settings.id_field!r} (--id-field){did_you_mean([settings.id_field], have)}; "
                         f"its columns: {shown}")
    if settings.prompt_template is not None:
        missing = [n for n in template_fields(settings.prompt_template) if n.split(".")[0].split("[")[0] not in have]
        if missing:
            raise ValueError(f"{source} has no column(s) {missing} used by --prompt-template{did_you_mean(missing, have)}; "
                             f"its columns: {shown}")
    elif settings.text_field is not None:
        if settings.text_field not in have:
            raise ValueError(f"{source} has no column {settings.text_field!r} (--text-field)"
                             f"{did_you_mean([settings.text_field], have)}; its columns: {shown}")
    elif not have & set(PROMPT_FIELDS):
        raise ValueError(f"{source} has no 'prompt', 'messages' or 'prompt_token_ids' column (its columns: {shown}"
                         f"{_misspelt_prompt_fields(have)}); "
                         "pass --text-field or --prompt-template")


def derive_seed(base_seed: int, index: int) -> int:
    digest = hashlib.blake2b(f"{base_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF
