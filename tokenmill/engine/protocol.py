"""The engine behind `LLM`, chosen once when it starts (`tokenmill.engine_factory`): `LLMEngine`
for a generative model, `PoolingEngine` (tokenmill/pooling/) for a pooling model. Both serve
this small protocol, which `LLM` and the batch job drive; everything else is particular to one.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Iterable, Protocol

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.inputs import PromptType
    from tokenmill.models.source import ModelSource


class Engine(Protocol):
    config: "EngineConfig"
    source: "ModelSource"
    tokenizer: Any  # None with skip_tokenizer_init

    def add_request(
        self, request_id: str, prompt: "PromptType", params: Any = None, arrival_time: float | None = None,
        lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
        priority: int = 0, prompt_text: str | None = None, *, index: int | None = None,
    ) -> str:
        """Validate and queue one request (vLLM 0.26's LLMEngine.add_request keywords); a ValueError
        leaves the engine untouched. Returns the request id."""
        ...

    def get_supported_tasks(self) -> tuple[str, ...]: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def step(self, finished_only: bool = False) -> list[Any]:
        """Run one step; the outputs of the requests it advanced (or only of those it finished)."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def reset_prefix_cache(self) -> bool: ...

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]: ...


def check_add_request_keywords(request_id: Any, priority: Any, arrival_time: Any = None) -> None:
    """vLLM's add_request keywords that both engines check the same way (``lora_request``: each its own)."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority={priority!r} is invalid: must be an integer")
    if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real)
                                     or not math.isfinite(arrival_time)):
        raise ValueError(f"arrival_time={arrival_time!r:.100} is invalid: must be None or a finite number "
                         "(wall-clock seconds, as time.time() gives)")


def request_id_list(request_ids: Any) -> list[str]:
    """abort_request's argument as a list: one request id, or an iterable of them (vLLM's list)."""
    if isinstance(request_ids, str):
        return [request_ids]
    if request_ids is None or isinstance(request_ids, (bytes, int, float)) or not hasattr(request_ids, "__iter__"):
        raise TypeError(f"request_ids must be a request id (a string) or a list of them, got "
                        f"{type(request_ids).__name__} {request_ids!r:.100}")
    return list(request_ids)
