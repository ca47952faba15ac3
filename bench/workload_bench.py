"""The chat-style workload with the sampling settings users copy from tutorials, one setting at a
time and all together, on any engine with vLLM's offline API (like peer_bench.py).

Usage: python bench/workload_bench.py ENGINE SHAPE [VARIANT ...]
  ENGINE   tokenmill | vllm | any importable module exposing LLM and SamplingParams
  SHAPE    qwen3-0.6b | llama3-8b (random weights with the real shapes, from peer_bench.py)
  VARIANT  temperature | top_p | top_k | top_k_top_p | repetition | all | logit_bias | logprobs1 | logprobs2
           (default: every one, in that order)

Workload ("chat"): 1,024 requests sharing a 256-token system prefix, each with its own U[16, 256]
tokens, output U[32, 512] tokens, eos ignored, temperature 0.7 (random.seed(0)). The variants add
top_p 0.9, top_k 50, top_k 100 with top_p 0.95 (issue 15's filter target), repetition_penalty 1.1,
top_p 0.9, top_k 50 and repetition_penalty 1.1 together, a logit bias on ten ids, or logprobs 1 / 2. One LLM serves every variant (after a
warm-up call), its prefix cache emptied before each: every variant's prompts are prefilled, as the
first's are (without the reset a later variant found every prompt of an earlier one cached and
looked faster by that prefill, docs/perf.md 53); the last variant's results are dropped and the
heap collected outside the timing, so every variant starts from the same heap (a full collection
inside a timed call stops the host for tens of ms, docs/perf.md 49). A variant may be named twice
(the first and last run of one setting show any drift in the lease). Each prints one JSON row (output tokens /
wall seconds of the generate call) and appends it to $RESULTS when set.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import model_dir  # noqa: E402
from result_row import emit  # noqa: E402

VARIANTS = {
    "temperature": {},
    "top_p": dict(top_p=0.9),
    "top_k": dict(top_k=50),
    "top_k_top_p": dict(top_k=100, top_p=0.95),
    "repetition": dict(repetition_penalty=1.1),
    "all": dict(top_p=0.9, top_k=50, repetition_penalty=1.1),
    # A logit bias on a few ids (every request its own): the per-sequence bias rows' fill (perf.md 50).
    "logit_bias": dict(logit_bias={token: -2.0 for token in range(3, 13)}),
    # The sampled token's logprob and the top-1 (RL rollouts, evaluations), and the top-2: tokenmill
    # makes the first from two passes over the logits (perf.md 60), the second too, with a topk of the
    # logits, since perf.md 61 (before it, from the whole table: run it at 6f08266 for that).
    "logprobs1": dict(logprobs=1),
    "logprobs2": dict(logprobs=2),
}


def chat_workload() -> tuple[list[list[int]], list[int]]:
    seed(0)
    system = [randint(0, 10000) for _ in range(256)]
    prompts = [system + [randint(0, 10000) for _ in range(randint(16, 256))] for _ in range(1024)]
    return prompts, [randint(32, 512) for _ in prompts]


def chat_settings(variant: str) -> dict:
    """SamplingParams keywords of a variant: the workload's temperature 0.7 with the variant's settings."""
    return dict(temperature=0.7, **VARIANTS[variant])


def _alloc_retries() -> int | None:
    """This process's CUDA allocator retries so far (None without CUDA in this process: the CPU, or
    an engine whose GPU work runs in another process)."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def main() -> None:
    engine, shape = sys.argv[1], sys.argv[2]
    names = sys.argv[3:] or list(VARIANTS)
    mod = importlib.import_module(engine)
    LLM, SamplingParams = mod.LLM, mod.SamplingParams
    start = time.time()
    llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
              gpu_memory_utilization=0.9, seed=0)
    init_s = time.time() - start
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    prompts, outs = chat_workload()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    for name in names:
        results = None  # the last variant's outputs, before this one allocates its own
        gc.collect()
        params = [SamplingParams(**chat_settings(name), ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
        if not llm.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: a variant would reuse the last one's prompts")
        full_collections, retries = gc.get_stats()[2]["collections"], _alloc_retries()
        start = time.time()
        results = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.time() - start
        # Two host stalls a variant could meet and another not (docs/perf.md 54): full garbage
        # collections, and CUDA allocations that had to free the cache and retry (a device sync).
        full_collections = gc.get_stats()[2]["collections"] - full_collections
        retries = None if retries is None else _alloc_retries() - retries
        got = sum(len(r.outputs[0].token_ids) for r in results)
        row = dict(engine=engine, version=getattr(mod, "__version__", "?"), shape=shape, workload=f"chat-{name}",
                   seqs=len(prompts), in_tokens=sum(map(len, prompts)), out_tokens=sum(outs), got_tokens=got,
                   seconds=round(seconds, 2), out_tok_s=round(sum(outs) / seconds, 1), init_s=round(init_s, 1),
                   full_collections=full_collections, alloc_retries=retries)
        emit(row)


if __name__ == "__main__":
    main()
