"""tokenmill with kv_cache_dtype="fp8", as an engine module for peer_bench.py (which takes any module
exposing LLM and SamplingParams): ``python bench/peer_bench.py tokenmill_fp8kv qwen3-0.6b nano``.
Its rows are tagged ``"engine": "tokenmill_fp8kv"``: float8 keys and values, not the protocols' bf16."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__

LLM = functools.partial(_LLM, kv_cache_dtype="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
