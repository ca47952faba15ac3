"""An OpenAI batch line's frame: the urls tokenmill answers and which ``--task`` runs each, the
checks every line passes before its body is read (custom_id, method, url, body; a line failing them
is no request, `NotARequest`, while one refused for its body is a bad request), and the ids of the
output lines. Generation lines are read in openai_batch.py, a pooling model's in openai_pooling.py.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from tokenmill.batch.requests import OpenAIMeta, RowError
from tokenmill.inputs import short_repr

if TYPE_CHECKING:
    from tokenmill.batch.readers import RawRow

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URLS = ("/v1/score", "/score")
RERANK_URLS = ("/v1/rerank", "/rerank", "/v2/rerank")
# Lines answered by a pooling model (openai_pooling.py), each url with the --task that runs it.
POOLING_TASKS = {EMBEDDINGS_URL: "embed", **dict.fromkeys(SCORE_URLS + RERANK_URLS, "score")}


class NotARequest(RowError):
    """An OpenAI batch line that is not a request this job answers (no custom_id, a method or url it
    does not serve, no body object): written in OpenAI's error-file shape (``response: null``), not
    as a request's 400. A line that passed these checks and was refused for its body is a request."""


def refused_request(raw: "RawRow", error: BaseException) -> OpenAIMeta | None:
    """The output meta of a line refused before its request was made: a line with a custom_id that
    passed `open_line` is a bad request (its output: a 400 with OpenAI's error body, as a value the
    engine refuses gets); None for a line that is not a request (`NotARequest`, or the reader's
    error: not JSON, a custom_id an earlier line has)."""
    if raw.error is not None or isinstance(error, NotARequest) or not isinstance(error, RowError) or error.row_id is None:
        return None
    url = raw.record.get("url") if raw.record is not None else None
    return OpenAIMeta(custom_id=error.row_id, url=url if isinstance(url, str) else "", top_logprobs=None)


def open_line(raw: "RawRow", task: str) -> tuple[str, str, str, dict[str, Any]]:
    """(where, custom_id, url, body) of an OpenAI batch line for a job of ``task`` (generate, embed,
    score); a line whose url another task runs is told which. Raises NotARequest."""
    line = raw.record
    assert line is not None
    where = raw.where or f"row {raw.index}"
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise NotARequest(f"{where}: 'custom_id' must be a non-empty string, got {short_repr(custom_id)}", None)
    method = line.get("method", "POST")
    if method != "POST":
        raise NotARequest(f"{where}: method {method!r} is not supported; batch requests are POST", custom_id)
    url = line.get("url")
    runs = POOLING_TASKS.get(url, "generate" if url in (CHAT_URL, COMPLETIONS_URL) else None)
    if runs is None:
        raise NotARequest(f"{where}: url {url!r} is not supported; use {CHAT_URL!r} or {COMPLETIONS_URL!r} (--task generate), "
                          f"{EMBEDDINGS_URL!r} (--task embed), or {SCORE_URLS[0]!r} / {RERANK_URLS[0]!r} (--task score)", custom_id)
    if runs != task:
        raise NotARequest(f"{where}: url {url!r} is answered under --task {runs}, and this job runs --task {task}", custom_id)
    body = line.get("body")
    if not isinstance(body, dict):
        raise NotARequest(f"{where}: 'body' must be an object", custom_id)
    return where, custom_id, url, body


def stable_id(prefix: str, *parts: Any) -> str:
    """An output id made from the job and the row, so that a rerun writes the same one."""
    return prefix + hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=12).hexdigest()
