"""tokenmill with quantization="fp8" (weights quantized to float8 e4m3 per channel while loading,
activations per token, fp8 tensor cores), as an engine module for peer_bench.py:
``PYTHONPATH=bench python bench/peer_bench.py tokenmill_fp8 llama3-8b nano`` (P3 on fp8 weights).
Its rows are tagged ``"engine": "tokenmill_fp8"``: not the protocols' bf16."""

from __future__ import annotations

import functools

from tokenmill import LLM as _LLM
from tokenmill import SamplingParams, __version__

LLM = functools.partial(_LLM, quantization="fp8")
__all__ = ["LLM", "SamplingParams", "__version__"]
