"""tokenmill with every full-precision GEMM on cuBLAS (the 16-bit decode GEMM of docs/perf.md 47 off),
as an engine module for peer_bench.py: ``python bench/peer_bench.py tokenmill_cublas_decode qwen3-0.6b
nano``. Rows are tagged ``"engine": "tokenmill_cublas_decode"``; nothing else changes, so an A/B
against ``tokenmill`` in one call measures the decode GEMM end to end."""

from __future__ import annotations

from tokenmill import LLM, SamplingParams, __version__
from tokenmill.models.layers import linear

# Without the split-K counters a layer never takes the decode GEMM (UnquantizedLinearMethod.apply).
linear.UnquantizedLinearMethod.process_weights_after_loading = lambda self, layer: None  # type: ignore[method-assign]
__all__ = ["LLM", "SamplingParams", "__version__"]
