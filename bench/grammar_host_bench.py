"""Host cost of structured outputs per step: a batch of matchers on workload_bench.py's JSON schema
and SmolLM2's tokenizer (.bench_tokenizer/, as the json variant), stepped by random allowed tokens
(what a random-weight model draws under the mask), timing the engine's two parts of a step:
GrammarCache.bitmask (xgrammar's batch mask fill, on its threads, into a buffer reused as the
GPU's pinned staging is) and the token steps (each matcher's accept_token, as the scheduler's). No model, no GPU: what the
host spends per constrained row and step, by thread count.

    python bench/grammar_host_bench.py [--rows 128 512] [--threads 1 2 4 8] [--steps 30]

Runs over older trees too (PYTHONPATH=<an older tokenmill>) for before/after rows: without
--threads the engine's default thread count, and a fresh mask a step where bitmask takes no buffer.

Prints one JSON row per (rows, threads) and appends it to $RESULTS when set."""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from result_row import emit  # noqa: E402
from workload_bench import JSON_SCHEMA, bench_tokenizer  # noqa: E402

VOCAB = 151_936  # the Qwen3 shapes' vocabulary, as the json variant's model folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, nargs="+", default=[None])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from tokenmill.structured_outputs import GrammarCache, StructuredOutputsParams, matcher_threads

    tokenizer = AutoTokenizer.from_pretrained(bench_tokenizer())
    params = StructuredOutputsParams(json=JSON_SCHEMA)
    rng = np.random.default_rng(0)
    for threads in args.threads:
        cache = GrammarCache(tokenizer, VOCAB, **({} if threads is None else {"threads": threads}))
        reuses = "out" in inspect.signature(cache.bitmask).parameters
        for rows in args.rows:
            matchers = [cache.matcher(params) for _ in range(rows)]
            reused = torch.empty((rows, -(-VOCAB // 32)), dtype=torch.int32)  # as the GPU's pinned staging
            fill = accept = 0.0
            for step in range(args.steps + 5):  # 5 warm-up steps leave the opening "{" behind
                start = time.perf_counter()
                mask = cache.bitmask(matchers, out=reused) if reuses else cache.bitmask(matchers)
                filled = time.perf_counter()
                tokens = [_random_allowed(row, rng) for row in mask.numpy()]
                accepting = time.perf_counter()
                for matcher, token in zip(matchers, tokens):  # as the scheduler steps them
                    matcher.accept_token(token)
                if step >= 5:
                    fill += filled - start
                    accept += time.perf_counter() - accepting
            emit(dict(bench="grammar_host", rows=rows, threads=threads or matcher_threads(), reused_buffer=reuses,
                      cpus=len(os.sched_getaffinity(0)), steps=args.steps,
                      fill_ms=round(fill / args.steps * 1e3, 2), accept_ms=round(accept / args.steps * 1e3, 2),
                      fill_us_row=round(fill / args.steps / rows * 1e6, 1),
                      accept_us_row=round(accept / args.steps / rows * 1e6, 1)))


def _random_allowed(bitmask_row: np.ndarray, rng: np.random.Generator) -> int:
    allowed = np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little"))
    return int(allowed[rng.integers(len(allowed))])


if __name__ == "__main__":
    main()
