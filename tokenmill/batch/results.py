"""A finished row (its samples or its error) and the generic output records it becomes.

Generic records (JSONL or Parquet output of non-OpenAI input) have one fixed schema, one record
per sample (``n`` records for ``n > 1``), or one record with ``error`` set for a failed row:

    row                 int     the row's index in the input (outputs are in completion order)
    id                  str|int the row's id field (``--id-field``, else ``id``), else its index
    sample_index        int     0..n-1 (null for an error row)
    text                str     the completion (null for an error row)
    finish_reason       str     "stop" | "length" | "repetition" (null for an error row)
    prompt_tokens       int
    completion_tokens   int
    cumulative_logprob  float   when logprobs were asked for, else null
    prompt_logprob      float   when prompt_logprobs were asked for: the prompt's log-likelihood, the
                                sum of prompt_token_logprobs (perplexity: exp(-it / (prompt_tokens - 1))),
                                else null
    prompt_token_logprobs list[float]  when prompt_logprobs were asked for: each prompt token's
                                logprob given the tokens before it, from the second token on
                                (prompt_tokens - 1 values; a span's sum scores a continuation), else null
    error               str     why the row failed, else null
    lora                str     only in jobs with LoRA adapters (--lora-modules): the adapter the row
                                ran with, null for the base model and for an error row

A logprob of -inf is written -9999.0 and a NaN null (`json_logprob`), as the OpenAI lines are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenmill.logprobs import FlatLogprobs

if TYPE_CHECKING:
    from tokenmill.batch.requests import OpenAIMeta
    from tokenmill.outputs import RequestOutput


@dataclass
class SampleResult:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: Any = None  # the engine's SampleLogprobs, when asked for
    stop_reason: int | str | None = None  # the stop string or token id that ended it (None: eos, length)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class RowResult:
    index: int
    row_id: Any
    prompt_tokens: int = 0
    samples: list[SampleResult] = field(default_factory=list)
    error: str | None = None
    openai: "OpenAIMeta | None" = None
    pooled: dict[str, Any] | None = None  # a pooling task's output fields (see batch/pooling.py)
    lora: str | None = None  # the name of the LoRA adapter the row ran with (None: the base model)
    prompt_token_logprobs: list[float] | None = None  # when the row asked for prompt logprobs
    prompt_logprobs: Any = None  # OpenAI rows asking for them: the engine's positions, written whole
    # The row failed for the engine's reasons, not its request's (the engine ended it unfinished, or
    # failed on it, or its output could not be written): an OpenAI line's HTTP 500, not 400.
    engine_fault: bool = False
    # An OpenAI line refused for its request: the HTTP status (400, or 404 for an unknown model) and
    # the body field at fault, when known (its error body's "param").
    error_status: int = 400
    error_param: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


def result_from_output(index: int, row_id: Any, output: "RequestOutput", openai: "OpenAIMeta | None", keep_logprobs: bool) -> RowResult:
    samples = [
        SampleResult(
            index=c.index,
            text=c.text,
            token_ids=list(c.token_ids),
            finish_reason=c.finish_reason,
            cumulative_logprob=c.cumulative_logprob if keep_logprobs else None,
            logprobs=c.logprobs if keep_logprobs else None,
            stop_reason=c.stop_reason,
        )
        for c in sorted(output.outputs, key=lambda c: c.index)
    ]
    lora = getattr(output, "lora_request", None)  # what the engine ran, not what was asked
    openai_row = openai is not None
    return RowResult(index=index, row_id=row_id, prompt_tokens=len(output.prompt_token_ids or []), samples=samples,
                     openai=openai, lora=lora.lora_name if lora is not None else None,
                     prompt_token_logprobs=None if openai_row else prompt_token_logprobs(output),
                     prompt_logprobs=output.prompt_logprobs if openai_row else None)


def prompt_token_logprobs(output: "RequestOutput") -> list[float] | None:
    """Each prompt token's own logprob from the second token on (None if the request asked for no
    prompt logprobs). Both containers list a position's own token first (`tokenmill.logprobs`); the
    flat one is read column-wise, without building a dict a position."""
    positions = output.prompt_logprobs
    if positions is None:
        return None
    if isinstance(positions, FlatLogprobs):
        return [positions.logprobs[start] for start, end in zip(positions.start_indices[1:], positions.end_indices[1:])
                if end > start]
    token_ids = output.prompt_token_ids or []
    return [position[token_id].logprob for token_id, position in zip(token_ids[1:], positions[1:]) if position]


# What vLLM's server writes for a logprob of -inf (a token a filter cut, in the engine's processed
# logprobs modes): JSON has no infinity, and json.dumps's -Infinity is refused by strict readers.
_LOWEST_LOGPROB = -9999.0


def json_logprob(logprob: float | None) -> float | None:
    """A logprob JSON can hold, as vLLM's server writes it: -inf as -9999.0, NaN (logits that
    overflowed; +inf, which no logprob should be, alike) as null, which is what pydantic's JSON
    makes of them."""
    if logprob is None or math.isnan(logprob) or logprob == math.inf:
        return None
    return max(logprob, _LOWEST_LOGPROB)


def generic_records(result: RowResult, with_lora: bool = False) -> list[dict[str, Any]]:
    """The row's records; ``with_lora`` (a job with adapters) adds the ``lora`` field, so the records of
    jobs without adapters keep their schema."""
    if result.error is not None:
        records = [{"row": result.index, "id": result.row_id, "sample_index": None, "text": None, "finish_reason": None,
                    "prompt_tokens": result.prompt_tokens, "completion_tokens": 0, "cumulative_logprob": None,
                    "prompt_logprob": None, "prompt_token_logprobs": None, "error": result.error}]
    else:
        scored = result.prompt_token_logprobs
        prompt_logprob = json_logprob(math.fsum(scored)) if scored is not None else None
        if scored is not None and not all(map(math.isfinite, scored)):  # as the OpenAI lines write them
            scored = [json_logprob(lp) for lp in scored]
        records = [
            {"row": result.index, "id": result.row_id, "sample_index": s.index, "text": s.text,
             "finish_reason": s.finish_reason, "prompt_tokens": result.prompt_tokens,
             "completion_tokens": s.num_tokens, "cumulative_logprob": json_logprob(s.cumulative_logprob),
             "prompt_logprob": prompt_logprob, "prompt_token_logprobs": scored, "error": None}
            for s in result.samples
        ]
    if with_lora:
        for record in records:
            record["lora"] = result.lora
    return records


def read_result_record(record: dict[str, Any]) -> tuple[int, bool, int, int] | None:
    """A generic or pooling record read back: (row, failed, the row's prompt tokens, generated
    tokens), or None if it is not one (a lost journal is rebuilt from these)."""
    row = record.get("row")
    if not isinstance(row, int) or isinstance(row, bool) or row < 0:
        return None
    return row, record.get("error") is not None, int(record.get("prompt_tokens") or 0), int(record.get("completion_tokens") or 0)
