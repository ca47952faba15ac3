"""tokenmill with fp8 weights and an fp8 KV cache together (quantization="fp8", kv_cache_dtype="fp8"),
as an engine module for peer_bench.py: ``PYTHONPATH=bench python bench/peer_bench.py
tokenmill_fp8_fp8kv llama3-8b nano``. Rows tagged ``"engine": "tokenmill_fp8_fp8kv"``: what P3 gives
when both its halves (GEMMs and attention) read fp8, not the protocols' bf16."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__

LLM = functools.partial(_LLM, quantization="fp8", kv_cache_dtype="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
