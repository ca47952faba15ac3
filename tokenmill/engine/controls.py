"""The generation engine's controls between steps (vLLM's names): sleep and wake-up, the prefix
cache, profiling, weight transfer for RL loops, metrics, and LoRA adapters' controls.

Each one that touches device state goes through `Executor.collective_rpc`, so every
tensor-parallel rank does its part (the `Worker` methods of the same names); the engine keeps
the books: what is asleep, the weight version, the prefix cache index, the metrics.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenmill.param_checks import is_int

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.distributed.executor import Executor
    from tokenmill.engine.kv_cache import KVCacheManager
    from tokenmill.engine.request import Request
    from tokenmill.engine.scheduler import Scheduler
    from tokenmill.lora.slots import AdapterBook
    from tokenmill.metrics.reader import Metric
    from tokenmill.metrics.stats import EngineMetrics

logger = logging.getLogger(__name__)
SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("abort", "wait")
SLEEP_TAGS = ("weights", "kv_cache")


class EngineControls:
    """Mixed into `LLMEngine`, which provides the attributes below."""

    config: "EngineConfig"
    executor: "Executor"
    kv: "KVCacheManager"
    scheduler: "Scheduler"
    requests: dict[str, "Request"]
    metrics: "EngineMetrics | None"
    asleep: set[str]  # of SLEEP_TAGS
    weight_version: int
    adapters: "AdapterBook | None"  # with enable_lora

    if TYPE_CHECKING:
        def step(self, finished_only: bool = False) -> list[Any]: ...

        def abort_request(self, request_ids: Any) -> None: ...

        def _settle(self) -> None: ...

    # ---- sleep ----------------------------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache on every rank; level 1 keeps the weights in pinned CPU memory, level 2
        discards them. ``mode``: "abort" the unfinished requests, or "wait" for them (their outputs
        are dropped; `LLM.sleep` keeps them). The prefix cache is forgotten with the KV cache."""
        if not is_int(level) or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(level={level!r}) is invalid: must be 1 (weights to CPU memory) or 2 (weights discarded)")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep(mode={mode!r}) is not supported by tokenmill: supported: {' or '.join(map(repr, SLEEP_MODES))}")
        if self.asleep:
            raise RuntimeError("the engine is already asleep; wake_up() first")
        if mode == "wait":
            while self.requests:
                self.step(finished_only=True)
        self.abort_request(list(self.requests))
        self._settle()
        self.kv.pool.reset_prefix_cache()
        self.executor.collective_rpc("sleep", args=(level,))
        self.asleep = set(SLEEP_TAGS)
        if self.metrics is not None:
            self.metrics.record_sleep_level(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (every rank); None: both. vLLM's third tag,
        "scheduling" (waking from a level-0 pause), is accepted: tokenmill never pauses scheduling."""
        known = [*SLEEP_TAGS, "scheduling"]
        if isinstance(tags, str):  # one tag (vLLM's allocator tests `tag in tags`, so a string works there)
            tags = [tags]
        if tags is not None:
            if not isinstance(tags, (list, tuple, set)):
                raise ValueError(f"wake_up(tags={tags!r}) is invalid: must be None (everything) or a list of {known}")
            tags = [t for t in tags if t != "scheduling"]
            unknown = [t for t in tags if t not in SLEEP_TAGS]
            if unknown:
                raise ValueError(f"wake_up(tags={tags!r}): unknown tags {unknown}; known: {known}")
        self.executor.collective_rpc("wake_up", args=(tags,))
        # Waking captures the decode graphs again on every rank; under tensor parallelism rank 0's
        # new graphs must announce their replays to the workers like the first ones did.
        self.executor.mirror_decode_graphs()
        self.asleep -= set(SLEEP_TAGS if tags is None else tags)
        if self.metrics is not None and not self.asleep:
            self.metrics.record_sleep_level(0)

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    # ---- caches -----------------------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix. Blocks in use cannot be forgotten, so this returns False while
        requests run, unless ``reset_running_requests`` preempts them first (they are recomputed).
        ``reset_connector``: there is no KV connector, nothing to reset."""
        for name, flag in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(flag, bool):  # a truthy string would preempt every running request
                raise ValueError(f"reset_prefix_cache({name}={flag!r}) is invalid: must be True or False")
        if reset_running_requests:
            self.scheduler.preempt_all()
        return self.kv.pool.reset_prefix_cache()

    def reset_mm_cache(self) -> None:
        """No multimodal models, so no multimodal cache: nothing to do."""

    def reset_encoder_cache(self) -> None:
        """No vision encoders, so no encoder cache: nothing to do."""

    # ---- LoRA adapters (vLLM's controls; tokenmill/lora/) -----------------------------------------
    def add_lora(self, lora_request: Any) -> bool:
        """Check the adapter and read it into every rank's CPU memory ahead of its requests."""
        if self.adapters is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        spec = self.adapters.register(lora_request)
        try:
            self.executor.collective_rpc("cache_lora", args=(spec,))
        except Exception:  # tensors that cannot be read or are not finite: not an adapter the engine knows
            self.adapters.forget(spec)
            raise
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter (True if it was known); requests already running with it finish with it."""
        if self.adapters is None or not self.adapters.remove(lora_id):
            return False
        self.executor.collective_rpc("drop_lora", args=(lora_id,))
        return True

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in CPU memory and, while other slots can serve the rest, in its device slot."""
        if self.adapters is None or not self.adapters.pin(lora_id):
            return False
        self.executor.collective_rpc("pin_lora", args=(lora_id,))
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters known (added, or named by a request)."""
        return set(self.adapters.specs) if self.adapters is not None else set()

    # ---- profiling --------------------------------------------------------------------------------
    def start_profile(self, profile_prefix: str | None = None) -> None:
        self._check_profiling("start_profile")
        self.executor.collective_rpc("start_profile", args=(profile_prefix,))

    def stop_profile(self) -> None:
        self._check_profiling("stop_profile")
        self.executor.collective_rpc("stop_profile")

    def _check_profiling(self, method: str) -> None:
        if self.config.profiler is None:
            raise ValueError(
                f"{method}() needs profiling turned on: LLM(..., profiler_config={{'profiler': 'torch', "
                "'torch_profiler_dir': '/path/to/traces'}) or the environment variable VLLM_TORCH_PROFILER_DIR"
            )

    # ---- weight transfer (tokenmill/weight_transfer.py) ---------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.executor.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.executor.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Replace the named tensors on every rank, bump the weight version, forget the prefix cache.
        Each rank refuses what it cannot take (quantized or sleeping weights, a bad tensor) itself,
        after receiving what the trainer sends over its group (weight_transfer.apply_update)."""
        if not isinstance(update_info, dict):
            raise ValueError(f"update_weights: update_info must be a dict, got {type(update_info).__name__}")
        try:
            self.executor.collective_rpc("update_weights", kwargs={"update_info": update_info})
        except BaseException:
            self._forget_prefix_cache("update_weights")  # one that failed part-way replaced the tensors before it
            raise
        self.weight_version += 1
        self._forget_prefix_cache("update_weights")

    def _forget_prefix_cache(self, what: str) -> None:
        """After weights changed: cached prefix blocks hold the old weights' keys and values."""
        if not self.reset_prefix_cache():
            logger.warning("%s while requests run: their cached prefix blocks keep the old weights' keys "
                           "and values until they finish", what)

    def finish_weight_update(self) -> None:
        self.executor.collective_rpc("finish_weight_update")

    def update_weight_version(self, version: int) -> None:
        if not is_int(version):
            raise ValueError(f"update_weight_version(version={version!r}) is invalid: must be an int")
        self.weight_version = version

    def get_weight_version(self) -> int:
        return self.weight_version

    # ---- metrics ----------------------------------------------------------------------------------
    def get_metrics(self) -> list["Metric"]:
        if self.metrics is None:
            if self.config.log_stats:
                raise ValueError("get_metrics() needs prometheus-client: pip install 'tokenmill[metrics]'")
            raise ValueError("get_metrics() needs metrics collected: LLM(..., disable_log_stats=False) "
                             "(off by default, as in vLLM's LLM)")
        return self.metrics.snapshot()
