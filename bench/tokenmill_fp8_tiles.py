"""tokenmill with quantization="fp8" whose swapped fp8 GEMM past 64 tokens follows a rule of
bench/fp8_tile_sweep.py's family instead of the engine's own, as an engine module for peer_bench.py:
``TOKENMILL_FP8_TILES='{"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4, "fill": 1,
"qualify": 1}' python bench/peer_bench.py tokenmill_fp8_tiles llama3-8b nano``. Up to 64 tokens
nothing changes. The rows are tagged ``"engine": "tokenmill_fp8_tiles"``; an A/B against
``tokenmill_fp8`` in one call measures the rule end to end."""

from __future__ import annotations

import functools
import json
import os

from fp8_tile_sweep import rule_split, rule_takes

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__
from tokenmill.kernels.triton import fp8_gemm

_RULE = json.loads(os.environ["TOKENMILL_FP8_TILES"])
_TILE = (_RULE["BLOCK_M"], _RULE["BLOCK_N"], _RULE["num_warps"], _RULE["num_stages"])
_engine_choice = fp8_gemm.choose_swapped_config
_engine_takes = fp8_gemm.runs_swapped


def _runs_swapped(m: int, n: int, num_sms: int) -> bool:
    if m <= fp8_gemm.SWAPPED_MAX_M:
        return _engine_takes(m, n, num_sms)
    return rule_takes(_TILE, m, n, num_sms, _RULE["qualify"])


def _choose_swapped_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    if m <= fp8_gemm.SWAPPED_MAX_M:
        return _engine_choice(m, n, k, num_sms)
    return dict(BLOCK_M=_TILE[0], BLOCK_N=_TILE[1], BLOCK_K=128, num_warps=_TILE[2], num_stages=_TILE[3],
                split_k=rule_split(_TILE, m, n, k, num_sms, _RULE["fill"]))


# fp8_gemm() and the fp8 linear look both up in the module at every call: this process's engines
# (no tensor-parallel workers) take the rule.
fp8_gemm.runs_swapped = _runs_swapped
fp8_gemm.choose_swapped_config = _choose_swapped_config
LLM = functools.partial(_LLM, quantization="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
