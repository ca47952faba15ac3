"""P6's embedding call twice in one process: what a pooling engine's first big call pays that its
second does not (docs/perf.md 99 asked, for cuBLAS's first GEMM at each new row count; 100 found
BERT's call 1 ~4-8% slower on an H100, not from that, and not mainly from pinned allocations).

    python bench/embed_calls.py ENGINE SHAPE [CALLS]   ENGINE tokenmill | vllm, SHAPE as embed_bench.py's

The inputs and the engine's settings are embed_bench.py's (P6); call k embeds the same lengths
over token ids moved by (k - 1) * 10,007 (below either shape's vocabulary). Prints one JSON row a call and
appends them to $RESULTS, with the pinned host buffers each call made (torch's host allocator).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from script_usage import check_usage  # noqa: E402
from embed_bench import SHAPES, model_dir  # noqa: E402  (the protocol's own shapes and model folders)
from result_row import emit  # noqa: E402

ID_SHIFT = 10_007  # P6's ids are below 10,001; two shifts stay below BERT's 30,522-token vocabulary (30,014)


def main() -> None:
    check_usage(__doc__, 2)
    engine, shape = sys.argv[1], sys.argv[2]
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    if not 1 <= calls <= 3:
        raise SystemExit(f"CALLS: {calls} (1-3 allowed: a fourth shift would leave BERT's vocabulary)")
    _, n, longest = SHAPES[shape]
    mod = importlib.import_module(engine)
    llm = mod.LLM(model=model_dir(shape), runner="pooling", load_format="dummy", dtype="bfloat16",
                  max_model_len=512, gpu_memory_utilization=0.9, seed=0)
    seed(0)
    inputs = [[randint(2, 10000) for _ in range(randint(8, longest))] for _ in range(n)]
    tokens = sum(map(len, inputs))
    llm.embed([{"prompt_token_ids": ids} for ids in inputs[:64]], use_tqdm=False)  # embed_bench.py's warm-up
    for call in range(calls):
        batch = [{"prompt_token_ids": [t + call * ID_SHIFT for t in ids]} for ids in inputs]
        pinned = _pinned_allocations()
        start = time.time()
        outputs = llm.embed(batch, use_tqdm=False)
        seconds = time.time() - start  # before the outputs are freed, as embed_bench.py (whose `out` lives on)
        del outputs  # freeing 65,536 vectors' lists took 0.3-0.6 s on the dev CPU: timed here before
        allocs, alloc_s = (now - then for now, then in zip(_pinned_allocations(), pinned))
        emit(dict(engine=engine, shape=shape, workload="embed", call=call + 1, inputs=n, in_tokens=tokens,
                  seconds=round(seconds, 3), in_tok_s=round(tokens / seconds, 1),
                  pinned_allocs=allocs, pinned_alloc_s=round(alloc_s, 4)))


def _pinned_allocations() -> tuple[int, float]:
    """How many page-locked host buffers torch's pinned allocator has made so far, and their seconds."""
    import torch

    stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return stats.get("num_host_alloc", 0), stats.get("host_alloc_time.total", 0) / 1e6


if __name__ == "__main__":
    main()
