"""tokenmill with deterministic=True (batch-invariant kernels), as an engine module for peer_bench.py
(which takes any module exposing LLM and SamplingParams):
``PYTHONPATH=bench python bench/peer_bench.py tokenmill_deterministic qwen3-0.6b nano``.
Its rows are tagged ``"engine": "tokenmill_deterministic"``: the protocols' settings in deterministic mode."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__

LLM = functools.partial(_LLM, deterministic=True)
__all__ = ["LLM", "SamplingParams", "__version__"]
