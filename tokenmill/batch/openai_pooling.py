"""OpenAI batch lines for a pooling model, read and answered as vLLM's ``run-batch`` does.

``/v1/embeddings`` (``--task embed``): ``body.input`` is a text, a list of token ids, or a non-empty
list of either (one engine request each); ``encoding_format`` "float" or "base64" (each vector's
float32 bytes, little-endian, as OpenAI sends them); ``dimensions``, ``truncate_prompt_tokens`` and
``use_activation`` (vLLM's: whether to normalise) become the line's PoolingParams. The body answered
is ``{"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}], "usage"}``.

``/v1/score`` and ``/v1/rerank`` (``--task score``; ``/score``, ``/rerank`` and ``/v2/rerank`` too):
a score line pairs its first texts with its second ones, under any of vLLM's names (``queries`` /
``documents``, ``queries`` / ``items``, ``data_1`` / ``data_2``, ``text_1`` / ``text_2``): one first
text against each second one, or the same number of each, pairwise; a rerank line scores its
``query`` against each of its ``documents`` and answers the best ``top_n`` (0: all), best first,
``{"results": [{"index": j, "document": {"text": ...}, "relevance_score": s}]}``. A cross-encoder
reads each pair as one input; an embedding model embeds each text once and scores the cosine.
``max_tokens_per_query`` / ``max_tokens_per_doc`` cut each side's texts after that many tokens.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.batch.openai_lines import EMBEDDINGS_URL, RERANK_URLS, open_line, stable_id
from tokenmill.batch.requests import OpenAIMeta, RowError, RowRequest, did_you_mean
from tokenmill.inputs import is_token_list, short_repr

if TYPE_CHECKING:
    from tokenmill.batch.readers import RawRow
    from tokenmill.batch.results import RowResult

_ENCODINGS = ("float", "base64")
# vLLM's names for a score line's two sides, in the order it tries them.
_SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
# vLLM's cuts of a score line's texts, each side's own (LLM.score takes them in pooling_params.extra_kwargs).
_CUTS = ("max_tokens_per_query", "max_tokens_per_doc")
# Accepted and without effect: the job's --model runs every line, and a pooling request has no queue
# to jump ("priority").
_IGNORED = {"model", "user", "priority"}


def build_openai_embedding(raw: "RawRow") -> tuple[RowRequest, list[Any], dict[str, Any]]:
    """One ``/v1/embeddings`` line: its request, its inputs (texts or token-id lists, one engine
    request each) and the PoolingParams fields it sets; raises RowError for a bad line."""
    where, custom_id, url, body = open_line(raw, "embed")
    _check_fields(body, {"input", "encoding_format", "dimensions", "truncate_prompt_tokens", "use_activation"}, where, url, custom_id)
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding  # null: not set; 0, "" or false are not "float"
    if encoding not in _ENCODINGS:
        raise RowError(f"{where}: body.encoding_format={short_repr(encoding)} is not supported; use one of {list(_ENCODINGS)}", custom_id)
    inputs = _embedding_inputs(body.get("input"), where, custom_id)
    request = RowRequest(index=raw.index, row_id=custom_id, where=where)
    request.openai = OpenAIMeta(custom_id=custom_id, url=url, top_logprobs=None, encoding_format=encoding)
    return request, inputs, _pooling_fields(body, ("dimensions", "truncate_prompt_tokens", "use_activation"))


def build_openai_scoring(raw: "RawRow") -> tuple[RowRequest, list[str], list[str], dict[str, Any], dict[str, int]]:
    """One ``/v1/score`` or ``/v1/rerank`` line: its request, its first and second texts (the query
    and the documents of a rerank line), the PoolingParams fields it sets, and vLLM's
    ``max_tokens_per_query`` / ``max_tokens_per_doc`` (texts to cut, `cut_texts`); raises RowError."""
    where, custom_id, url, body = open_line(raw, "score")
    rerank = url in RERANK_URLS
    common = {"truncate_prompt_tokens", "use_activation", *_CUTS}
    if rerank:
        names = ("query", "documents")
        _check_fields(body, {*names, "top_n", *common}, where, url, custom_id)
    else:  # the pair of names the body uses; with one of a pair missing, that pair (its error names the other)
        names = next((pair for pair in _SCORE_SIDES if pair[0] in body and pair[1] in body),
                     next((pair for pair in _SCORE_SIDES if pair[0] in body or pair[1] in body), _SCORE_SIDES[0]))
        _check_fields(body, {*names, *common}, where, url, custom_id)
    cuts = {name: body[name] for name in _CUTS if body.get(name) is not None}
    for name, limit in cuts.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise RowError(f"{where}: body.{name}={short_repr(limit)} is invalid: must be an integer >= 0 (0: no cut)", custom_id)
    first, second = (_texts(body.get(name), f"{where}: body.{name}", custom_id) for name in names)
    if rerank and len(first) != 1:
        raise RowError(f"{where}: body.query must be one text, got {len(first)}", custom_id)
    if len(first) > 1 and len(first) != len(second):
        raise RowError(f"{where}: body.{names[0]} has {len(first)} texts and body.{names[1]} {len(second)}: give one "
                       f"{names[0]} text for any number of {names[1]} (1-to-N), or as many of each (N-to-N)", custom_id)
    top_n = body.get("top_n")
    top_n = 0 if top_n is None else top_n  # null: not set; "" or false are not 0
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise RowError(f"{where}: body.top_n={short_repr(top_n)} is invalid: must be an integer >= 0 (0: all)", custom_id)
    request = RowRequest(index=raw.index, row_id=custom_id, where=where)
    request.openai = OpenAIMeta(custom_id=custom_id, url=url, top_logprobs=None, queries=len(first),
                                documents=tuple(second) if rerank else (), top_n=top_n)
    return request, first, second, _pooling_fields(body, ("truncate_prompt_tokens", "use_activation")), cuts


def _check_fields(body: dict[str, Any], fields: set[str], where: str, url: str, custom_id: str) -> None:
    unknown = sorted(set(body) - fields - _IGNORED)
    if unknown:
        raise RowError(f"{where}: body field(s) {unknown} are not supported for {url}{did_you_mean(unknown, fields, cutoff=0.85)} "
                       f"(supported: {sorted(fields | _IGNORED)})", custom_id)


def _pooling_fields(body: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: body[name] for name in names if body.get(name) is not None}


def _embedding_inputs(value: Any, where: str, custom_id: str) -> list[Any]:
    """``body.input`` as OpenAI takes it: a text, token ids, or a non-empty list of texts or of token-id lists."""
    def token_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and is_token_list(x)

    if isinstance(value, str) and value:
        return [value]
    if token_ids(value):
        return [{"prompt_token_ids": list(value)}]
    if isinstance(value, list) and value and all(isinstance(x, str) and x for x in value):
        return list(value)
    if isinstance(value, list) and value and all(token_ids(x) for x in value):
        return [{"prompt_token_ids": list(x)} for x in value]
    raise RowError(f"{where}: body.input must be a non-empty string, a list of token ids, or a non-empty list of "
                   f"either (strings or token-id lists, not mixed); got {short_repr(value)}", custom_id)


def _texts(value: Any, what: str, custom_id: str) -> list[str]:
    """A side of a score or rerank line: a text or a non-empty list of texts (tokenmill's models read text only)."""
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) and x for x in value):
        return list(value)
    raise RowError(f"{what} must be a non-empty string or a non-empty list of them (text only: multi-modal parts "
                   f"are not served); got {short_repr(value)}", custom_id)


# --- output ------------------------------------------------------------------------------------


def pooling_body(result: "RowResult", meta: OpenAIMeta, model: str, created: int, job_key: str) -> dict[str, Any]:
    """The response body of a finished pooling line (``result.pooled``: its vectors or its scores)."""
    assert result.pooled is not None
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    if meta.url == EMBEDDINGS_URL:
        vectors = result.pooled["embeddings"]
        if meta.encoding_format == "base64":
            vectors = [_base64_floats(v) for v in vectors]
        return {"id": stable_id("embd-", job_key, result.index), "object": "list", "created": created, "model": model,
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)], "usage": usage}
    scores = result.pooled["scores"]
    if meta.url in RERANK_URLS:
        ranked = sorted(range(len(scores)), key=lambda j: -scores[j])[: meta.top_n or None]
        return {"id": stable_id("rerank-", job_key, result.index), "model": model, "usage": usage,
                "results": [{"index": j, "document": {"text": meta.documents[j]}, "relevance_score": scores[j]} for j in ranked]}
    return {"id": stable_id("score-", job_key, result.index), "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)], "usage": usage}


def _base64_floats(values: Any) -> str:
    """A vector as OpenAI's base64 encoding sends it: float32, little-endian, base64."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
