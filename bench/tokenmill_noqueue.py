"""tokenmill with every decode step on the default attention launch (the item queue off; docs/perf.md
44), as an engine module for peer_bench.py: ``python bench/peer_bench.py tokenmill_noqueue qwen3-0.6b
nano``. The rows are tagged ``"engine": "tokenmill_noqueue"``. Nothing else changes, so an A/B
against ``tokenmill`` in one call measures the queue end to end."""

from __future__ import annotations

import functools

from tokenmill import LLM, SamplingParams, __version__
from tokenmill.attention import triton_backend

# worker.attention_backend imports the class from its module when it builds a backend: every
# LLM() of this process (and only this process: no tensor-parallel workers) gets the default launch.
triton_backend.TritonAttentionBackend = functools.partial(  # type: ignore[misc]
    triton_backend.TritonAttentionBackend, decode_queue=False
)
__all__ = ["LLM", "SamplingParams", "__version__"]
