"""tokenmill with pure decode steps on the item-queue attention kernel (an experiment, docs/perf.md
44), as an engine module for peer_bench.py: ``TOKENMILL_DECODE_QUEUE=512,4 python bench/peer_bench.py
tokenmill_queue qwen3-0.6b nano``. The variable gives (chunk_keys, max_chunks); the rows are tagged
``"engine": "tokenmill_queue"``. Nothing else changes, so an A/B against ``tokenmill`` in one call
measures the kernel end to end."""

from __future__ import annotations

import functools
import os

from tokenmill import LLM, SamplingParams, __version__
from tokenmill.attention import triton_backend

chunk_keys, max_chunks = (int(x) for x in os.environ.get("TOKENMILL_DECODE_QUEUE", "512,4").split(","))
# worker.attention_backend imports the class from its module when it builds a backend: every
# LLM() of this process (and only this process: no tensor-parallel workers) gets the queue.
triton_backend.TritonAttentionBackend = functools.partial(  # type: ignore[misc]
    triton_backend.TritonAttentionBackend, decode_queue=(chunk_keys, max_chunks)
)
__all__ = ["LLM", "SamplingParams", "__version__"]
