"""`tokenmill run --task embed|classify|score`: rows in, vectors, labels or scores out.

A row's text comes from the same places as for generation (``--prompt-template``, ``--text-field``,
the row's ``prompt`` or ``prompt_token_ids``); a score row carries the pair in ``text_1`` and
``text_2``. A row may set PoolingParams fields (``dimensions``, ``normalize``, ``use_activation``,
``truncate_prompt_tokens``; a score row also ``extra_kwargs``, vLLM's ``max_tokens_per_query`` /
``max_tokens_per_doc``, which cut its texts as LLM.score does) in a ``pooling_params`` object.

Output records (besides ``row``, ``id``, ``prompt_tokens`` and ``error``):

    embed     embedding  list[float]
    classify  label      str          the most probable label (config.id2label)
              probs      list[float]  one per label, in label order
    score     score      float        a cross-encoder's score, or the cosine of the two embeddings

A score row is one engine request for a cross-encoder (the pair read together) and two for an
embedding model (one per text); the row is written when all of its requests are done.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING, Any

from tokenmill.batch.requests import PromptSettings, RowError, RowRequest, build_row_request, row_id_of
from tokenmill.inputs import short_repr

if TYPE_CHECKING:
    import numpy as np

    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.results import RowResult
    from tokenmill.outputs import PoolingRequestOutput
    from tokenmill.pooling_params import PoolingParams

POOLING_JOB_TASKS = ("embed", "classify", "score")
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"  # --task embed and score without --model
TASK_FIELDS: dict[str, tuple[str, ...]] = {"embed": ("embedding",), "classify": ("label", "probs"), "score": ("score",)}
# Engine requests of one row: (request id, prompt, params).
Parts = list[tuple[str, Any, "PoolingParams"]]
# An embedding's L2 normalisation: vLLM 0.26 calls it use_activation, older vLLM normalize.
_NORMALISATION = {"normalize", "use_activation"}
# What a row's pooling_params may set (besides vLLM's older names and fields without effect here).
ROW_POOLING_FIELDS = ("dimensions", "normalize", "use_activation", "truncate_prompt_tokens", "extra_kwargs")


class NonFiniteOutput(ValueError):
    """A row's vector or score held NaN or an infinity (an fp16 model whose activations overflowed):
    no result, so the row fails instead of writing garbage (which JSON cannot even hold)."""


class PoolingRows:
    """Turns rows into pooling requests for one task, and their outputs into row results."""

    def __init__(self, task: str, llm: Any, settings: PromptSettings, job_params: dict[str, Any]):
        from tokenmill.pooling.engine import PoolingEngine

        engine = llm.llm_engine
        if not isinstance(engine, PoolingEngine):
            raise ValueError(f"--task {task} needs a pooling model, but {llm.llm_engine.config.model!r} runs as a generative model")
        self.task, self.engine, self.settings, self.job_params = task, engine, settings, dict(job_params)
        head = engine.pooling.head
        if head == "token_classify":  # the job writes one result per row; a token classifier gives one per token
            raise ValueError(f"--task {task}: {engine.pooling.architecture} is a token classifier (a label per prompt "
                             f"token); the batch job runs --task {', '.join(POOLING_JOB_TASKS)} (one result per row) and "
                             "not token_classify: use LLM.encode(prompts, pooling_task='token_classify')")
        # classify and embed need that head; score takes a cross-encoder or an embedding model.
        if (task == "score" and "score" not in engine.pooling.tasks and head != "embed") or (task != "score" and head != task):
            raise ValueError(f"--task {task}: {engine.unsupported(task)}")
        keep, most = self.job_params.get("truncate_prompt_tokens"), engine.config.max_model_len
        if keep is not None and keep > most:  # every row would fail with it: a usage error, as for generation
            raise ValueError(f"--truncate-prompt-tokens {keep} is more than this engine's max_model_len ({most}); "
                             "lower it, or raise --max-model-len")
        self.cross_encoder = task == "score" and head == "classify"
        self.labels = engine.pooling.labels or ()
        self._shared_params: dict[str, "PoolingParams"] = {}  # per task: the params of rows without overrides

    def prepare(self, raws: list["RawRow"], openai: bool, row_errors: tuple[type[BaseException], ...]) -> dict[int, tuple[RowRequest, Parts]]:
        """The rows' requests and engine requests (``build`` / ``build_openai``), their texts tokenized
        together: one call of the tokenizer's batch path instead of one a text (the largest part of a
        row's host time on the dev CPU before; docs/perf.md 106). A row that fails to build is left out
        (`JobLoop._submit` builds it again and reports it), as are texts that are cut to
        truncate_prompt_tokens (the tokenizer cuts those itself, keeping its special tokens)."""
        from tokenmill.inputs import tokenize_prompts

        built: dict[int, tuple[RowRequest, Parts]] = {}
        for raw in raws:
            if raw.error is None:
                with contextlib.suppress(*row_errors):
                    built[raw.index] = self.build_openai(raw) if openai else self.build(raw)
        places = [(index, k) for index, (_, parts) in built.items() for k, (_, prompt, params) in enumerate(parts)
                  if isinstance(prompt, str) and params.truncate_prompt_tokens is None]
        if places and self.engine.tokenizer is not None:
            try:
                prompts = tokenize_prompts([built[i][1][k][1] for i, k in places], self.engine.tokenizer, {})
            except (ValueError, TypeError):  # each text then goes to the engine alone, and fails alone
                return built
            for (i, k), prompt in zip(places, prompts):
                request_id, _, params = built[i][1][k]
                built[i][1][k] = (request_id, prompt, params)
        return built

    def build(self, raw: "RawRow") -> tuple[RowRequest, Parts]:
        """The row's request and its engine requests; raises RowError for a bad row."""
        record = raw.record
        assert record is not None
        where = raw.where or f"row {raw.index}"
        if self.task == "score":
            request = RowRequest(index=raw.index, row_id=row_id_of(record, raw.index, self.settings.id_field, where))
            text_1, text_2 = (_text(record, name, where, request.row_id) for name in ("text_1", "text_2"))
            params = self._params(record, where, request.row_id, "score" if self.cross_encoder else "embed")
            text_1, text_2 = self._cut_pair(text_1, text_2, params, where, request.row_id)
            if self.cross_encoder:
                try:
                    return request, [(f"row-{raw.index}", self.engine.pair_prompt(text_1, text_2, params.truncate_prompt_tokens), params)]
                except (TypeError, ValueError) as e:
                    raise RowError(f"{where}: {e}", request.row_id) from None
            return request, [(f"row-{raw.index}-1", text_1, params), (f"row-{raw.index}-2", text_2, params)]
        request = build_row_request(raw, self.settings)
        if request.messages is not None:
            raise RowError(f"{where}: --task {self.task} takes text ('prompt', --text-field or --prompt-template), "
                           "not chat 'messages'", request.row_id)
        if request.overrides:
            raise RowError(f"{where}: 'sampling_params' do not apply to --task {self.task}; use 'pooling_params'", request.row_id)
        if request.adapter is not None:  # running the base model instead would be a silent wrong answer
            raise RowError(f"{where}: 'lora'={request.adapter!r} names a LoRA adapter; --task {self.task} runs a pooling "
                           "model, which takes none", request.row_id)
        prompt: Any = {"prompt_token_ids": request.prompt_token_ids} if request.prompt_token_ids is not None else request.prompt
        params = self._params(record, where, request.row_id, self.task)
        if params.extra_kwargs:  # the engine never reads them: accepting them would be a silent no-op
            raise RowError(f"{where}: pooling_params.extra_kwargs={short_repr(params.extra_kwargs)} applies to --task score "
                           f"only (max_tokens_per_query / max_tokens_per_doc cut a pair's texts), not --task {self.task}; "
                           "use truncate_prompt_tokens", request.row_id)
        return request, [(f"row-{raw.index}", prompt, params)]

    def _cut_pair(self, text_1: str, text_2: str, params: "PoolingParams", where: str, row_id: Any) -> tuple[str, str]:
        """A score row's texts cut by its pooling_params.extra_kwargs (vLLM's max_tokens_per_query /
        max_tokens_per_doc), as LLM.score cuts them."""
        from tokenmill.pooling.llm_methods import cut_texts

        cuts = params.extra_kwargs or {}
        try:
            return (cut_texts(self.engine, [text_1], cuts.get("max_tokens_per_query", 0), "max_tokens_per_query")[0],
                    cut_texts(self.engine, [text_2], cuts.get("max_tokens_per_doc", 0), "max_tokens_per_doc")[0])
        except ValueError as e:
            raise RowError(f"{where}: {e}", row_id) from None

    def build_openai(self, raw: "RawRow") -> tuple[RowRequest, Parts]:
        """An OpenAI batch line (``/v1/embeddings`` under embed, ``/v1/score`` or ``/v1/rerank`` under
        score; see openai_pooling.py): its request and engine requests; raises RowError for a bad line."""
        from tokenmill.batch.openai_pooling import build_openai_embedding, build_openai_scoring

        if self.task == "embed":
            request, inputs, fields = build_openai_embedding(raw)
            params = self._params({"pooling_params": fields}, request.where, request.row_id, "embed")
            return request, [(f"row-{raw.index}-{i}", prompt, params) for i, prompt in enumerate(inputs)]
        from tokenmill.pooling.llm_methods import cut_texts, score_pairs

        request, first, second, fields, cuts = build_openai_scoring(raw)
        params = self._params({"pooling_params": fields}, request.where, request.row_id, "score" if self.cross_encoder else "embed")
        try:
            first = cut_texts(self.engine, first, cuts.get("max_tokens_per_query", 0), "max_tokens_per_query")
            second = cut_texts(self.engine, second, cuts.get("max_tokens_per_doc", 0), "max_tokens_per_doc")
        except ValueError as e:
            raise RowError(f"{request.where}: {e}", request.row_id) from None
        if not self.cross_encoder:  # each text embedded once; result() pairs them
            return request, [(f"row-{raw.index}-{i}", text, params) for i, text in enumerate(first + second)]
        try:
            return request, [(f"row-{raw.index}-{i}", self.engine.pair_prompt(a, b, params.truncate_prompt_tokens), params)
                             for i, (a, b) in enumerate(score_pairs(first, second))]
        except (TypeError, ValueError) as e:
            raise RowError(f"{request.where}: {e}", request.row_id) from None

    def result(self, request: RowRequest, outputs: list["PoolingRequestOutput"]) -> "RowResult":
        """The row's result from its finished engine outputs (in the order of its parts)."""
        from tokenmill.batch.results import RowResult

        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        if request.openai is not None:  # an OpenAI line: each input's vector, or each pair's score
            pooled = ({"embeddings": [_vector(o.outputs, f"the embedding of input {i}") for i, o in enumerate(outputs)]}
                      if self.task == "embed"
                      else {"scores": self._pair_scores(outputs, request.openai.queries)})
            return RowResult(index=request.index, row_id=request.row_id, prompt_tokens=prompt_tokens, openai=request.openai,
                             pooled=pooled)
        if self.task == "embed":
            pooled: dict[str, Any] = {"embedding": _vector(outputs[0].outputs)}
        elif self.task == "classify":
            probs = _vector(outputs[0].outputs, "the class probabilities")
            pooled = {"label": self.labels[int(probs.argmax())] if self.labels else None, "probs": probs}
        else:  # a row is one pair: one output of a cross-encoder, or the two texts' embeddings
            pooled = {"score": self._pair_scores(outputs, 1)[0]}
        return RowResult(index=request.index, row_id=request.row_id, prompt_tokens=prompt_tokens, pooled=pooled)

    def _pair_scores(self, outputs: list["PoolingRequestOutput"], queries: int) -> list[float]:
        """A score row's or line's scores: a cross-encoder's, one output a pair; else the cosine of the first
        ``queries`` outputs' embeddings (one, or one a pair) with the others'."""
        from tokenmill.outputs import ScoringOutput
        from tokenmill.pooling.llm_methods import embedding_score, score_pairs

        if self.cross_encoder:
            scores = [ScoringOutput.from_base(o.outputs).score for o in outputs]
        else:
            scores = [embedding_score(a, b).outputs.score for a, b in score_pairs(outputs[:queries], outputs[queries:])]
        for i, score in enumerate(scores):
            if not math.isfinite(score):
                raise NonFiniteOutput(f"the model's output is not a number: the score of pair {i} is {score}{_OVERFLOW_HINT}")
        return scores

    def _params(self, record: dict[str, Any], where: str, row_id: Any, task: str) -> "PoolingParams":
        from tokenmill.pooling_params import PoolingParams

        overrides = record.get("pooling_params")
        if isinstance(overrides, str) and overrides:  # CSV cells hold text: accept a JSON object
            try:
                overrides = json.loads(overrides)
            except ValueError:
                raise RowError(f"{where}: 'pooling_params' is not a JSON object: {overrides[:80]!r}", row_id) from None
        overrides = overrides or {}
        if not isinstance(overrides, dict):
            raise RowError(f"{where}: 'pooling_params' must be an object, got {type(overrides).__name__}", row_id)
        overrides = {k: v for k, v in overrides.items() if v is not None}  # null: not set (Parquet structs)
        if not overrides:  # one object for every such row (the engine never modifies params)
            shared = self._shared_params.get(task)
            if shared is None:
                shared = self._shared_params[task] = PoolingParams(**{**self.job_params, "task": task})
            return shared
        unknown = sorted(set(overrides) - PoolingParams.field_names())
        if unknown:
            raise RowError(f"{where}: unknown pooling parameter(s) {unknown} in pooling_params; a row may set "
                           f"{list(ROW_POOLING_FIELDS)}", row_id)
        job = self.job_params
        if task in ("embed", "token_embed") and overrides.keys() & _NORMALISATION:
            job = {k: v for k, v in job.items() if k not in _NORMALISATION}  # the row's word, under either name
        try:
            return PoolingParams(**{**job, **overrides, "task": task})
        except (TypeError, ValueError) as e:
            raise RowError(f"{where}: {e}", row_id) from None


def pooling_records(result: "RowResult", task: str) -> list[dict[str, Any]]:
    fields = result.pooled if result.pooled is not None else dict.fromkeys(TASK_FIELDS[task])
    return [{"row": result.index, "id": result.row_id, **fields, "prompt_tokens": result.prompt_tokens, "error": result.error}]


def pooling_parquet_schema(task: str) -> Any:
    import pyarrow as pa

    values = {
        "embed": [("embedding", pa.list_(pa.float32()))],
        "classify": [("label", pa.string()), ("probs", pa.list_(pa.float32()))],
        "score": [("score", pa.float64())],
    }[task]
    return pa.schema([("row", pa.int64()), ("id", pa.string()), *values, ("prompt_tokens", pa.int64()), ("error", pa.string())])


def _text(record: dict[str, Any], name: str, where: str, row_id: Any) -> str:
    """A score row's text; "" too, as LLM.score and vLLM take it (the engine refuses one left with no token)."""
    value = record.get(name)
    if not isinstance(value, str):
        found = "missing" if name not in record else f"a {type(value).__name__}"
        raise RowError(f"{where}: --task score needs a string in '{name}' (got {found}; fields: {sorted(record)[:12]})", row_id)
    return value


_OVERFLOW_HINT = " (an fp16 model overflowing? run it in bfloat16 or float32, --dtype); no result is written for the row"


def _vector(output: Any, what: str = "the embedding") -> "np.ndarray":
    """An embedding (or a row's class probabilities) as a float32 array, which the writer formats
    (writers.float32_json: each value's shortest decimal that reads back as the same float32).
    Raises NonFiniteOutput if it holds NaN or an infinity: one numpy pass, ~1 us a row."""
    import numpy as np

    from tokenmill.outputs import one_vector

    values = one_vector(output, what).float().numpy()
    finite = np.isfinite(values)
    if not finite.all():
        raise NonFiniteOutput(f"the model's output is not a number: {what} has {values.size - int(finite.sum())} NaN or "
                              f"infinite value(s) of {values.size}{_OVERFLOW_HINT}")
    return values
