"""tokenmill with two micro-batches on two streams (``TOKENMILL_OVERLAP``, worker/micro_batches.py), as
an engine module for peer_bench.py: ``python bench/peer_bench.py tokenmill_overlap llama3-8b nano``.
The places come from ``TOKENMILL_OVERLAP`` if set, else both (decode graphs and mixed steps). Rows are
tagged ``"engine": "tokenmill_overlap"``; the places a run used are in its log, not in the row."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENMILL_OVERLAP", "decode,mixed")  # read when LLM() builds its worker

from tokenmill import LLM, SamplingParams, __version__  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]
