"""`LLM`'s engine controls (vLLM's names): the prefix cache, sleep and wake-up, metrics, profiling,
weight transfer for RL loops, and calls on every tensor-parallel rank. Each hands over to the
engine (tokenmill/engine/controls.py), which keeps the books and reaches every rank through
collective_rpc; a pooling model's engine refuses the generation-only ones by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

_R = TypeVar("_R")


class EngineControlMethods:
    """Mixed into `LLM`, which provides the attributes below."""

    llm_engine: Any

    if TYPE_CHECKING:
        def _generation_engine(self, method: str) -> Any: ...

        def _step(self, finished_only: bool = False) -> list[Any]: ...

    # ---- the prefix cache, sleep, metrics, profiling ------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached prefixes; False while requests hold blocks, unless
        ``reset_running_requests`` preempts them first (they are recomputed)."""
        if self.llm_engine.config.pooling is not None:
            return self.llm_engine.reset_prefix_cache()
        return self._generation_engine("reset_prefix_cache").reset_prefix_cache(reset_running_requests, reset_connector)

    def reset_mm_cache(self) -> None:
        """Text-only models have no multimodal cache: nothing to reset."""

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Free the KV cache; level 1 moves the weights to pinned CPU memory, level 2 discards them
        (refill with ``collective_rpc("reload_weights")`` or `update_weights` after waking). ``mode``:
        "abort" unfinished requests, or "wait" for them (enqueued ones keep their outputs)."""
        engine = self._generation_engine("sleep")
        if mode == "wait":
            while engine.has_unfinished_requests():
                self._step(finished_only=True)
        engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` of "weights" and "kv_cache" (None: both); generate once both are back."""
        self._generation_engine("wake_up").wake_up(tags)

    def get_metrics(self) -> list[Any]:
        """vLLM's metric objects (tokenmill.metrics.reader): needs LLM(disable_log_stats=False)."""
        return self._generation_engine("get_metrics").get_metrics()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start a torch.profiler trace on every rank (profiler_config or VLLM_TORCH_PROFILER_DIR names the folder)."""
        self._generation_engine("start_profile").start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop the traces and write them (one Chrome trace per rank)."""
        self._generation_engine("stop_profile").stop_profile()

    # ---- weight transfer for RL loops (tokenmill/weight_transfer.py) --------------------------
    def init_weight_transfer_engine(self, request: Any) -> None:
        """Join the trainer's group on every rank: ``{"init_info": {"master_address", "master_port",
        "rank_offset", "world_size"}}`` (or a WeightTransferInitRequest)."""
        from tokenmill.weight_transfer import request_info

        info = request_info(request, "init_info", "init_weight_transfer_engine")
        self._generation_engine("init_weight_transfer_engine").init_weight_transfer_engine(info)

    def start_weight_update(self) -> None:
        self._generation_engine("start_weight_update").start_weight_update()

    def update_weights(self, request: Any) -> None:
        """Replace named weights in place on every rank: ``{"update_info": {"names": [...], "tensors": [...]}}``
        from this process, or ``{"names", "dtype_names", "shapes"}`` broadcast by the trainer; bumps the
        weight version and forgets the prefix cache."""
        from tokenmill.weight_transfer import request_info

        info = request_info(request, "update_info", "update_weights")
        self._generation_engine("update_weights").update_weights(info)

    def finish_weight_update(self) -> None:
        self._generation_engine("finish_weight_update").finish_weight_update()

    def update_weight_version(self, version: int) -> None:
        self._generation_engine("update_weight_version").update_weight_version(version)

    def get_weight_version(self) -> int:
        return self._generation_engine("get_weight_version").get_weight_version()

    # ---- every tensor-parallel rank ---------------------------------------------------------
    def collective_rpc(
        self,
        method: str | Callable[..., _R],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[_R]:
        """Run ``method`` on the worker of every rank; one result per rank, in rank order.

        ``method`` is the name of a worker method or a function called as
        ``method(worker, *args, **kwargs)``; it is pickled for the worker processes (with
        cloudpickle when installed, so lambdas work). A one-rank LLM returns a one-item list.
        ``"sleep"`` / ``"wake_up"`` are refused (call ``LLM.sleep`` / ``wake_up``, which keep the engine's
        books); ``"reload_weights"`` / ``"update_weights"`` also forget the prefix cache, as a function
        that changes weights should (``reset_prefix_cache()``).
        """
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], _R]) -> list[_R]:
        """``func(model)`` on every rank's model (its shard under tensor parallelism), in rank order."""
        if not callable(func):
            raise ValueError(f"apply_model(func={func!r:.100}) is invalid: must be a function called as func(model)")
        return self.collective_rpc("apply_model", args=(func,))
