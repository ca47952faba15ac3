"""tokenmill at tensor_parallel_size=2 (two GPUs, NCCL), as an engine module for peer_bench.py (which
takes any module exposing LLM and SamplingParams): ``python bench/peer_bench.py tokenmill_tp2 llama3-8b nano``.
Its rows are tagged ``"engine": "tokenmill_tp2"``."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__

LLM = functools.partial(_LLM, tensor_parallel_size=2)
__all__ = ["LLM", "SamplingParams", "__version__"]
