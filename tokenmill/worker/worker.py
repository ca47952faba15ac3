"""One rank's device state: its shard of the model, the runner around it and its KV cache.

Every rank has a Worker: rank 0 in the engine's process (its runner is the one the engine
steps), ranks 1..N-1 in worker processes. ``collective_rpc`` calls a Worker method (or a
function taking the Worker) on every rank; the engine's own set-up uses it too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import torch

from tokenmill.models.loader import load_model
from tokenmill.profiler import Profiler
from tokenmill.worker.micro_batches import Overlap
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.offload import LayerOffloader
from tokenmill.worker.sizing import choose_num_blocks
from tokenmill.worker.sleep import WeightStash

if TYPE_CHECKING:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.step import SchedulerOutput, StepResult
    from tokenmill.lora.adapter import AdapterSpec
    from tokenmill.lora.model import ModelLoRA
    from tokenmill.models.source import ModelSource

logger = logging.getLogger(__name__)
_R = TypeVar("_R")
SLEEP_TAGS = ("weights", "kv_cache")


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
        self.source, self.load_format = source, load_format
        # cpu_offload_gb: some decoder layers live in pinned CPU memory (a GPU feature: on the CPU
        # the weights are in CPU memory anyway).
        self.offloader = LayerOffloader(config.cpu_offload_bytes, self.device) \
            if config.cpu_offload_bytes and self.device.type == "cuda" else None
        if config.cpu_offload_bytes and self.offloader is None and rank == 0:
            logger.info("cpu_offload_gb has no effect on the CPU: the weights are in CPU memory already")
        self.model = load_model(
            source, config.dtype, self.device, load_format,
            tp_rank=rank, tp_size=self.tp_size, tp_group=tp_group, seed=config.seed, quantization=config.quantization,
            place=self.offloader.place if self.offloader is not None else None,
        )
        self.lora = _attach_lora(self.model, self.config)  # before the matmuls are swapped and memory profiled
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
            # Two model calls per step would not be mirrored in step on the other ranks, two forwards
            # on two streams would race for cpu_offload_gb's staging buffers and LoRA's step mask.
            overlap=Overlap.from_env() if self.tp_size == 1 and self.offloader is None and self.lora is None
            else Overlap(),
            lora=self.lora is not None,
            logprobs_mode=config.logprobs_mode,
        )
        if config.logits_processors and rank == 0:  # rank 0 samples
            from tokenmill.logits_processor import BatchLogitsProcessors

            self.runner.logits_processors = BatchLogitsProcessors(
                config.logits_processors, self.config, self.device, self.device.type == "cuda")
        # Before the profiling forward, so no kernel variant is first compiled in the middle of a run.
        self.runner.precompile_kernels(config.max_model_len, config.max_num_batched_tokens)
        self.num_blocks = 0
        self.profiler = Profiler(config.profiler, rank, self.device.type == "cuda") if config.profiler else None
        self.asleep: set[str] = set()  # of "weights", "kv_cache" (LLM.sleep)
        self._stash: WeightStash | None = None
        self._weight_receiver: Any = None  # the trainer's group (init_weight_transfer_engine)

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit this rank (the engine takes the minimum over ranks).

        On a GPU this runs a profiling forward, so every rank must call it at once.
        """
        return choose_num_blocks(self.config, self.runner, self._prompt_graph_tokens())

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner.allocate_kv_cache(num_blocks)
        self._capture_graphs()
        self._warm_logits()
        if self.device.type == "cpu":
            self._pack_linear_weights()

    def _pack_linear_weights(self) -> None:
        """The CPU's linear products (bf16, fp32) from weights packed once for oneDNN
        (models/layers/cpu_packed.py), if the copies fit beside the KV pool."""
        from tokenmill.models.layers.cpu_packed import pack_linear_weights
        from tokenmill.worker.sizing import cpu_spare_bytes

        spare = cpu_spare_bytes(self.num_blocks * self.runner.kv_bytes_per_block(), self.tp_size)
        packed = pack_linear_weights(self.model, spare)
        if packed and self.rank == 0:
            logger.info("CPU linear weights pre-packed for oneDNN: %.2f GiB", packed / 2**30)

    @torch.inference_mode()
    def _warm_logits(self) -> None:
        """The logits GEMM once at every row count a step can sample (1 to max_num_seqs) or score
        prompt logprobs in (a slice of at most ``prompt_logprob_rows``), on a GPU. It runs eagerly
        each step (not in a graph) at the step's number of such rows, and cuBLAS's first GEMM of
        a shape (choosing, maybe loading, its kernel) blocks: during a process's first big call
        that cost ~5 ms a prompt step and 0.1-0.35 ms a decode step of host time on an H100, the
        prompt steps' launches blocking for the GPU (docs/perf.md 99). Every rank runs it at once
        (collective_rpc), so tensor parallelism's all-gathers pair up."""
        compute_logits = getattr(self.model, "compute_logits", None)
        if self.device.type != "cuda" or compute_logits is None:
            return
        start = time.perf_counter()
        rows = max(self.config.max_num_seqs, self.runner.prompt_logprob_rows)
        hidden = torch.zeros(rows, self.model.config.hidden_size, dtype=self.config.dtype, device=self.device)
        for n in range(1, rows + 1):
            compute_logits(hidden[:n])
        torch.cuda.synchronize(self.device)
        logger.info("ran the logits GEMM at 1-%d rows in %.2f s", rows, time.perf_counter() - start)

    def _capture_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if self.offloader is not None:
            # Each forward streams the offloaded layers through staging buffers; the copy dominates anyway.
            logger.info("CUDA graphs are not used with cpu_offload_gb: decode steps run eagerly")
            return
        # Under tensor parallelism every rank captures here at the same time (collective_rpc), so
        # the warm-up forwards' all-reduces pair up and each graph holds the NCCL collectives of
        # its bucket; rank 0's replays are then mirrored (Executor.mirror_decode_graphs).
        self.runner.capture_decode_graphs(self.config.max_num_seqs, self.config.max_model_len)
        prompt_graph_tokens = self._prompt_graph_tokens()
        if prompt_graph_tokens:
            self.runner.capture_prompt_graphs(prompt_graph_tokens)

    def _prompt_graph_tokens(self) -> int:
        """The largest step with prompt tokens that replays CUDA graphs (piecewise_graphs.py), 0 for
        none: not on the CPU, with enforce_eager or cpu_offload_gb (no graphs at all), nor under
        tensor parallelism (the other ranks mirror rank 0's model calls, not these replays) or in
        deterministic mode (its invariance was measured on the eager prompt steps)."""
        config = self.config
        if (self.device.type != "cuda" or config.enforce_eager or self.offloader is not None or self.tp_size > 1
                or config.deterministic):
            return 0
        from tokenmill.worker.piecewise_graphs import linear_weight_count, max_graph_tokens

        return max_graph_tokens(self.model.num_layers, linear_weight_count(self.model), config.max_num_batched_tokens)

    def execute_model(self, plan: "SchedulerOutput") -> "StepResult":
        """Launch one step on this rank (rank 0's; the other ranks follow its model calls)."""
        return self.runner.execute(plan)

    def use_grammars(self, grammars: Any) -> None:
        """The engine's GrammarCache, which masks the logits of sequences with structured outputs."""
        self.runner.grammars = grammars

    # ---- LLM.sleep / wake_up -------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Free the KV cache (and the decode graphs that read it); level 1 keeps the weights in
        pinned CPU memory, level 2 discards them (tokenmill/worker/sleep.py)."""
        if self.asleep:
            raise RuntimeError(f"rank {self.rank} is already asleep ({sorted(self.asleep)}); wake_up first")
        self.runner.free_kv_cache()
        if self.offloader is not None:
            self.offloader.free_buffers()
        if level == 2:
            self._drop_packed_weights()  # freed with the weights they copy
        self._stash = WeightStash(self.model, discard=level == 2)
        self.asleep = {"weights", "kv_cache"}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the weights and/or the KV cache (all when ``tags`` is None); once both are
        back, the decode graphs are captured again."""
        tags = list(SLEEP_TAGS) if tags is None else tags
        woke = False
        if "weights" in tags and "weights" in self.asleep:
            assert self._stash is not None
            self._stash.restore()
            self._stash = None
            if self.offloader is not None:
                self.offloader.allocate_buffers()
            self.asleep.discard("weights")
            woke = True
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.runner.allocate_kv_cache(self.num_blocks)
            self.asleep.discard("kv_cache")
            woke = True
        if woke and not self.asleep:
            self._capture_graphs()

    def update_config(self, overrides: dict[str, Any]) -> None:
        """vLLM's way to change how the next ``reload_weights`` reads the checkpoint, e.g. after a start
        with ``load_format="dummy"``: ``collective_rpc("update_config", args=({"load_config":
        {"load_format": "auto"}},))``. The load format is the only setting that can change after start-up."""
        from tokenmill.config import LOAD_FORMATS

        allowed = "{'load_config': {'load_format': ...}}"
        if not isinstance(overrides, dict) or set(overrides) - {"load_config"}:
            raise ValueError(f"update_config({overrides!r}) is not supported: only {allowed} can change after start-up")
        load = overrides.get("load_config", {})
        if not isinstance(load, dict) or set(load) - {"load_format"}:
            raise ValueError(f"update_config: load_config={load!r} is not supported: only its load_format can change")
        load_format = load.get("load_format", self.load_format)
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"update_config: load_format={load_format!r} is invalid: must be one of {LOAD_FORMATS}")
        self.load_format = load_format

    def reload_weights(self) -> None:
        """Read the checkpoint into the model again (after a level-2 sleep and wake_up(["weights"]))."""
        from tokenmill.models.loader import fill_weights, weights_format

        if self.config.quantization is not None:
            raise ValueError("reload_weights is not supported for quantized models")
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights sleep: wake_up(tags=['weights']) first")
        with torch.no_grad():
            fill_weights(self.model, self.source, weights_format(self.source, self.load_format), self.config.seed)

    # ---- LoRA adapters (the engine's AdapterBook decides; tokenmill/lora/) --------------------------
    def lora_targets(self) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """What adapters may adapt (module name -> (in, out) features of the full model), and the
        modules left out by lora_target_modules."""
        assert self.lora is not None, "the engine asks only with enable_lora"
        return self.lora.target_shapes(), self.lora.excluded

    def load_lora(self, slot: int, spec: "AdapterSpec") -> None:
        assert self.lora is not None, "the engine asks only with enable_lora"
        self.lora.load(slot, spec)

    def cache_lora(self, spec: "AdapterSpec") -> None:
        assert self.lora is not None, "the engine asks only with enable_lora"
        self.lora.cache(spec)

    def drop_lora(self, lora_id: int) -> None:
        assert self.lora is not None, "the engine asks only with enable_lora"
        self.lora.pinned.discard(lora_id)
        self.lora.drop(lora_id)

    def pin_lora(self, lora_id: int) -> None:
        assert self.lora is not None, "the engine asks only with enable_lora"
        self.lora.pinned.add(lora_id)

    # ---- LLM.start_profile / stop_profile -------------------------------------------------------
    def start_profile(self, prefix: str | None = None) -> None:
        assert self.profiler is not None, "the engine checks that profiling is configured"
        self.profiler.start(prefix)

    def stop_profile(self) -> None:
        assert self.profiler is not None, "the engine checks that profiling is configured"
        self.profiler.stop()

    # ---- weight transfer (tokenmill/weight_transfer.py) -------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from tokenmill.weight_transfer import WeightReceiver

        self._weight_receiver = WeightReceiver(init_info, self.rank, self.device)

    def start_weight_update(self) -> None:
        """Nothing to prepare: updates are copied into the parameters in place."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Replace the named tensors in place, all or (refused up front) none. The refusals of this
        rank's state are made here, not before the call: over the trainer's group the tensors are
        on their way, and must be received (and dropped) for the trainer's send to return."""
        from tokenmill.weight_transfer import apply_update

        refusal: Exception | None = None
        if self.config.quantization is not None:
            refusal = ValueError(f"update_weights on quantized weights ({self.config.quantization.describe()}) is not supported")
        elif "weights" in self.asleep:
            refusal = RuntimeError("update_weights while the weights sleep: wake_up(tags=['weights']) first")
        apply_update(self.model, update_info, self._weight_receiver, refusal)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        """Nothing to finish: every update was applied when it arrived."""

    def apply_model(self, func: Callable[[torch.nn.Module], _R]) -> _R:
        """func(this rank's model): LLM.apply_model."""
        try:
            return func(self.model)
        finally:
            self._drop_packed_weights()

    def execute_method(self, method: str | Callable[..., _R], args: tuple = (), kwargs: dict | None = None) -> Any:
        """One rank's part of collective_rpc: a Worker method by name, or method(worker, ...)."""
        try:
            if isinstance(method, str):
                return getattr(self, method)(*args, **(kwargs or {}))
            return method(self, *args, **(kwargs or {}))
        finally:
            if not isinstance(method, str) or not hasattr(Worker, method):  # a function, or an extension's method
                self._drop_packed_weights()

    def _drop_packed_weights(self) -> None:
        """On the CPU, free the linear weights' packed copies; each is made again on first use. After
        code we do not know ran against the model (apply_model, a function or a worker extension's
        method through collective_rpc): it may have written weights through ``.data``, which no
        version counter sees."""
        if self.device.type == "cpu":
            from tokenmill.models.layers.cpu_packed import drop_packed_copies

            drop_packed_copies(self.model)


def worker_class(extension: str | type = "") -> type[Worker]:
    """`Worker`, or with ``worker_extension_cls`` a subclass that has the extension's methods too
    (vLLM's way to add methods for collective_rpc, e.g. an RL loop's weight-sync helpers)."""
    if not extension:
        return Worker
    if isinstance(extension, str):
        import importlib

        module, _, name = extension.rpartition(".")
        try:
            extension = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"worker_extension_cls={extension!r} cannot be imported: {exc}") from exc
    assert isinstance(extension, type)
    clash = sorted(n for n in vars(extension) if not n.startswith("__") and hasattr(Worker, n))
    if clash:
        raise ValueError(f"worker_extension_cls {extension.__name__} redefines Worker's {clash}")
    return type(f"{extension.__name__}Worker", (Worker, extension), {})


def _attach_lora(model: torch.nn.Module, config: "EngineConfig") -> "ModelLoRA | None":
    if config.lora is None:
        return None
    from tokenmill.lora.model import ModelLoRA

    lora = config.lora
    return ModelLoRA(model, lora.max_loras, lora.max_rank, lora.max_cpu_loras, config.dtype, config.device,
                     lora.target_modules)


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
