"""A pooling request: a prompt computed whole in one step, then pooled. It needs none of a
generation request's state (sequences, blocks, sampling), so it is a small record of its own."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.pooling_params import PoolingParams


@dataclass(eq=False, slots=True)
class PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams  # resolved at intake: task and defaults filled in
    token_type_ids: list[int] | None = None  # segment ids of a text pair (BERT cross-encoders)
