"""The OpenAI batch format: input lines in, OpenAI-shaped output lines out.

Input line:  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "...", "messages": [...], "max_tokens": 20, ...}}
Output line: {"id": "batch_req_...", "custom_id": "r1",
              "response": {"status_code": 200, "request_id": "req_...",
                           "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": ...,
                                    "model": "...", "choices": [...], "usage": {...}}},
              "error": null}
Lines for a pooling model (``/v1/embeddings`` under ``--task embed``, ``/v1/score`` and ``/v1/rerank``
under ``--task score``) are read and answered by openai_pooling.py.
With ``--lora-modules`` a line's ``body.model`` selects the adapter of that name (the base model's
name, or no ``model``, runs without one) and the output's ``body.model`` names the adapter that ran,
as vLLM's server answers; without adapters ``model`` is ignored (see lora_modules.py).
A refused request (an unsupported field, bad values, a prompt too long) gets ``status_code`` 400 and
an OpenAI error body, one the engine failed on a 500; a line that is not a request at all (bad JSON,
no custom_id, see openai_lines.NotARequest) gets ``response: null`` and a top-level ``error``, as
OpenAI's error file does.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tokenmill.batch.chat_options import BODY_FIELDS, body_chat_options
from tokenmill.batch.openai_lines import CHAT_URL, COMPLETIONS_URL, POOLING_TASKS, open_line, stable_id
from tokenmill.batch.openai_pooling import pooling_body
from tokenmill.batch.requests import OpenAIMeta, RowError, RowRequest, did_you_mean, parse_messages
from tokenmill.batch.results import json_logprob
from tokenmill.inputs import short_repr

if TYPE_CHECKING:
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.results import RowResult

# body key -> SamplingParams field (OpenAI's names, plus the extra ones vLLM's server accepts).
_COMMON = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids", "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
    # An object {"max_pattern_size", "min_pattern_size", "min_count"}, as vLLM's server takes it.
    "repetition_detection": "repetition_detection",
    # vLLM's server takes it for reasoning models; SamplingParams refuses a set value with the reason.
    "thinking_token_budget": "thinking_token_budget",
    # vLLM's extension: the prompt's logprobs, answered as vLLM's server does (a completion choice's,
    # a chat response's "prompt_logprobs": per prompt position, null first, {token id: logprob, rank, text}).
    "prompt_logprobs": "prompt_logprobs",
    # OpenAI's {"token id": bias} (the ids as JSON strings), and vLLM's extras.
    "logit_bias": "logit_bias", "allowed_token_ids": "allowed_token_ids", "bad_words": "bad_words",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "truncate_prompt_tokens": "truncate_prompt_tokens",
    # vLLM's constraint object ({"json": schema}, {"regex": ...}, {"choice": [...]}, ...); response_format sets it too.
    "structured_outputs": "structured_outputs",
}
# Accepted and without effect offline ("model" selects a LoRA adapter when the job has some). vLLM
# reads length_penalty for beam search only, request_id / session_id for its logs and ids.
_IGNORED = {"model", "user", "stream", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls",
            "length_penalty", "request_id", "session_id"}
# Accepted at vLLM's default, which is what runs here (a body dumped from vLLM's request object
# carries them); another value is refused: it asks for what this job does not do.
_AT_DEFAULT = {"use_beam_search": False, "echo": False, "priority": 0, "include_reasoning": True,
               "return_tokens_as_token_ids": False, "return_token_ids": False}
# add_special_tokens: the chat template's text is tokenized without (its own BOS is the only one), a
# completion's prompt with them (vLLM's defaults per url).
_ADD_SPECIAL_TOKENS = {CHAT_URL: False, COMPLETIONS_URL: True}


def build_openai_request(raw: "RawRow") -> RowRequest:
    """Translate one OpenAI batch line; raises RowError (carrying the custom_id) for a bad request."""
    where, custom_id, url, body = open_line(raw, "generate")
    stream = body.get("stream")
    if stream is not None and stream is not False:  # "yes" or 1 would have run as if it were false
        raise RowError(f"{where}: body.stream={stream!r} is not supported in a batch (each answer is written whole): "
                       "leave it out, or false", custom_id)
    chat_fields = {"messages", "logprobs", "top_logprobs", *BODY_FIELDS}
    allowed = set(_COMMON) | _IGNORED | set(_AT_DEFAULT) | {"response_format", "add_special_tokens"} | (
        chat_fields if url == CHAT_URL else {"prompt", "logprobs"})
    # A null is "not set" (bodies dumped from typed request objects carry every field, most of them null).
    unknown = sorted(key for key, value in body.items() if key not in allowed and value is not None)
    if unknown:
        # A near miss of a field this url takes is a typo, not a feature to wait for (vLLM's fields that
        # are refused here, e.g. logprob_token_ids, are no nearer than 0.85 to one taken).
        hint = did_you_mean(unknown, allowed, cutoff=0.85) or " yet"
        raise RowError(f"{where}: body field(s) {unknown} are not supported by tokenmill{hint} (supported: {sorted(allowed)})",
                       custom_id)
    _check_at_default(body, {**_AT_DEFAULT, "add_special_tokens": _ADD_SPECIAL_TOKENS[url]}, where, custom_id)
    overrides = {_COMMON[k]: v for k, v in body.items() if k in _COMMON and v is not None}
    constraint = response_format_constraint(body.get("response_format"), f"{where}: body.response_format", custom_id)
    given = overrides.get("structured_outputs")
    if constraint is not None and (given is None or isinstance(given, dict)):  # (a given non-object is refused by name)
        overrides["structured_outputs"] = {**(given or {}), **constraint}  # over its keys, as vLLM merges them
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name wins over max_tokens (as vLLM's server)
        overrides["max_tokens"] = body["max_completion_tokens"]
    model = body.get("model")
    # The adapter, if the job has one of that name (lora_modules.JobAdapters.for_row); a name that is
    # not a string matches nothing.
    adapter = model if model is None or isinstance(model, str) else str(model)
    request = RowRequest(index=raw.index, row_id=custom_id, overrides=overrides, adapter=adapter, where=where)
    top_logprobs = None
    if url == CHAT_URL:
        if "messages" not in body:
            raise RowError(f"{where}: body.messages is required for {CHAT_URL}", custom_id)
        request.messages = parse_messages(body["messages"], f"{where}: body", custom_id, None)
        try:
            request.chat = body_chat_options(body, where)
        except ValueError as e:
            raise RowError(str(e), custom_id) from None
        asks = body.get("logprobs")
        if asks is not None and not isinstance(asks, bool):
            raise RowError(f"{where}: body.logprobs={asks!r} is invalid: must be true or false", custom_id)
        top = body.get("top_logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
            raise RowError(f"{where}: body.top_logprobs={top!r} is invalid: must be an integer in [0, 20]", custom_id)
        if top is not None and not asks:  # OpenAI refuses it too, rather than returning no logprobs
            raise RowError(f"{where}: body.top_logprobs={top!r} needs body.logprobs=true", custom_id)
        if asks:
            top_logprobs = top or 0
            overrides["logprobs"] = top_logprobs
    else:
        _set_completion_prompt(request, body.get("prompt"), where, custom_id)
        if body.get("logprobs") is not None:
            overrides["logprobs"] = body["logprobs"]
    request.openai = OpenAIMeta(custom_id=custom_id, url=url, top_logprobs=top_logprobs)
    return request


def response_format_constraint(response_format: Any, where: str, custom_id: str) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the structured-outputs constraint vLLM makes of it: ``text``
    none, ``json_object`` any JSON object, ``json_schema`` its ``json_schema.schema``, and
    ``structural_tag`` (vLLM's extension) the whole object as xgrammar's JSON."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
            raise RowError(f"{where}.json_schema={short_repr(spec)} is invalid: must be "
                           '{"name": "...", "schema": {a JSON schema object}} (OpenAI\'s form)', custom_id)
        return {"json": spec["schema"]}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    raise RowError(f"{where}={short_repr(response_format)} is invalid: must be an object whose type is 'text', "
                   "'json_object', 'json_schema' or 'structural_tag'", custom_id)


def _check_at_default(body: dict[str, Any], defaults: dict[str, Any], where: str, custom_id: str) -> None:
    for name, default in defaults.items():
        value = body.get(name)
        if value is not None and (value != default or type(value) is not type(default)):
            raise RowError(f"{where}: body.{name}={short_repr(value)} is not supported by tokenmill: only vLLM's default "
                           f"{json.dumps(default)} (what runs here) is accepted", custom_id)


def _set_completion_prompt(request: RowRequest, prompt: Any, where: str, custom_id: str) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        # "" too, as vLLM's server and OpenAI take it: tokenized as any text (a BOS may make a token
        # of it); with no token the engine refuses it by name, as vLLM's does.
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        request.prompt_token_ids = list(prompt)
    else:
        raise RowError(
            f"{where}: body.prompt must be a string or a non-empty list of token ids (one prompt per batch line)", custom_id
        )


# --- output ------------------------------------------------------------------------------------

def openai_record(result: "RowResult", model: str, created: int, job_key: str) -> dict[str, Any]:
    """The output line for one row (ids derive from the job and row, so a rerun writes the same ones)."""
    meta = result.openai
    custom_id = meta.custom_id if meta is not None else (result.row_id if isinstance(result.row_id, str) else None)
    line_id = stable_id("batch_req_", job_key, result.index)
    if result.error is not None and meta is None:
        # Not a request at all (undecodable line, no custom_id): OpenAI's error-file shape.
        return {"id": line_id, "custom_id": custom_id, "response": None,
                "error": {"code": "invalid_request", "message": result.error}}
    request_id = stable_id("req_", job_key, result.index)
    if result.error is not None:
        # OpenAI's error bodies: a request at fault is a 400 (a model the job does not serve a 404,
        # code "model_not_found"), the engine at fault a 500 (vLLM's server answers a request the
        # engine ended with finish_reason "error" with a 500 too).
        status, kind = (500, "server_error") if result.engine_fault else (result.error_status, "invalid_request_error")
        code = "model_not_found" if status == 404 else None
        body: dict[str, Any] = {"error": {"message": result.error, "type": kind, "param": result.error_param, "code": code}}
        return {"id": line_id, "custom_id": custom_id,
                "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}
    assert meta is not None
    if meta.url in POOLING_TASKS:
        return {"id": line_id, "custom_id": custom_id, "error": None,
                "response": {"status_code": 200, "request_id": request_id, "body": pooling_body(result, meta, model, created, job_key)}}
    chat = meta.url == CHAT_URL
    completion_tokens = sum(s.num_tokens for s in result.samples)
    body = {
        "id": stable_id("chatcmpl-" if chat else "cmpl-", job_key, result.index),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": result.lora or model,  # the adapter the row ran with, under its name (vLLM's server)
        "choices": [_chat_choice(s, meta) if chat else _completion_choice(s) for s in result.samples],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": result.prompt_tokens + completion_tokens},
        "system_fingerprint": None,
    }
    if result.prompt_logprobs is not None:
        positions = _prompt_positions(result.prompt_logprobs)
        if chat:
            body["prompt_logprobs"] = positions
        else:
            for choice in body["choices"]:
                choice["prompt_logprobs"] = positions
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


class OpenAIRecordReader:
    """Reads an output line back as (row, failed, prompt tokens, generated tokens), or None.

    A line names its row only through its id, which derives from the job and the row index; the
    id -> row table is built on the first call (only a lost journal needs it).
    """

    def __init__(self, job_key: str, rows: int):
        self.job_key, self.rows = job_key, rows
        self._rows_by_id: dict[str, int] | None = None

    def __call__(self, line: dict[str, Any]) -> tuple[int, bool, int, int] | None:
        if self._rows_by_id is None:
            self._rows_by_id = {stable_id("batch_req_", self.job_key, i): i for i in range(self.rows)}
        index = self._rows_by_id.get(line.get("id"))  # type: ignore[arg-type]
        if index is None:
            return None
        response = line.get("response") or {}
        usage = (response.get("body") or {}).get("usage") or {}
        failed = line.get("error") is not None or response.get("status_code") != 200
        return index, failed, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)

    def is_row(self, line: dict[str, Any], row: int) -> bool:
        """Whether ``line`` is the output line of ``row`` (checked on every resume: no id table)."""
        return line.get("id") == stable_id("batch_req_", self.job_key, row)


def _chat_choice(sample: Any, meta: OpenAIMeta) -> dict[str, Any]:
    logprobs = None
    if meta.top_logprobs is not None and sample.logprobs is not None:
        logprobs = {"content": [_chat_token_logprob(tok, pos, meta.top_logprobs) for tok, pos in zip(sample.token_ids, sample.logprobs)]}
    # "refusal" is part of OpenAI's message (null: the model did not refuse); "stop_reason" is vLLM's.
    return {"index": sample.index, "message": {"role": "assistant", "content": sample.text, "refusal": None},
            "logprobs": logprobs, "finish_reason": sample.finish_reason, "stop_reason": sample.stop_reason}


def _chat_token_logprob(token_id: int, position: dict[int, Any], top: int) -> dict[str, Any]:
    chosen = position.get(token_id)
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return {
        **_token_entry(token_id, chosen),
        "top_logprobs": [_token_entry(t, lp) for t, lp in ranked[:top]],
    }


def _token_entry(token_id: int, lp: Any) -> dict[str, Any]:
    text = (lp.decoded_token if lp is not None else None) or ""
    return {"token": text, "logprob": json_logprob(lp.logprob) if lp is not None else None,
            "bytes": list(text.encode("utf-8", "replace"))}


def _prompt_positions(positions: Any) -> list[dict[str, dict[str, Any]] | None]:
    """The prompt's positions as vLLM's server writes them: null where nothing was scored (the
    first token), else {token id: {"logprob", "rank", "decoded_token"}} (JSON keys are strings;
    -inf as -9999.0)."""
    return [{str(token_id): {"logprob": json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in position.items()} if position else None for position in positions]


def _completion_choice(sample: Any) -> dict[str, Any]:
    logprobs = None
    if sample.logprobs is not None:
        tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
        for token_id, position in zip(sample.token_ids, sample.logprobs):
            chosen = position.get(token_id)
            text = (chosen.decoded_token if chosen is not None else None) or ""
            tokens.append(text)
            token_logprobs.append(json_logprob(chosen.logprob) if chosen is not None else None)
            tops.append({(lp.decoded_token or ""): json_logprob(lp.logprob) for lp in position.values()})
            offsets.append(offset)
            offset += len(text)
        logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return {"index": sample.index, "text": sample.text, "logprobs": logprobs, "finish_reason": sample.finish_reason,
            "stop_reason": sample.stop_reason}
