"""Jobs with many more requests than the engine runs at once, on any engine with vLLM's offline API
(like peer_bench.py). P1-P5 submit at most 1,024 requests, which the engine admits in its first steps
(max_num_seqs is 1,024 on large GPUs), so they never reach the steady state of a real batch job:
every step some requests finish and new prompts are admitted beside the running decodes.

    python bench/refill_bench.py ENGINE SHAPE [WORKLOAD ...]
      ENGINE    tokenmill | vllm | any importable module exposing LLM and SamplingParams
      SHAPE     qwen3-0.6b | llama3-8b (random weights with the real shapes, peer_bench.py's folders)
      WORKLOAD  short | long | score (default: short and long)

short: 8,192 prompts of U[32, 128] token ids, 16 tokens out (classification, extraction).
long:  4,096 prompts of U[100, 1024] token ids, U[32, 512] out (a generation job four times P1's size).
score: 8,192 prompts of U[64, 512] token ids, prompt_logprobs=1 and 1 greedy token out: the request
       lm-eval's loglikelihood tasks make of vLLM (a prompt's tokens scored, nothing generated).
Temperature 0.7 (score: 0), eos ignored, prompts as token ids (no tokenizer: the engine, not
tokenization). Each prints one JSON row (output tokens / wall seconds of the generate call, rows and
prompt tokens per second) and appends it to $RESULTS when set.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from random import randint, seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_usage import check_usage  # noqa: E402
from peer_bench import model_dir  # noqa: E402
from result_row import emit  # noqa: E402

WORKLOADS = ("short", "long")  # the default; "score" when named


def refill_workload(name: str) -> tuple[list[list[int]], list[int], dict]:
    """prompts (token-id lists), per-prompt output lengths, sampling settings shared by all."""
    seed(0)
    if name == "short":
        prompts = [[randint(0, 10000) for _ in range(randint(32, 128))] for _ in range(8192)]
        return prompts, [16] * len(prompts), dict(temperature=0.7)
    if name == "long":
        prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(4096)]
        return prompts, [randint(32, 512) for _ in prompts], dict(temperature=0.7)
    if name == "score":
        prompts = [[randint(0, 10000) for _ in range(randint(64, 512))] for _ in range(8192)]
        return prompts, [1] * len(prompts), dict(temperature=0.0, prompt_logprobs=1)
    raise SystemExit(f"refill_bench: unknown workload {name!r} (known: short, long, score)")


def main() -> None:
    check_usage(__doc__, 2)
    engine, shape, names = sys.argv[1], sys.argv[2], sys.argv[3:] or list(WORKLOADS)
    module = importlib.import_module(engine)
    start = time.time()
    llm = module.LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True,
                     max_model_len=4096, gpu_memory_utilization=0.9, seed=0)
    init_s = time.time() - start
    params = module.SamplingParams
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}] * 4, params(max_tokens=8, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    for name in names:
        prompts, outs, settings = refill_workload(name)
        sampling = [params(ignore_eos=True, max_tokens=o, detokenize=False, **settings) for o in outs]
        start = time.time()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        seconds = time.time() - start
        got = sum(len(r.outputs[0].token_ids) for r in results)
        scored = sum(len(r.prompt_logprobs or ()) for r in results)  # positions (the first is None)
        emit(dict(engine=engine, version=getattr(module, "__version__", "?"), shape=shape, workload=f"refill-{name}",
                  seqs=len(prompts), in_tokens=sum(map(len, prompts)), out_tokens=sum(outs), got_tokens=got,
                  scored_positions=scored, seconds=round(seconds, 2), out_tok_s=round(sum(outs) / seconds, 1),
                  in_tok_s=round(sum(map(len, prompts)) / seconds, 1), rows_s=round(len(prompts) / seconds, 1),
                  init_s=round(init_s, 1)))


if __name__ == "__main__":
    main()
