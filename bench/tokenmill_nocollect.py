"""tokenmill without the full garbage collection that ends ``LLM()`` (docs/perf.md 49), as an engine
module for peer_bench.py: ``python bench/peer_bench.py tokenmill_nocollect qwen3-0.6b nano``. Rows
are tagged ``"engine": "tokenmill_nocollect"``; nothing else changes, so an A/B against ``tokenmill``
in one call measures the collection's effect end to end."""

from __future__ import annotations

import types

from tokenmill import LLM, SamplingParams, __version__, llm

# LLM.__init__ calls gc.collect() through its module's ``gc``: a stand-in that does nothing.
llm.gc = types.SimpleNamespace(collect=lambda *args: 0)  # type: ignore[assignment]
__all__ = ["LLM", "SamplingParams", "__version__"]
