"""tokenmill with a mixed step's decodes and prompt chunks as two micro-batches on disjoint SM
partitions (``TOKENMILL_OVERLAP=mixed`` with ``TOKENMILL_DECODE_SMS``, default 40 here;
worker/micro_batches.py, worker/sm_partition.py; docs/perf.md 113), as an engine module for
peer_bench.py: ``python bench/peer_bench.py tokenmill_partition qwen3-0.6b prefill``.
``TOKENMILL_MAX_BATCHED`` sets ``max_num_batched_tokens`` (a smaller budget spreads the prompts over
more steps, so more of the decodes have prompt work beside them). Rows are tagged ``"engine":
"tokenmill_partition"``; the settings a run used are in its log (gpu_suite.sh part p5-partition)."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TOKENMILL_OVERLAP", "mixed")  # read when LLM() builds its worker
os.environ.setdefault("TOKENMILL_DECODE_SMS", "40")

import tokenmill  # noqa: E402
from tokenmill import SamplingParams, __version__  # noqa: E402

LLM = functools.partial(tokenmill.LLM, max_num_batched_tokens=int(os.environ["TOKENMILL_MAX_BATCHED"])) \
    if os.environ.get("TOKENMILL_MAX_BATCHED") else tokenmill.LLM
__all__ = ["LLM", "SamplingParams", "__version__"]
