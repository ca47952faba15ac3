"""One rank's device state: its shard of the model, the runner around it and its KV cache.

Every rank has a Worker: rank 0 in the engine's process (its runner is the one the engine
steps), ranks 1..N-1 in worker processes. ``collective_rpc`` calls a Worker method (or a
function taking the Worker) on every rank; the engine's own set-up uses it too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from tokenmill.models.loader import load_model
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.sizing import choose_num_blocks

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.step import SchedulerOutput, StepResult
    from tokenmill.models.source import ModelSource

logger = logging.getLogger(__name__)
_R = TypeVar("_R")


class Worker:
    def __init__(
        self,
        config: "EngineConfig",
        source: "ModelSource",
        load_format: str,
        rank: int = 0,
        device: torch.device | None = None,
        tp_group: Any = None,
    ):
        self.rank = rank
        self.tp_size = config.tensor_parallel_size
        self.device = device if device is not None else config.device
        self.config = dataclasses.replace(config, device=self.device)  # sizing reads this rank's device
        self.model = load_model(
            source, config.dtype, self.device, load_format,
            tp_rank=rank, tp_size=self.tp_size, tp_group=tp_group, seed=config.seed, quantization=config.quantization,
        )
        if config.deterministic:
            from tokenmill.kernels.batch_invariant import use_batch_invariant_matmuls

            use_batch_invariant_matmuls(self.model)
        self.runner = ModelRunner(
            model=self.model,
            backend=attention_backend(self.device, config.deterministic),
            device=self.device,
            dtype=config.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
            block_size=config.block_size,
            vocab_size=config.vocab_size,
            seed=config.seed,
        )
        # Before the profiling forward, so no kernel variant is first compiled in the middle of a run.
        self.runner.precompile_kernels(config.max_model_len)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit this rank (the engine takes the minimum over ranks).

        On a GPU this runs a profiling forward, so every rank must call it at once.
        """
        return choose_num_blocks(self.config, self.runner)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if self.tp_size > 1:
            # A replayed graph would skip the announcements the workers follow (mirror.py).
            if self.rank == 0:
                logger.warning("CUDA graphs are not used with tensor_parallel_size > 1: decode steps run eagerly")
            return
        self.runner.capture_decode_graphs(self.config.max_num_seqs, self.config.max_model_len)

    def execute_model(self, plan: "SchedulerOutput") -> "StepResult":
        """Launch one step on this rank (rank 0's; the other ranks follow its model calls)."""
        return self.runner.execute(plan)

    def use_grammars(self, grammars: Any) -> None:
        """The engine's GrammarCache, which masks the logits of sequences with structured outputs."""
        self.runner.grammars = grammars

    def apply_model(self, func: Callable[[torch.nn.Module], _R]) -> _R:
        """func(this rank's model): LLM.apply_model."""
        return func(self.model)

    def execute_method(self, method: str | Callable[..., _R], args: tuple = (), kwargs: dict | None = None) -> Any:
        """One rank's part of collective_rpc: a Worker method by name, or method(worker, ...)."""
        if isinstance(method, str):
            return getattr(self, method)(*args, **(kwargs or {}))
        return method(self, *args, **(kwargs or {}))


def attention_backend(device: torch.device, deterministic: bool = False) -> Any:
    if device.type == "cuda":
        try:
            from tokenmill.attention.triton_backend import TritonAttentionBackend

            return TritonAttentionBackend(deterministic)
        except ImportError as exc:
            if deterministic:  # the torch fallback's CUDA kernels make no batch-invariance promise
                raise RuntimeError(f"deterministic=True on a GPU needs Triton: {exc}") from exc
            logger.warning("Triton attention is unavailable (%s); using the plain-torch backend", exc)
    from tokenmill.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(deterministic)
