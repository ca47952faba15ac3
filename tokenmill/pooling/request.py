"""A pooling request: one sequence, its prompt computed whole in one step, then pooled."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.pooling_params import PoolingParams


@dataclass(eq=False)
class PoolingRequest(Request[PoolingParams]):
    # params: the PoolingParams resolved at intake (task and defaults filled in)
    token_type_ids: list[int] | None = None  # segment ids of a text pair (BERT cross-encoders)

    @property
    def needs_prompt_logprobs(self) -> bool:
        return False
