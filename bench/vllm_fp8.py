"""vLLM with quantization="fp8" (weights quantized to float8 e4m3 while loading, dynamic activation
scales), as an engine module for peer_bench.py: ``python bench/peer_bench.py vllm_fp8 llama3-8b nano``
(rows tagged ``"engine": "vllm_fp8"``), the comparison for tokenmill_fp8 (issue 18)."""

from __future__ import annotations

import functools

from vllm import LLM as _LLM
from vllm import SamplingParams, __version__

LLM = functools.partial(_LLM, quantization="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
