"""vLLM at tensor_parallel_size=2, as an engine module for peer_bench.py:
``python bench/peer_bench.py vllm_tp2 llama3-8b nano`` (rows tagged ``"engine": "vllm_tp2"``).
gpu_suite.sh's vllm-tp2 part runs it with NVLink multicast off (NCCL_NVLS_ENABLE=0,
VLLM_ALLREDUCE_USE_SYMM_MEM=0)."""

from __future__ import annotations

import functools

from vllm import LLM as _LLM
from vllm import SamplingParams, __version__

LLM = functools.partial(_LLM, tensor_parallel_size=2)
__all__ = ["LLM", "SamplingParams", "__version__"]
