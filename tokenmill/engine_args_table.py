"""Every keyword argument of vLLM's `LLM(...)` / `EngineArgs`, and what tokenmill does with it.

A script written for vLLM passes its arguments unchanged, often every one of them at its default
(``LLM(**vars(args))`` after ``EngineArgs.add_cli_args``). Each argument is handled in one of
three ways, decided here and nowhere else:

- ``IMPLEMENTED``: an `EngineArgs` field of ours; `EngineArgs.validate` checks its value.
- ``NO_EFFECT``: any value is accepted because it cannot change what tokenmill computes (a
  tuning knob of vLLM's own kernels, a serving or model-hub setting, a setting of model kinds
  tokenmill does not load); ``note`` says why.
- ``DEFAULT_ONLY``: accepted at vLLM's default (or at ``also``, values meaning the same here);
  anything else is a ValueError naming the argument, the value and ``note``: what tokenmill
  supports instead.

``default`` is vLLM 0.26's default. Arguments of older vLLM versions that tutorials still pass
(``swap_space``, ``device``, ``task``, ...) are listed too. tests/test_engine_args_table.py walks
the table, and checks it against vLLM's source when that is at hand.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any


class Handling(enum.Enum):
    IMPLEMENTED = "implemented"
    NO_EFFECT = "no effect"
    DEFAULT_ONLY = "default only"


@dataclass(frozen=True)
class VllmArgument:
    default: Any
    handling: Handling
    note: str = ""
    also: tuple = ()

    def accepts(self, value: Any) -> bool:
        if self.handling is not Handling.DEFAULT_ONLY:
            return True
        return _same(value, self.default) or any(_same(value, other) for other in self.also)

    def refusal(self, name: str, value: Any) -> str:
        allowed = ", ".join(repr(v) for v in (self.default, *self.also))
        return f"LLM({name}={value!r}) is not supported by tokenmill: {self.note} (supported: {name}={allowed})"


def _same(value: Any, default: Any) -> bool:
    """Equal, or both unset (None and an empty dict, list, set or string mean the same here).
    A bool matches only a bool: enable_lora=0 is not enable_lora=False."""
    if _unset(value) and _unset(default):
        return True
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001  (a value whose == raises, e.g. an array, is simply not the default)
        return False


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, (str, tuple, list, dict, set, frozenset)) and len(value) == 0)


def ours(default: Any = None) -> VllmArgument:
    return VllmArgument(default, Handling.IMPLEMENTED)


def inert(default: Any, why: str) -> VllmArgument:
    return VllmArgument(default, Handling.NO_EFFECT, why)


def only(default: Any, instead: str, *also: Any) -> VllmArgument:
    return VllmArgument(default, Handling.DEFAULT_ONLY, instead, also)


# Reasons shared by many arguments.
_TUNING = "a tuning knob of vLLM's own kernels or scheduler; tokenmill chooses its own"
_HUB = "tokenmill loads local folders, built-ins and the local Hugging Face cache; nothing is downloaded"
_MM = "tokenmill serves text-only models (prompts with multimodal data are refused)"
_MOE = "a setting of vLLM's mixture-of-experts kernels; tokenmill's MoE layers run its own (kernels/triton/fused_moe.py)"
_EP = ("expert parallelism; tokenmill splits every expert's intermediate features over the tensor-parallel ranks "
       "instead (the same model, another distribution of its work)")
_MAMBA = "tokenmill has no Mamba / state-space models"
_LORA = "a LoRA setting of vLLM's own kernels or adapter formats; tokenmill's adapters are PEFT folders (tokenmill/lora/)"
_SERVING = "a setting of vLLM's server or multi-process front end; tokenmill is an offline engine"
_ONE_HOST = "tokenmill's ranks are processes on one host, joined over a private store"
_DP = "data parallelism is tokenmill.ray / `tokenmill run --replicas` (one engine per replica)"
_OLD = "removed from vLLM; "

VLLM_ARGUMENTS: dict[str, VllmArgument] = {
    # ---- the model and its tokenizer --------------------------------------------------------
    "model": ours("Qwen/Qwen3-0.6B"),
    "tokenizer": ours(),
    "tokenizer_mode": ours("auto"),
    "skip_tokenizer_init": ours(False),
    "trust_remote_code": ours(False),
    "revision": ours(),
    "tokenizer_revision": ours(),
    "code_revision": inert(None, _HUB),
    "hf_token": inert(None, _HUB),
    "download_dir": inert(None, _HUB),
    "ignore_patterns": inert(["original/**/*"], _HUB),
    "hf_config_path": only(None, "the config is read from the model folder (or GGUF file) itself"),
    "hf_overrides": ours({}),
    "model_class_overrides": only({}, "the model class follows config.json's architectures"),
    "model_weights": only("", "weights are read from the model folder; give the folder as model="),
    "config_format": only("auto", "config.json is read in Hugging Face's format", "hf"),
    "served_model_name": ours(),
    "model_impl": only("auto", "tokenmill runs its own model code", "vllm"),
    "runner": ours("auto"),
    "convert": ours("auto"),
    "pooler_config": ours(),
    "generation_config": ours("auto"),
    "override_generation_config": ours({}),
    "chat_template": ours(),  # an argument of LLM(...) only
    "seed": ours(0),
    "dtype": ours("auto"),
    "quantization": ours(),
    "quantization_config": only(None, "quantization comes from config.json's quantization_config or quantization='fp8'"),
    "allow_deprecated_quantization": inert(False, "tokenmill refuses the formats it cannot load whatever this says"),
    "load_format": ours("auto"),
    "model_loader_extra_config": inert({}, "options of vLLM's loaders; tokenmill's loader has none"),
    "safetensors_load_strategy": inert(None, "safetensors files are memory-mapped and read tensor by tensor"),
    "safetensors_prefetch_num_threads": inert(4, _TUNING),
    "safetensors_prefetch_block_size": inert(16 * 2**20, _TUNING),
    "pt_load_map_location": inert("cpu", "PyTorch .bin checkpoints are read (memory-mapped) to the CPU, then each rank's slices placed"),
    "use_tqdm_on_load": inert(True, "loading shows no progress bar"),
    "max_parallel_loading_workers": inert(None, _TUNING),
    "enable_prompt_embeds": only(False, "prompts are text or token ids; prompt_embeds are refused"),
    "max_logprobs": ours(20),
    "logprobs_mode": ours("raw_logprobs"),
    "use_fp64_gumbel": inert(False, "draws are exponential races on Philox noise (docs/architecture.md), not Gumbel noise"),
    "logits_processors": ours(),
    "io_processor_plugin": only(None, "prompts and outputs are text or token ids; there are no IO processor plugins"),
    "tokens_only": only(False, "the engine detokenizes; skip_tokenizer_init=True runs on token ids alone"),
    "reasoning_parser": only("", "tokenmill has no reasoning parsers"),
    "reasoning_parser_plugin": only(None, "tokenmill has no reasoning parsers"),
    "reasoning_config": only(None, "tokenmill has no reasoning parsers"),
    "structured_outputs_config": ours(),
    "diffusion_config": only(None, "tokenmill has no diffusion models"),
    # ---- memory and the KV cache ------------------------------------------------------------
    "gpu_memory_utilization": ours(0.92),
    "kv_cache_memory_bytes": ours(),
    "num_gpu_blocks_override": ours(),
    "block_size": ours(),
    "kv_cache_dtype": ours("auto"),
    "calculate_kv_scales": only(False, "an fp8 KV cache uses scale 1 (kv_cache_dtype='fp8')"),
    "kv_cache_dtype_skip_layers": only([], "kv_cache_dtype applies to every layer"),
    "enable_prefix_caching": ours(),
    "prefix_caching_hash_algo": inert("sha256", "prefix blocks are keyed by a chained hash of their token ids; only speed differs"),
    "prefix_match_unit": inert(None, "prefixes are matched a whole block at a time"),
    "cpu_offload_gb": ours(0),
    "cpu_offload_params": only(set(), "cpu_offload_gb offloads whole decoder layers"),
    "offload_backend": inert("auto", "cpu_offload_gb streams decoder layers with a prefetch on a side stream"),
    "offload_group_size": only(0, "cpu_offload_gb=N (layers streamed from pinned CPU memory with prefetch)"),
    "offload_num_in_group": inert(1, "a setting of offload_group_size, which is refused"),
    "offload_prefetch_step": inert(1, "cpu_offload_gb always prefetches the next offloaded layer"),
    "offload_params": only(set(), "cpu_offload_gb offloads whole decoder layers"),
    "swap_space": inert(4, _OLD + "preempted sequences are recomputed; nothing is swapped to CPU memory"),
    "kv_offloading_size": only(None, "the KV cache lives on the device only"),
    "kv_offloading_backend": inert("native", "a setting of kv_offloading_size, which is refused"),
    "kv_sharing_fast_prefill": inert(False, _TUNING),
    "enable_sleep_mode": inert(False, "LLM.sleep / wake_up always work"),
    "enable_cumem_allocator": inert(False, "sleep moves tensors itself; torch's allocator is used as is"),
    "mamba_cache_dtype": inert("auto", _MAMBA),
    "mamba_ssm_cache_dtype": inert("auto", _MAMBA),
    "mamba_block_size": inert(None, _MAMBA),
    "mamba_cache_mode": inert("none", _MAMBA),
    "mamba_backend": inert("triton", _MAMBA),
    "mamba_config": inert(None, _MAMBA),
    "enable_mamba_cache_stochastic_rounding": inert(False, _MAMBA),
    "mamba_cache_philox_rounds": inert(0, _MAMBA),
    # ---- scheduling -------------------------------------------------------------------------
    "max_model_len": ours(),
    "max_num_seqs": ours(),
    "max_num_batched_tokens": ours(),
    "max_num_scheduled_tokens": only(None, "max_num_batched_tokens bounds every step's tokens"),
    "enable_chunked_prefill": ours(),
    "max_num_partial_prefills": inert(1, _TUNING),
    "max_long_partial_prefills": inert(1, _TUNING),
    "long_prefill_token_threshold": inert(0, _TUNING),
    "disable_chunked_mm_input": inert(False, _MM),
    "scheduling_policy": ours("fcfs"),
    "scheduler_cls": only(None, "tokenmill's scheduler is fixed"),
    "scheduler_reserve_full_isl": inert(True, "a request is admitted only if its whole sequence fits the KV cache"),
    "prefill_schedule_interval": inert(1, _TUNING),
    "watermark": inert(0.0, _TUNING),
    "disable_hybrid_kv_cache_manager": inert(None, "tokenmill has one KV cache layout"),
    "async_scheduling": ours(),
    "stream_interval": inert(1, "LLM.stream yields after every step"),
    "disable_sliding_window": ours(False),
    "disable_cascade_attn": inert(True, _TUNING),
    "preemption_mode": only(None, _OLD + "preempted sequences are recomputed", "recompute"),
    "num_scheduler_steps": inert(1, _OLD + _TUNING),
    "use_v2_block_manager": inert(True, _OLD + "tokenmill has one block manager"),
    "scheduler_delay_factor": inert(0.0, _OLD + _TUNING),
    "multi_step_stream_outputs": inert(True, _OLD + _TUNING),
    "num_lookahead_slots": inert(0, _OLD + _TUNING),
    "disable_async_output_proc": inert(False, _OLD + _TUNING),
    # ---- kernels, graphs, compilation -------------------------------------------------------
    "enforce_eager": ours(False),
    "compilation_config": inert(None, "tokenmill does not use torch.compile; CUDA graphs follow enforce_eager"),
    "cudagraph_capture_sizes": inert(None, "decode graphs are captured for tokenmill's own batch buckets"),
    "max_cudagraph_capture_size": inert(None, "decode graphs cover max_num_seqs"),
    "max_seq_len_to_capture": inert(8192, _OLD + "decode graphs cover max_model_len"),
    "max_context_len_to_capture": inert(None, _OLD + "decode graphs cover max_model_len"),
    "attention_config": inert(None, "one attention backend per device: Triton on GPUs, plain torch on CPUs"),
    "attention_backend": inert(None, "one attention backend per device: Triton on GPUs, plain torch on CPUs"),
    "override_attention_dtype": only(None, "attention runs in the model's dtype"),
    "kernel_config": inert(None, _TUNING),
    "ir_op_priority": inert(None, _TUNING),
    "moe_backend": inert("auto", _MOE),
    "linear_backend": inert("auto", _TUNING),
    "enable_flashinfer_autotune": inert(None, _TUNING),
    "enable_bf16x3_router_gemm": inert(None, _MOE),
    "gdn_prefill_backend": inert(None, _TUNING),
    "optimization_level": inert(2, _TUNING),
    "performance_mode": inert("balanced", _TUNING),
    "additional_config": inert({}, "platform plugins' settings; tokenmill has no plugins"),
    # ---- parallelism ------------------------------------------------------------------------
    "tensor_parallel_size": ours(1),
    "pipeline_parallel_size": only(1, "tensor_parallel_size=N splits a model over the GPUs of one host"),
    "data_parallel_size": only(1, _DP),
    "data_parallel_rank": only(None, _DP),
    "data_parallel_start_rank": only(None, _DP),
    "data_parallel_size_local": only(None, _DP),
    "data_parallel_address": only(None, _DP),
    "data_parallel_rpc_port": only(None, _DP),
    "data_parallel_hybrid_lb": inert(False, _DP),
    "data_parallel_external_lb": inert(False, _DP),
    "data_parallel_multi_port_external_lb": inert(False, _DP),
    "data_parallel_backend": inert("mp", _DP),
    "disable_nccl_for_dp_synchronization": inert(None, _DP),
    "prefill_context_parallel_size": only(1, "tensor_parallel_size=N splits a model over the GPUs of one host"),
    "decode_context_parallel_size": only(1, "tensor_parallel_size=N splits a model over the GPUs of one host"),
    "dcp_comm_backend": inert("ag_rs", "a setting of decode_context_parallel_size, which must be 1"),
    "dcp_kv_cache_interleave_size": inert(1, "a setting of decode_context_parallel_size, which must be 1"),
    "cp_kv_cache_interleave_size": inert(1, "a setting of context parallelism, which must be 1"),
    "distributed_executor_backend": only(None, "tensor-parallel ranks are local worker processes ('mp')", "mp", "uni"),
    "worker_use_ray": only(False, _OLD + "tensor-parallel ranks are local worker processes"),
    "worker_cls": only("auto", "worker_extension_cls adds methods to tokenmill's Worker"),
    "worker_extension_cls": ours(""),
    "master_addr": inert("127.0.0.1", _ONE_HOST),
    "master_port": inert(29501, _ONE_HOST),
    "nnodes": only(1, "tokenmill runs on one host"),
    "node_rank": only(0, "tokenmill runs on one host"),
    "distributed_timeout_seconds": inert(None, _ONE_HOST + "; a dead rank is detected within a second"),
    "cpu_distributed_timeout_seconds": inert(None, _ONE_HOST + "; a dead rank is detected within a second"),
    "numa_bind": inert(False, _TUNING),
    "numa_bind_nodes": inert(None, _TUNING),
    "numa_bind_cpus": inert(None, _TUNING),
    "device_ids": only(None, "device='cuda:N' picks the first GPU (or set CUDA_VISIBLE_DEVICES)"),
    "device": ours("auto"),  # older vLLM's argument; tokenmill keeps it
    "disable_custom_all_reduce": inert(False, "all-reduces are torch.distributed's (NCCL or gloo)"),
    "ray_workers_use_nsight": inert(False, "tokenmill's ranks are not Ray actors"),
    "enable_expert_parallel": inert(False, _EP),
    "enable_ep_weight_filter": inert(False, _EP),
    "all2all_backend": inert("allgather_reducescatter", _EP),
    "enable_elastic_ep": inert(False, _EP),
    "eplb_config": inert(None, _EP),
    "enable_eplb": inert(False, _EP),
    "expert_placement_strategy": inert("linear", _EP),
    "enable_return_routed_experts": only(False, "outputs carry no routing data (RequestOutput.routed_experts stays None)"),
    "enable_dbo": inert(False, _TUNING),
    "ubatch_size": inert(0, _TUNING),
    "dbo_decode_token_threshold": inert(32, _TUNING),
    "dbo_prefill_token_threshold": inert(512, _TUNING),
    "_api_process_count": inert(1, _SERVING),
    "_api_process_rank": inert(0, _SERVING),
    "shutdown_timeout": inert(0, _SERVING),
    "renderer_num_workers": inert(1, _SERVING),
    "fail_on_environ_validation": inert(False, "tokenmill reads no VLLM_* settings from the environment but VLLM_TORCH_PROFILER_DIR"),
    # ---- LoRA adapters (tokenmill/lora/) ---------------------------------------------------
    "enable_lora": ours(False),
    "max_loras": ours(1),
    "max_lora_rank": ours(16),
    "max_cpu_loras": ours(),
    "lora_dtype": ours("auto"),
    "default_mm_loras": inert(None, _MM),
    "fully_sharded_loras": inert(False, "how vLLM splits its LoRA kernels' work over the ranks; tokenmill's split "
                                        "follows each layer's (tokenmill/lora/layers.py), with the same results"),
    "lora_target_modules": ours(),
    "enable_tower_connector_lora": inert(False, _LORA),
    "specialize_active_lora": inert(False, _LORA),
    "enable_mixed_moe_lora_format": inert(False, _LORA),
    "enable_moe_shared_loras": inert(False, _LORA),
    "enable_lora_bias": inert(False, _OLD + _LORA),
    "lora_extra_vocab_size": inert(256, _OLD + _LORA),
    "long_lora_scaling_factors": inert(None, _OLD + _LORA),
    # ---- features tokenmill does not have ---------------------------------------------------
    "speculative_config": only(None, "tokenmill decodes one token per step per sequence (no speculative decoding)"),
    "spec_method": only(None, "tokenmill decodes one token per step per sequence (no speculative decoding)"),
    "spec_model": only(None, "tokenmill decodes one token per step per sequence (no speculative decoding)"),
    "spec_tokens": only(None, "tokenmill decodes one token per step per sequence (no speculative decoding)"),
    "speculative_model": only(None, _OLD + "tokenmill has no speculative decoding"),
    "num_speculative_tokens": only(None, _OLD + "tokenmill has no speculative decoding"),
    "kv_transfer_config": only(None, "the KV cache stays in its engine (no disaggregated prefill)"),
    "kv_events_config": only(None, "the KV cache publishes no events"),
    "ec_transfer_config": only(None, "the KV cache stays in its engine (no disaggregated prefill)"),
    "weight_transfer_config": ours(),
    "rope_scaling": only(None, _OLD + "pass hf_overrides={'rope_scaling': {...}}"),
    "rope_theta": only(None, _OLD + "pass hf_overrides={'rope_theta': ...}"),
    "override_pooler_config": only(None, _OLD + "pass pooler_config={...}"),
    "override_neuron_config": only(None, _OLD + "tokenmill runs on NVIDIA GPUs and CPUs"),
    "guided_decoding_backend": only("auto", _OLD + "structured outputs use xgrammar", "xgrammar"),
    "enable_reasoning": only(False, _OLD + "tokenmill has no reasoning parsers"),
    "task": ours("auto"),  # older vLLM's spelling of runner/convert; tokenmill keeps it
    # ---- multimodal -------------------------------------------------------------------------
    "limit_mm_per_prompt": inert({}, _MM),
    "mm_processor_kwargs": inert(None, _MM),
    "mm_processor_cache_gb": inert(4, _MM),
    "mm_processor_cache_type": inert("lru", _MM),
    "mm_shm_cache_max_object_size_mb": inert(128, _MM),
    "mm_encoder_only": only(False, _MM),
    "mm_encoder_tp_mode": inert("weights", _MM),
    "mm_encoder_attn_backend": inert(None, _MM),
    "mm_encoder_attn_dtype": inert(None, _MM),
    "mm_encoder_fp8_scale_path": inert(None, _MM),
    "mm_encoder_fp8_scale_save_path": inert(None, _MM),
    "mm_encoder_fp8_scale_save_margin": inert(1.5, _MM),
    "mm_tensor_ipc": inert("direct_rpc", _MM),
    "mm_ipc_gpu_memory_gb": inert(0, _MM),
    "enable_mm_embeds": only(False, _MM),
    "interleave_mm_strings": inert(False, _MM),
    "media_io_kwargs": inert({}, _MM),
    "skip_mm_profiling": inert(False, _MM),
    "video_pruning_rate": inert(None, _MM),
    "language_model_only": inert(False, _MM),
    "allowed_local_media_path": inert("", _MM),
    "allowed_media_domains": inert(None, _MM),
    "disable_mm_preprocessor_cache": inert(False, _OLD + _MM),
    # ---- observability ----------------------------------------------------------------------
    "disable_log_stats": ours(True),  # LLM(...)'s default (EngineArgs: False)
    "disable_log_requests": inert(False, _OLD + "tokenmill does not log requests"),
    "aggregate_engine_logging": inert(False, "one engine: its metrics are the aggregate"),
    "show_hidden_metrics_for_version": inert(None, "tokenmill has no hidden (deprecated) metrics"),
    "otlp_traces_endpoint": only(None, "tokenmill exports no OpenTelemetry traces; LLM.get_metrics() and start_profile()"),
    "collect_detailed_traces": only(None, "tokenmill exports no OpenTelemetry traces"),
    "kv_cache_metrics": only(False, "get_metrics() has vllm:kv_cache_usage_perc and the prefix-cache counters"),
    "kv_cache_metrics_sample": inert(0.01, "a setting of kv_cache_metrics, which is refused"),
    "cudagraph_metrics": only(False, "get_metrics() has no CUDA graph metrics"),
    "enable_layerwise_nvtx_tracing": only(False, "start_profile() writes a torch.profiler trace"),
    "enable_mfu_metrics": only(False, "get_metrics() has no MFU metrics"),
    "enable_logging_iteration_details": inert(False, "tokenmill logs no per-step details"),
    "jit_monitor_mode": inert("warn", "every Triton kernel variant is compiled before the first step"),
    "jit_monitor_verbose": inert(False, "every Triton kernel variant is compiled before the first step"),
    "enable_mm_processor_stats": inert(False, _MM),
    "profiler_config": ours(),
    "tokenizer_pool_size": inert(0, _OLD + "one tokenizer in the engine's process"),
    "tokenizer_pool_type": inert("ray", _OLD + "one tokenizer in the engine's process"),
}


# EngineArgs fields of tokenmill's own, which vLLM does not have.
TOKENMILL_ONLY = ("gguf_file", "deterministic")  # deterministic: vLLM has an env var, VLLM_BATCH_INVARIANT=1


def check_value(name: str, value: Any) -> None:
    """Raise the refusal of a DEFAULT_ONLY argument set to a value tokenmill does not implement."""
    argument = VLLM_ARGUMENTS[name]
    if not argument.accepts(value):
        raise ValueError(argument.refusal(name, value))


def unimplemented_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """`dataclasses.make_dataclass` fields for the arguments that are not EngineArgs fields of our
    own (keyword-only, left out of repr), each defaulting to vLLM's default."""
    found = []
    for name, argument in VLLM_ARGUMENTS.items():
        if argument.handling is Handling.IMPLEMENTED:
            continue
        default = argument.default
        if isinstance(default, (dict, list, set)):
            spec = dataclasses.field(default_factory=lambda d=default: copy.copy(d), repr=False, kw_only=True)
        else:
            spec = dataclasses.field(default=default, repr=False, kw_only=True)
        found.append((name, Any, spec))
    return found
