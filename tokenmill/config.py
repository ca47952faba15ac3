"""Engine settings: what the user asked for (EngineArgs) and what the engine runs with (EngineConfig)."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tokenmill.models.source import ModelSource
    from tokenmill.pooling.config import PoolingModelConfig
    from tokenmill.quantization.config import QuantizationConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# vLLM's spellings. fp8 stores keys and values as float8 e4m3 (saturating at +-448, scale 1, as
# vLLM without calibrated scales): half the bytes of bf16, so twice the cache, at the cost of 3
# mantissa bits on every cached key and value. (Decode attention over it is not faster yet: the
# kernel's fp8 conversion costs more than the halved reads save; docs/perf.md, entry 9.)
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's offline defaults: 256 sequences and 8192 tokens a step, raised to 1024 and 16384 on GPUs
# with at least 70 GiB, where the larger batch amortises weight reads and per-step host work.
_DEFAULT_SEQS, _DEFAULT_BATCHED_TOKENS = 256, 8192
_LARGE_GPU_SEQS, _LARGE_GPU_BATCHED_TOKENS, _LARGE_GPU_BYTES = 1024, 16384, 70 * 2**30


@dataclass
class EngineArgs:
    """The keyword arguments of `LLM(...)`, with vLLM's names and defaults."""

    model: str = "smollm2-135m-instruct"
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # 256; 1024 on GPUs with >= 70 GiB (as vLLM)
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" / "fp8_e4m3"
    # None: the checkpoint's own (config.json's quantization_config), or full precision; "fp8":
    # quantize a full-precision checkpoint while loading. See tokenmill/quantization/config.py.
    quantization: str | None = None
    enable_prefix_caching: bool = True
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
    gguf_file: str | None = None
    tensor_parallel_size: int = 1
    disable_log_stats: bool = True
    tokenizer_mode: str = "auto"
    # Pooling models (vLLM's names; see tokenmill/pooling/config.py).
    runner: str = "auto"  # "auto" | "generate" | "pooling"
    convert: str = "auto"  # "auto" | "none" | "embed" | "classify"
    task: str | None = None  # vLLM's older spelling: "generate" | "embed" | "classify" | "score"
    pooler_config: Any = None  # a PoolerConfig or a dict of its fields
    # Every request's logits a function of its own tokens only, bit for bit, whatever else is in the
    # batch, chunking or prefix-cache hits (batch-invariant kernels; docs/batch.md says what it costs).
    deterministic: bool = False

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineArgs":
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"LLM() got an unknown keyword argument {name!r}{hint} (accepted: {', '.join(known)})")
        args = cls(model=model, **kwargs)
        args.validate()
        return args

    def validate(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", self.dtype, f"one of {_DTYPES}")
        _check(self.load_format in _LOAD_FORMATS, "load_format", self.load_format, f"one of {_LOAD_FORMATS}")
        _check(self.kv_cache_dtype in _KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype, f"one of {_KV_CACHE_DTYPES}")
        _check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size", self.block_size, "a power of two")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", self.gpu_memory_utilization, "(0, 1]")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        _check(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        _check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            self.kv_cache_memory_bytes,
            "> 0",
        )
        _check(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")
        _check(self.generation_config in ("auto", "vllm") or bool(self.generation_config), "generation_config", self.generation_config, "'auto', 'vllm' or a folder")
        _check(self.tokenizer_mode in ("auto", "hf"), "tokenizer_mode", self.tokenizer_mode, "'auto' or 'hf' (both load the Hugging Face tokenizer)")
        from tokenmill.pooling.config import CONVERTS, RUNNERS, TASK_SPELLINGS

        _check(self.runner in RUNNERS, "runner", self.runner, f"one of {RUNNERS}")
        _check(self.convert in CONVERTS, "convert", self.convert, f"one of {CONVERTS}")
        _check(self.task is None or self.task in TASK_SPELLINGS, "task", self.task, f"None or one of {tuple(TASK_SPELLINGS)}")
        _check(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size", self.tensor_parallel_size, "an integer >= 1 (the number of GPUs, or CPU processes)",
        )
        _check(isinstance(self.deterministic, bool), "deterministic", self.deterministic, "True or False")
        _check(
            not self.deterministic or self.tensor_parallel_size == 1, "deterministic", self.deterministic,
            "False with tensor_parallel_size > 1 (an all-reduce's summation order depends on its size)",
        )


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
    eos_token_ids: frozenset[int]
    tensor_parallel_size: int = 1
    quantization: "QuantizationConfig | None" = None  # the linear layers' weights; None: the model's dtype
    # How a pooling model pools (tokenmill/pooling/); None: a generative model.
    pooling: "PoolingModelConfig | None" = None
    deterministic: bool = False  # batch-invariant kernels (tokenmill/kernels/batch_invariant.py)


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


def model_max_len(hf_config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def resolve_config(args: EngineArgs, source: "ModelSource") -> EngineConfig:
    """The settings the engine runs with, for this model: generation, or a pooling model's
    (whole-prompt steps: every prompt must fit one step's token budget)."""
    from tokenmill.pooling.config import resolve_pooling

    config = _base_config(args, source)
    pooling = resolve_pooling(source, args.runner, args.convert, args.task, args.pooler_config)
    if pooling is None:
        return config
    if args.deterministic:
        raise ValueError("LLM(deterministic=True) is for generation: pooling models have no batch-invariant path")
    max_model_len, batched, seqs = pooling.step_limits(
        config.max_model_len, config.max_num_batched_tokens, config.max_num_seqs,
        max_model_len_given=args.max_model_len is not None, batched_given=args.max_num_batched_tokens is not None,
        seqs_given=args.max_num_seqs is not None, tensor_parallel_size=config.tensor_parallel_size, device=config.device,
    )
    return dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=batched, max_num_seqs=seqs,
                               pooling=pooling)


def _base_config(args: EngineArgs, source: "ModelSource") -> EngineConfig:
    import torch

    from tokenmill.quantization.config import resolve_quantization

    hf_config = source.hf_config
    quantization = resolve_quantization(args.quantization, hf_config)
    if quantization is not None and args.deterministic:
        raise ValueError(
            f"LLM(deterministic=True) needs full-precision weights: the {quantization.method} GEMMs choose their tile "
            "by batch size, so their rows are not batch-invariant"
        )
    device = resolve_device(args.device)
    limit = model_max_len(hf_config)
    max_model_len = args.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len={max_model_len} is larger than the model's max_position_embeddings ({limit}); "
            f"use max_model_len <= {limit}"
        )
    seqs, batched = _default_batch_limits(device)
    max_num_seqs = args.max_num_seqs or seqs
    dtype = resolve_dtype(args.dtype, device, hf_config)
    batched = args.max_num_batched_tokens or max(batched, max_num_seqs)
    return EngineConfig(
        model=source.name,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
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
        quantization=quantization,
        deterministic=args.deterministic,
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


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"LLM({name}={value!r}) is invalid: must be {allowed}")
