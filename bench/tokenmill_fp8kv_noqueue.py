"""tokenmill with kv_cache_dtype="fp8" and every decode on the default attention launch (the item queue
off; docs/perf.md 46), as an engine module for peer_bench.py: ``python bench/peer_bench.py
tokenmill_fp8kv_noqueue qwen3-0.6b nano``. Against ``tokenmill_fp8kv`` in one call it measures the
queue over an fp8 cache end to end."""

from __future__ import annotations

import functools

from tokenmill_noqueue import LLM as _LLM  # (bench/ is on the path: peer_bench.py imports engines from it)
from tokenmill_noqueue import SamplingParams, __version__

LLM = functools.partial(_LLM, kv_cache_dtype="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
