"""vLLM with kv_cache_dtype="fp8" (float8 e4m3 keys and values, scale 1), as an engine module for
peer_bench.py: ``python bench/peer_bench.py vllm_fp8kv qwen3-0.6b nano`` (rows tagged
``"engine": "vllm_fp8kv"``), the comparison for tokenmill_fp8kv (docs/perf.md entry 28)."""

from __future__ import annotations

import functools

from vllm import LLM as _LLM
from vllm import SamplingParams, __version__

LLM = functools.partial(_LLM, kv_cache_dtype="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
