"""Engine settings: what the user asked for (EngineArgs) and what the engine runs with (EngineConfig)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable

from tokenmill.engine_args_table import VLLM_ARGUMENTS, Handling, check_value, unimplemented_fields
from tokenmill.generation_defaults import GENERATION_CONFIG_FIELDS
from tokenmill.param_checks import is_int, is_number

if TYPE_CHECKING:
    import argparse

    import torch

    from tokenmill.lora.config import LoRAConfig
    from tokenmill.models.source import ModelSource
    from tokenmill.pooling.config import PoolingModelConfig
    from tokenmill.profiler import ProfilerConfig
    from tokenmill.quantization.config import QuantizationConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
_SCHEDULING_POLICIES = ("fcfs", "priority")
_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's spellings. fp8 stores keys and values as float8 e4m3 (saturating at +-448, scale 1, as
# vLLM without calibrated scales): half the bytes of bf16, so twice the cache, at the cost of 3
# mantissa bits on every cached key and value. (Decode attention over it is not faster yet: the
# kernel's fp8 conversion costs more than the halved reads save; docs/perf.md, entry 9.)
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's offline defaults: 256 sequences and 8192 tokens a step, raised to 1024 and 16384 on GPUs
# with at least 70 GiB, where the larger batch amortises weight reads and per-step host work.
_DEFAULT_SEQS, _DEFAULT_BATCHED_TOKENS = 256, 8192
_LARGE_GPU_SEQS, _LARGE_GPU_BATCHED_TOKENS, _LARGE_GPU_BYTES = 1024, 16384, 70 * 2**30
_DEFAULT_BLOCK_SIZE = 16
# "slow" asks transformers for the Python tokenizer (use_fast=False; where a model has none,
# transformers gives the fast one); "auto" and "hf" load the default one.
_TOKENIZER_MODES = ("auto", "hf", "slow")
# Sections of vLLM's config objects tokenmill reads: field -> the values it implements (the
# first is vLLM's default). Anything else is refused by name.
_STRUCTURED_OUTPUTS_FIELDS = {
    "backend": ("auto", "xgrammar"),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "reasoning_parser": ("",),
    "reasoning_parser_plugin": ("",),
    "enable_in_reasoning": (False,),
}
# The on/off arguments, checked to be bools (those that may also be None: "decide for me").
_OPTIONAL_BOOL_FIELDS = ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling")
_BOOL_FIELDS = ("enforce_eager", "skip_tokenizer_init", "trust_remote_code", "disable_log_stats", "deterministic",
                "disable_sliding_window", "enable_lora", *_OPTIONAL_BOOL_FIELDS)
# backend "nccl" is vLLM's default: a torch.distributed group (NCCL between GPUs, gloo on CPUs).
_WEIGHT_TRANSFER_FIELDS = {"backend": ("nccl",)}

# vLLM's arguments that are not fields of our own (engine_args_table.py): accepted as keywords
# with vLLM's defaults, and checked by EngineArgs.validate.
_VllmOnlyArguments = dataclasses.make_dataclass("_VllmOnlyArguments", unimplemented_fields(), kw_only=True)


@dataclass
class EngineArgs(_VllmOnlyArguments):
    """The keyword arguments of `LLM(...)`, with vLLM's names and defaults.

    The fields below are the ones tokenmill implements; every other vLLM argument is accepted
    too (a keyword-only field of the base class), at its default or wherever it makes no
    difference, and refused otherwise: see tokenmill/engine_args_table.py.
    """

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # 256; 1024 on GPUs with >= 70 GiB (as vLLM)
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None  # the KV pool's block count (null block included), unsized
    block_size: int | None = _DEFAULT_BLOCK_SIZE  # None: 16
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" / "fp8_e4m3"
    # None: the checkpoint's own (config.json's quantization_config), or full precision; "fp8":
    # quantize a full-precision checkpoint while loading. See tokenmill/quantization/config.py.
    quantization: str | None = None
    enable_prefix_caching: bool | None = True  # None: True
    # False: a prompt is admitted only when all of it fits one step (max_num_batched_tokens is
    # then raised to max_model_len); None / True: long prompts are computed in chunks.
    enable_chunked_prefill: bool | None = None
    # "priority": waiting requests go by their priority (lower first), then arrival, and running out of
    # KV blocks preempts the lowest-priority running request (vLLM's rules); "fcfs": arrival order.
    scheduling_policy: str = "fcfs"
    # GiB of each rank's weights kept in pinned CPU memory and streamed to the GPU layer by layer
    # ahead of use (tokenmill/worker/offload.py); ignored on the CPU, where weights live anyway.
    cpu_offload_gb: float = 0
    enforce_eager: bool = False
    # Launch step N+1 before step N's sampled ids are read back (None: on GPUs, where the host work
    # then overlaps the device's; on a CPU the two cannot overlap).
    async_scheduling: bool | None = None
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    device: str = "auto"
    generation_config: str = "auto"
    # generation_config.json keys laid over the model's (or vLLM's) defaults, e.g. {"temperature": 0.5}.
    override_generation_config: dict[str, Any] | None = None
    chat_template: str | os.PathLike | None = None  # LLM.chat's template when a call gives none (text or a file path)
    # config.json fields replaced before the model is built: a dict, or a function config -> config.
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None
    gguf_file: str | None = None
    tensor_parallel_size: int = 1
    disable_log_stats: bool = True
    tokenizer_mode: str = "auto"
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for; -1: the vocabulary
    # What sample logprobs report: the raw model's (default) or the distribution drawn from (worker/sampler.py).
    logprobs_mode: str = "raw_logprobs"
    # Pooling models (vLLM's names; see tokenmill/pooling/config.py).
    runner: str = "auto"  # "auto" | "generate" | "pooling"
    convert: str = "auto"  # "auto" | "none" | "embed" | "classify"
    task: str | None = None  # vLLM's older spelling: "generate" | "embed" | "classify" | "score"
    pooler_config: Any = None  # a PoolerConfig or a dict of its fields
    # Engine controls and observability (vLLM's names).
    # disable_log_stats=False collects the metrics LLM.get_metrics() reads (needs prometheus-client).
    served_model_name: str | list[str] | None = None  # the metrics' model_name label (default: model)
    # LLM.start_profile's torch.profiler settings: {"profiler": "torch", "torch_profiler_dir": ...}
    # (tokenmill/profiler.py); None: from VLLM_TORCH_PROFILER_DIR if set.
    profiler_config: Any = None
    structured_outputs_config: Any = None  # {"backend": "auto" | "xgrammar"}: grammars are xgrammar's
    weight_transfer_config: Any = None  # {"backend": "nccl"} (tokenmill/weight_transfer.py)
    # "module.Class" (or the class): its methods join every rank's Worker, for collective_rpc.
    worker_extension_cls: str | type = ""
    # Every request's logits a function of its own tokens only, bit for bit, whatever else is in the
    # batch, chunking or prefix-cache hits (batch-invariant kernels; docs/batch.md says what it costs).
    deterministic: bool = False
    # tokenmill attends to the whole sequence, so for a model with a sliding window max_model_len
    # defaults to the window (outputs exact); True (vLLM: attend fully, cap at the window) also
    # refuses a longer max_model_len. See tokenmill/max_model_len.py.
    disable_sliding_window: bool = False
    # vLLM V1's batch-level logits processors: classes (or "module:Class" names) implementing
    # tokenmill.logits_processor.LogitsProcessor, built once and applied to every step's logits.
    logits_processors: list[Any] | None = None
    # LoRA adapters per request (tokenmill/lora/): max_loras adapters may share a step, each of rank
    # <= max_lora_rank; each rank keeps max_cpu_loras (None: max_loras) of them read in CPU memory.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: Any = "auto"  # "auto" or the model's dtype
    lora_target_modules: list[str] | None = None  # only these projections take adapters (None: all)

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"LLM() got an unknown keyword argument {name!r}{hint} (tokenmill takes vLLM's LLM and "
                    "EngineArgs arguments: tokenmill/engine_args_table.py lists them)"
                )
        args = cls(model=model, **kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", self.dtype, f"one of {_DTYPES}")
        _check(self.load_format in LOAD_FORMATS, "load_format", self.load_format, f"one of {LOAD_FORMATS}")
        _check(self.scheduling_policy in _SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
               f"one of {_SCHEDULING_POLICIES}")
        _check(self.logprobs_mode in _LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode, f"one of {_LOGPROBS_MODES}")
        _check(self.kv_cache_dtype in _KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype, f"one of {_KV_CACHE_DTYPES}")
        _check(is_int(self.seed), "seed", self.seed, "an integer (vLLM's default is 0)")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            _check(value is None or (is_int(value) and value >= 1), name, value, "None or an integer >= 1")
        for name in ("tokenizer", "revision", "tokenizer_revision", "gguf_file"):
            # Path("") is the current folder, and a number fails inside pathlib or huggingface_hub.
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and bool(value.strip())), name, value, "None or a non-empty string")
        for name in _BOOL_FIELDS:  # a string such as "false" would count as True
            value = getattr(self, name)
            _check(isinstance(value, bool) or (value is None and name in _OPTIONAL_BOOL_FIELDS), name, value,
                   "True or False" + (" (or None)" if name in _OPTIONAL_BOOL_FIELDS else ""))
        _check(self.block_size is None or (is_int(self.block_size) and self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0),
               "block_size", self.block_size, "a power of two (or None: 16)")
        _check(is_number(self.gpu_memory_utilization) and 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
               self.gpu_memory_utilization, "a number in (0, 1]")
        _check(isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")),
               "device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N' (a string)")
        _check(self.generation_config in ("auto", "vllm") or bool(self.generation_config), "generation_config", self.generation_config, "'auto', 'vllm' or a folder")
        _check(self.tokenizer_mode in _TOKENIZER_MODES, "tokenizer_mode", self.tokenizer_mode,
               "'auto' or 'hf' (the Hugging Face tokenizer), or 'slow' (its Python version where the model has one)")
        _check(is_int(self.max_logprobs) and self.max_logprobs >= -1, "max_logprobs", self.max_logprobs, ">= 0, or -1 for the whole vocabulary")
        self._validate_engine_controls()
        for name, argument in VLLM_ARGUMENTS.items():
            if argument.handling is not Handling.IMPLEMENTED:
                check_value(name, getattr(self, name))
        from tokenmill.pooling.config import CONVERTS, RUNNERS, TASK_SPELLINGS

        _check(self.runner in RUNNERS, "runner", self.runner, f"one of {RUNNERS}")
        _check(self.convert in CONVERTS, "convert", self.convert, f"one of {CONVERTS}")
        _check(self.task is None or self.task in TASK_SPELLINGS, "task", self.task, f"None or one of {tuple(TASK_SPELLINGS)}")
        _check(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1 (the number of GPUs, or CPU processes)",
        )
        _check(
            not self.deterministic or self.tensor_parallel_size == 1, "deterministic", self.deterministic,
            "False with tensor_parallel_size > 1 (an all-reduce's summation order depends on its size)",
        )

    def _validate_engine_controls(self) -> None:
        """The arguments tokenmill added for vLLM's engine controls and config sections."""
        _check(is_number(self.cpu_offload_gb) and self.cpu_offload_gb >= 0, "cpu_offload_gb", self.cpu_offload_gb,
               "a number of GiB >= 0")
        _check(self.num_gpu_blocks_override is None or (is_int(self.num_gpu_blocks_override) and self.num_gpu_blocks_override >= 2),
               "num_gpu_blocks_override", self.num_gpu_blocks_override, "None or an integer >= 2")
        _check(self.hf_overrides is None or isinstance(self.hf_overrides, dict) or callable(self.hf_overrides),
               "hf_overrides", self.hf_overrides, "None, a dict of config.json fields or a function config -> config")
        overrides = self.override_generation_config or {}
        _check(isinstance(overrides, dict) and set(overrides) <= set(GENERATION_CONFIG_FIELDS), "override_generation_config",
               self.override_generation_config, f"a dict with keys among {sorted(GENERATION_CONFIG_FIELDS)}")
        _check(self.chat_template is None or isinstance(self.chat_template, (str, os.PathLike)), "chat_template", self.chat_template,
               "None, a Jinja template or the path of a file holding one")
        _check(self.served_model_name is None or isinstance(self.served_model_name, str)
               or (isinstance(self.served_model_name, (list, tuple)) and all(isinstance(n, str) for n in self.served_model_name)),
               "served_model_name", self.served_model_name, "None, a name or a list of names")
        _check(isinstance(self.worker_extension_cls, (str, type)), "worker_extension_cls", self.worker_extension_cls,
               "'' or a class (or its 'module.Class' name)")
        config_section("structured_outputs_config", self.structured_outputs_config, _STRUCTURED_OUTPUTS_FIELDS)
        config_section("weight_transfer_config", self.weight_transfer_config, _WEIGHT_TRANSFER_FIELDS)
        from tokenmill.profiler import resolve_profiler_config

        resolve_profiler_config(self.profiler_config)  # raises on an unknown or unsupported setting

    # ---- vLLM's command-line helpers ------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: "argparse.ArgumentParser") -> "argparse.ArgumentParser":
        """Add an option for every argument (``--max-model-len`` or ``--max_model_len``), defaulting
        to `EngineArgs`' defaults, so ``LLM(**vars(parser.parse_args()))`` works as with vLLM."""
        from tokenmill.engine_args_cli import add_engine_options

        return add_engine_options(parser, fields(EngineArgs))

    @classmethod
    def from_cli_args(cls, args: "argparse.Namespace") -> "EngineArgs":
        """EngineArgs from parsed options; attributes that are not arguments (a script's own) are left out."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        engine_args = cls(**values)
        engine_args.validate()
        return engine_args


@dataclass(frozen=True)
class EngineConfig:
    """Resolved settings the engine runs with; derived once from EngineArgs and the model."""

    model: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    enforce_eager: bool
    async_scheduling: bool
    device: "torch.device"
    dtype: "torch.dtype"
    kv_cache_dtype: "torch.dtype"  # the model's dtype, or float8_e4m3fn
    seed: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    vocab_size: int
    eos_token_ids: frozenset[int]  # every id that ends a sequence: the configs' eos ids and the tokenizer's
    tensor_parallel_size: int = 1
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs per position a request may ask for; -1: vocab_size
    # False: a prompt is admitted only when all of it fits one step.
    chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority" (engine/waiting_queue.py)
    # The tokenizer's eos (vLLM's primary eos): a stop on it has stop_reason None, a stop on the
    # configs' other eos ids their id (vLLM adds those to stop_token_ids). None without a tokenizer.
    primary_eos_token_id: int | None = None
    logprobs_mode: str = "raw_logprobs"  # what sample logprobs report (worker/sampler.py)
    cpu_offload_bytes: int = 0  # of each rank's weights, streamed from pinned CPU memory (worker/offload.py)
    num_gpu_blocks_override: int | None = None
    log_stats: bool = False  # collect the metrics of LLM.get_metrics() (tokenmill/metrics/)
    served_model_name: str = ""  # the metrics' model_name label
    profiler: "ProfilerConfig | None" = None  # LLM.start_profile's settings; None: profiling off
    worker_extension_cls: str | type = ""  # its methods join every rank's Worker (collective_rpc)
    quantization: "QuantizationConfig | None" = None  # the linear layers' weights; None: the model's dtype
    # How a pooling model pools (tokenmill/pooling/); None: a generative model.
    pooling: "PoolingModelConfig | None" = None
    deterministic: bool = False  # batch-invariant kernels (tokenmill/kernels/batch_invariant.py)
    # LLM(logits_processors=...): the classes rank 0's runner builds (tokenmill/logits_processor.py).
    logits_processors: tuple[type, ...] = ()
    lora: "LoRAConfig | None" = None  # LLM(enable_lora=True): adapters per request (tokenmill/lora/)

    def get_vocab_size(self) -> int:
        """vLLM's ModelConfig.get_vocab_size(): scripts size logprobs=-1 or token-id checks with it."""
        return self.vocab_size


def resolve_device(device: str) -> "torch.device":
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but torch sees no CUDA GPU; use device='cpu'")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str, device: "torch.device", hf_config: Any) -> "torch.dtype":
    """'auto' follows the checkpoint on GPUs (fp32 checkpoints run in bf16). On the CPU it is bf16
    where the CPU has native bf16 arithmetic (1.7x the fp32 speed on C1, see docs/perf.md) and fp32
    elsewhere; dtype='float32' keeps the bit-faithful path."""
    import torch

    named = {
        "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
        "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    }
    if dtype != "auto":
        return named[dtype]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    stored = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = named.get(stored)
    return stored if stored in (torch.float16, torch.bfloat16) else torch.bfloat16


def resolve_config(args: EngineArgs, source: "ModelSource") -> EngineConfig:
    """The settings the engine runs with, for this model: generation, or a pooling model's
    (whole-prompt steps: every prompt must fit one step's token budget)."""
    from tokenmill.pooling.config import resolve_pooling

    config = _base_config(args, source)
    pooling = resolve_pooling(source, args.runner, args.convert, args.task, args.pooler_config)
    if pooling is None:
        from tokenmill.tensor_parallel_shapes import check_tensor_parallel

        check_tensor_parallel(config.tensor_parallel_size, source.hf_config)  # before any worker process starts
        return config
    if config.cpu_offload_bytes:
        raise ValueError(f"LLM(cpu_offload_gb={args.cpu_offload_gb}) is for generative models; {source.name!r} is a pooling model")
    if args.deterministic:
        raise ValueError("LLM(deterministic=True) is for generation: pooling models have no batch-invariant path")
    if config.logits_processors:
        raise ValueError(f"LLM(logits_processors=...) is for generative models; {source.name!r} is a pooling model")
    if config.lora is not None:
        raise ValueError(f"LLM(enable_lora=True) is for generative models; {source.name!r} is a pooling model")
    max_model_len, batched, seqs = pooling.step_limits(
        config.max_model_len, config.max_num_batched_tokens, config.max_num_seqs,
        max_model_len_given=args.max_model_len is not None, batched_given=args.max_num_batched_tokens is not None,
        seqs_given=args.max_num_seqs is not None, tensor_parallel_size=config.tensor_parallel_size, device=config.device,
    )
    return dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=batched, max_num_seqs=seqs,
                               pooling=pooling)


def _base_config(args: EngineArgs, source: "ModelSource") -> EngineConfig:
    import torch

    from tokenmill.logits_processor import load_logits_processor_classes
    from tokenmill.max_model_len import resolve_max_model_len

    from tokenmill.quantization.config import resolve_quantization

    hf_config = source.hf_config
    quantization = resolve_quantization(args.quantization, hf_config)
    if quantization is not None and args.deterministic:
        raise ValueError(
            f"LLM(deterministic=True) needs full-precision weights: the {quantization.method} GEMMs choose their tile "
            "by batch size, so their rows are not batch-invariant"
        )
    device = resolve_device(args.device)
    max_model_len = resolve_max_model_len(args.max_model_len, args.disable_sliding_window, hf_config)
    seqs, batched = _default_batch_limits(device)
    max_num_seqs = args.max_num_seqs or seqs
    dtype = resolve_dtype(args.dtype, device, hf_config)
    batched = args.max_num_batched_tokens or max(batched, max_num_seqs)
    chunked_prefill = args.enable_chunked_prefill is not False
    if not chunked_prefill:
        # vLLM's rule: without chunks every prompt must fit one step.
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"LLM(max_num_batched_tokens={args.max_num_batched_tokens}) is smaller than max_model_len={max_model_len} "
                "with enable_chunked_prefill=False, so a long prompt could never be scheduled; raise it or allow chunks"
            )
        batched = max(batched, max_model_len)
    from tokenmill.lora.config import resolve_lora
    from tokenmill.profiler import resolve_profiler_config

    served = args.served_model_name
    return EngineConfig(
        model=source.name,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        block_size=args.block_size or _DEFAULT_BLOCK_SIZE,
        enable_prefix_caching=args.enable_prefix_caching is not False,
        enforce_eager=args.enforce_eager,
        async_scheduling=device.type == "cuda" if args.async_scheduling is None else args.async_scheduling,
        device=device,
        dtype=dtype,
        kv_cache_dtype=dtype if args.kv_cache_dtype == "auto" else torch.float8_e4m3fn,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=frozenset(eos_token_ids(hf_config, source.generation_config)),
        tensor_parallel_size=args.tensor_parallel_size,
        max_logprobs=args.max_logprobs,
        chunked_prefill=chunked_prefill,
        scheduling_policy=args.scheduling_policy,
        logprobs_mode=args.logprobs_mode,
        cpu_offload_bytes=int(args.cpu_offload_gb * 2**30),
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        log_stats=not args.disable_log_stats,
        served_model_name=(served if isinstance(served, str) else served[0]) if served else source.name,
        profiler=resolve_profiler_config(args.profiler_config),
        worker_extension_cls=args.worker_extension_cls,
        quantization=quantization,
        deterministic=args.deterministic,
        logits_processors=tuple(load_logits_processor_classes(args.logits_processors or ())),
        lora=resolve_lora(args.enable_lora, args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_dtype, dtype,
                          args.lora_target_modules),
    )


def _default_batch_limits(device: "torch.device") -> tuple[int, int]:
    import torch

    if device.type == "cuda" and torch.cuda.get_device_properties(device).total_memory >= _LARGE_GPU_BYTES:
        return _LARGE_GPU_SEQS, _LARGE_GPU_BATCHED_TOKENS
    return _DEFAULT_SEQS, _DEFAULT_BATCHED_TOKENS


def eos_token_ids(hf_config: Any, generation_config: dict) -> set[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), generation_config.get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def config_section(name: str, value: Any, implemented: dict[str, tuple]) -> dict[str, Any]:
    """A vLLM config section (a dict, or an object with its fields as attributes) as a dict of the
    fields given, each checked against the values tokenmill implements (the first: vLLM's default)."""
    if value is None:
        return {}
    given = value if isinstance(value, dict) else {k: v for k, v in vars(value).items() if not k.startswith("_")}
    for field_name, field_value in given.items():
        allowed = implemented.get(field_name)
        if allowed is None:
            raise ValueError(f"LLM({name}={{{field_name!r}: ...}}) is invalid: tokenmill knows the fields {sorted(implemented)}")
        if field_value not in allowed:
            raise ValueError(f"LLM({name}={{{field_name!r}: {field_value!r}}}) is not supported by tokenmill: "
                             f"supported: {' or '.join(repr(v) for v in allowed)}")
    return dict(given)


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LLM({name}={value!r}) is invalid: must be {allowed}")
