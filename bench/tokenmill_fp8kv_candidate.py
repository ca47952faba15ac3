"""tokenmill with kv_cache_dtype="fp8" and docs/perf.md 30's candidate decode launch over it (32-key
tiles on 1 warp with 6 stages, splits until ~16 programs an SM), as an engine module for
peer_bench.py: ``python bench/peer_bench.py tokenmill_fp8kv_candidate qwen3-0.6b nano``. The
launch rule reads these module constants when each launch (and each decode graph) is set up, in
this process and its compile threads, so setting them before ``LLM()`` is the whole change. Rows
are tagged ``"engine": "tokenmill_fp8kv_candidate"``; ``tokenmill_fp8kv`` is the launch as shipped."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__
from tokenmill.kernels.triton import paged_attention_config as _config

_config.FP8_CACHE_DECODE_TILE_N, _config.FP8_CACHE_DECODE_WARPS, _config.FP8_CACHE_DECODE_STAGES = 32, 1, 6
_config.FP8_CACHE_DECODE_PROGRAMS_PER_SM = 16

LLM = functools.partial(_LLM, kv_cache_dtype="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
