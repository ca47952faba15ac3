"""One dataset row ↔ the engine: what a row asks for, and the columns its result adds.

A generation row holds ``messages`` (chat, rendered with the model's template; with them, the
row's ``tools``, ``documents`` and ``chat_template_kwargs`` reach the template as in the batch job,
`tokenmill.batch.chat_options`; a conversation ending with an assistant message is continued, as
Ray's stage continues it), ``prompt`` (text) or ``prompt_token_ids`` (``tokenized_prompt``,
Ray's name, too), and optionally
``sampling_params`` (a dict, a JSON object or a `SamplingParams`; without it the model's
generation_config defaults, as `LLM.generate`) and ``model``: a LoRA adapter's name (Ray's rule:
any value but the base model's names one; `AdapterNames`). Pooling rows hold ``prompt`` or
``prompt_token_ids`` (embed, classify) or ``text_1`` and ``text_2`` (score), and optionally
``pooling_params``; they are translated by the batch job's `PoolingRows`, so both paths agree.

Result columns (Ray Data vLLM stage's names where it has them):

    every task   num_input_tokens, __inference_error__ ("" on success, else why the row failed)
    generate     prompt, prompt_token_ids, generated_text, generated_tokens, num_generated_tokens,
                 finish_reason, cumulative_logprob, logprobs and prompt_logprobs (when asked for; a
                 prompt's first position, which nothing predicts, is null), metrics
    embed        embeddings (Ray's name) and embedding (the same vector)
    classify     probs, label
    score        score

Columns have fixed Arrow types, so every block of the output has the same schema.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.batch.pooling import PoolingRows

ERROR_COLUMN = "__inference_error__"
TASKS = ("generate", "embed", "classify", "score")
_METRIC_FIELDS = ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time")


class RowProblem(ValueError):
    """This row cannot run; it becomes an error row."""


@dataclass
class RowJob:
    """One row on its way through the engine: its requests, then its outputs or its error."""

    position: int  # in the batch
    parts: list[tuple[str, Any, Any]] = field(default_factory=list)  # (request id, prompt, params)
    outputs: dict[str, Any] = field(default_factory=dict)  # request id -> finished output
    error: str | None = None
    prompt_text: str | None = None
    pooling_request: Any = None  # the batch job's RowRequest of a pooling row
    lora: Any = None  # the LoRARequest its 'model' names (generation rows)

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.outputs) == len(self.parts)


def generation_parts(row: dict[str, Any], request_id: str, llm: Any, chat_template: str | None,
                     apply_chat_template: bool, chat_template_kwargs: dict[str, Any] | None = None,
                     ) -> tuple[list[tuple[str, Any, Any]], str | None]:
    """The engine request of a generation row, and its prompt text (None for token ids).
    ``chat_template_kwargs``: the chat template stage's variables, under the row's own."""
    params = _sampling_params(row.get("sampling_params"), llm)
    if params.n != 1 or (params.best_of or 1) != 1:
        raise RowProblem(f"sampling_params n={params.n} (best_of={params.best_of}): the processor writes one "
                         "completion per row; repeat the row for more samples")
    _check_engine_limits(params, llm)
    messages = row.get("messages")
    if messages is not None and apply_chat_template:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise RowProblem("'messages' need the tokenizer, but the engine runs without one (skip_tokenizer_init)")
        ids = _chat_prompt_ids(row, tokenizer, chat_template, chat_template_kwargs)
        text = tokenizer.decode(ids)
        return [(request_id, {"prompt_token_ids": ids, "prompt": text}, params)], text
    if messages is not None:
        raise RowProblem("'messages' need the chat template, but apply_chat_template is off; give a 'prompt'")
    prompt = row.get("prompt")
    if isinstance(prompt, str):  # "" too, as LLM.generate takes it: a BOS runs, no token at all the engine refuses
        return [(request_id, prompt, params)], prompt
    ids = row.get("prompt_token_ids", row.get("tokenized_prompt"))
    if ids is None and prompt is not None:
        raise RowProblem(f"'prompt' must be a string, got {type(prompt).__name__}")
    if ids is None:
        raise RowProblem(f"the row has no prompt: it needs 'messages', 'prompt' or 'prompt_token_ids' "
                         f"(columns: {sorted(row)[:12]}); return one from preprocess")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RowProblem("'prompt_token_ids' must be a list of integers")
    return [(request_id, {"prompt_token_ids": ids}, params)], None


def _chat_prompt_ids(row: dict[str, Any], tokenizer: Any, chat_template: str | None,
                     chat_template_kwargs: dict[str, Any] | None) -> list[int]:
    """A messages row rendered as the batch job renders one (its tools, documents and
    chat_template_kwargs: `tokenmill.batch.chat_options`), with the stage's variables under the row's
    own; a conversation ending with an assistant message (a prefill) is continued, as Ray's chat
    template stage continues it, not given a new assistant turn."""
    from tokenmill.batch.chat_options import ChatOptions, row_chat_options
    from tokenmill.batch.requests import RowRequest, parse_messages
    from tokenmill.batch.row_prompts import row_prompt

    try:
        conversation = parse_messages(row["messages"], "row", None, None)
        chat = row_chat_options(row, "row")
        if chat_template_kwargs:
            own = chat.chat_template_kwargs if chat is not None else None
            chat = dataclasses.replace(chat or ChatOptions(), chat_template_kwargs={**chat_template_kwargs, **(own or {})})
        if conversation[-1]["role"] == "assistant":
            chat = dataclasses.replace(chat or ChatOptions(), add_generation_prompt=False, continue_final_message=True)
        return row_prompt(tokenizer, RowRequest(0, None, messages=conversation, chat=chat, where="row"),
                          chat_template)["prompt_token_ids"]
    except ValueError as e:  # a bad field, or the template refused this conversation: this row's error
        raise RowProblem(str(e)) from None


class AdapterNames:
    """A row's ``model`` → its LoRARequest: the folder ``<lora_root>/<model>`` (``<model>`` itself without
    a root), ids 1, 2, ... by first appearance. None, "" and the base model's name mean no adapter."""

    def __init__(self, model_source: str, lora_root: str | None):
        self.model_source = model_source
        self.lora_root = lora_root
        self._ids: dict[str, int] = {}

    def adapter(self, row: dict[str, Any]) -> Any:
        name = row.get("model")
        if name is None or name == "" or name == self.model_source:
            return None
        if not isinstance(name, str):
            raise RowProblem(f"'model' must be a LoRA adapter's name (a string), got {type(name).__name__}")
        import os

        from tokenmill.lora.request import LoRARequest

        lora_id = self._ids.setdefault(name, len(self._ids) + 1)
        return LoRARequest(name, lora_id, os.path.join(self.lora_root, name) if self.lora_root else name)


def _sampling_params(value: Any, llm: Any) -> Any:
    from tokenmill.sampling_params import SamplingParams

    if value is None:
        return llm.get_default_sampling_params()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, str):  # a JSON object in a text column
        try:
            value = json.loads(value)
        except ValueError:
            raise RowProblem(f"'sampling_params' is not a JSON object: {value[:80]!r}") from None
    if not isinstance(value, dict):
        raise RowProblem(f"'sampling_params' must be a dict or a SamplingParams, got {type(value).__name__}")
    # None means "not set": Arrow gives a struct column every key any row used, None where absent.
    given = {name: v for name, v in value.items() if v is not None}
    try:
        return SamplingParams.from_optional(**given)
    except (TypeError, ValueError) as e:
        raise RowProblem(f"sampling_params: {e}") from None


def _check_engine_limits(params: Any, llm: Any) -> None:
    """The batch job's up-front refusals (values no run of this engine can serve), as this row's error. A
    max_tokens past the context runs until the sequence fills max_model_len, as LLM.generate's and
    the batch job's rows do (vLLM's offline engine caps it the same way)."""
    from tokenmill.batch.requests import check_engine_limits

    config = llm.llm_engine.config
    try:
        check_engine_limits(params, config.max_model_len, config.max_num_seqs, cap_max_tokens=True)
    except ValueError as e:
        raise RowProblem(str(e)) from None


def pooling_job(rows: "PoolingRows", row: dict[str, Any], position: int, request_prefix: str) -> RowJob:
    """A pooling row's engine requests, through the batch job's translation (same rules, same results)."""
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.requests import RowError

    record = {k: v for k, v in row.items() if v is not None}  # None: a column this row does not use
    if "tokenized_prompt" in record and "prompt_token_ids" not in record:
        record["prompt_token_ids"] = record.pop("tokenized_prompt")
    try:
        request, parts = rows.build(RawRow(position, record, where="row"))
    except RowError as e:
        raise RowProblem(str(e)) from None
    return RowJob(position, parts=[(f"{request_prefix}{request_id}", prompt, params) for request_id, prompt, params in parts],
                  pooling_request=request)


# --- result columns ------------------------------------------------------------------------------


def column_types(task: str) -> dict[str, Any]:
    """The Arrow type of each result column of ``task``."""
    import pyarrow as pa

    common = {"num_input_tokens": pa.int64(), ERROR_COLUMN: pa.string()}
    if task == "generate":
        logprob = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64()), ("rank", pa.int64()),
                             ("decoded_token", pa.string())])
        return {"prompt": pa.string(), "prompt_token_ids": pa.list_(pa.int64()), **common,
                "generated_text": pa.string(), "generated_tokens": pa.list_(pa.int64()),
                "num_generated_tokens": pa.int64(), "finish_reason": pa.string(),
                "cumulative_logprob": pa.float64(), "logprobs": pa.list_(pa.list_(logprob)),
                "prompt_logprobs": pa.list_(pa.list_(logprob)),
                "metrics": pa.struct([(name, pa.float64()) for name in _METRIC_FIELDS])}
    if task == "embed":
        return {**common, "embeddings": pa.list_(pa.float32()), "embedding": pa.list_(pa.float32())}
    if task == "classify":
        return {**common, "probs": pa.list_(pa.float32()), "label": pa.string()}
    return {**common, "score": pa.float64()}


def result_columns(task: str, job: RowJob, rows: "PoolingRows | None") -> dict[str, Any]:
    """One row's result columns (every column of `column_types`, None where it does not apply)."""
    values: dict[str, Any] = dict.fromkeys(column_types(task))
    values[ERROR_COLUMN] = job.error or ""
    if task == "generate":
        values["prompt"] = job.prompt_text
        values.update(generated_text="", generated_tokens=[], num_generated_tokens=0, num_input_tokens=0)
    if job.error is not None:
        return values
    outputs = [job.outputs[request_id] for request_id, _, _ in job.parts]
    values["num_input_tokens"] = sum(len(o.prompt_token_ids or []) for o in outputs)
    if task == "generate":
        out = outputs[0]
        sample = out.outputs[0]
        values.update(
            prompt=out.prompt if out.prompt is not None else job.prompt_text,
            prompt_token_ids=list(out.prompt_token_ids or []), generated_text=sample.text,
            generated_tokens=list(sample.token_ids), num_generated_tokens=len(sample.token_ids),
            finish_reason=sample.finish_reason, cumulative_logprob=sample.cumulative_logprob,
            logprobs=_logprobs(sample.logprobs), prompt_logprobs=_logprobs(out.prompt_logprobs),
            metrics={name: getattr(out.metrics, name) for name in _METRIC_FIELDS} if out.metrics is not None else None,
        )
        return values
    assert rows is not None
    pooled = rows.result(job.pooling_request, outputs).pooled or {}
    if task == "embed":
        values["embeddings"] = values["embedding"] = pooled["embedding"]
    else:
        values.update({name: pooled[name] for name in pooled if name in values})
    return values


def _logprobs(logprobs: Any) -> list[list[dict[str, Any]]] | None:
    if logprobs is None:
        return None
    return [[{"token_id": token_id, "logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in position.items()] if position else None for position in logprobs]
