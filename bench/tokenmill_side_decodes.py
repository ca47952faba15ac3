"""tokenmill with a mixed step's queued decodes on a side stream beside its prefill launch, a few
queue programs an SM (``TritonAttentionBackend(side_decodes=...)``; docs/perf.md 80), as an engine
module for peer_bench.py: ``python bench/peer_bench.py tokenmill_side_decodes qwen3-0.6b prefill``.
``TOKENMILL_SIDE_DECODES`` sets the programs an SM (default 2, the best of perf.md 80's kernel
rows). The rows are tagged ``"engine": "tokenmill_side_decodes"``; an A/B against ``tokenmill`` in
one call measures it end to end."""

from __future__ import annotations

import functools
import os

from tokenmill import LLM, SamplingParams, __version__
from tokenmill.attention import triton_backend

# worker.attention_backend imports the class from its module when it builds a backend: every
# LLM() of this process (and only this process: no tensor-parallel workers) gets the side stream.
triton_backend.TritonAttentionBackend = functools.partial(  # type: ignore[misc]
    triton_backend.TritonAttentionBackend, side_decodes=int(os.environ.get("TOKENMILL_SIDE_DECODES", "2"))
)
__all__ = ["LLM", "SamplingParams", "__version__"]
