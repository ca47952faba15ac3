"""Beam search (`LLM.beam_search`, vLLM's offline API) on any engine with that API, like
refill_bench.py. Translation and summarisation jobs still run beams; vLLM drives its search from
Python, a `generate` call a step, where tokenmill keeps the beams in the engine.

    python bench/beam_bench.py ENGINE SHAPE [BEAM_WIDTH ...]
      ENGINE      tokenmill | vllm | any importable module exposing LLM (and sampling_params.BeamSearchParams)
      SHAPE       qwen3-0.6b | llama3-8b (random weights with the real shapes, peer_bench.py's folders)
      BEAM_WIDTH  4 by default; several give one row each

256 prompts of U[32, 256] token ids, 64 new tokens a beam, eos ignored, length_penalty 1. The
engine keeps its tokenizer (vLLM's beam search decodes the beams' text with it; peer_bench.py's
folder holds a stand-in). Each width prints one JSON row (prompts a second, and beam tokens a
second: prompts x width x 64 over the call's wall time) and appends it to $RESULTS when set.
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

MAX_TOKENS = 64


def beam_workload() -> list[list[int]]:
    seed(0)
    return [[randint(2, 1000) for _ in range(randint(32, 256))] for _ in range(256)]


def main() -> None:
    check_usage(__doc__, 2)
    engine, shape, widths = sys.argv[1], sys.argv[2], [int(w) for w in sys.argv[3:]] or [4]
    module = importlib.import_module(engine)
    start = time.time()
    llm = module.LLM(model=model_dir(shape, False), load_format="dummy", max_model_len=4096, gpu_memory_utilization=0.9,
                     seed=0)
    init_s = time.time() - start
    prompts = [{"prompt_token_ids": p} for p in beam_workload()]
    params = importlib.import_module(f"{engine}.sampling_params").BeamSearchParams  # vLLM's home for it
    llm.beam_search(prompts[:2], params(beam_width=2, max_tokens=4, ignore_eos=True))
    for width in widths:
        start = time.time()
        outputs = llm.beam_search(prompts, params(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True))
        seconds = time.time() - start
        beams = sum(len(o.sequences) for o in outputs)
        emit(dict(engine=engine, version=getattr(module, "__version__", "?"), shape=shape, workload=f"beam-{width}",
                  seqs=len(prompts), beams=beams, seconds=round(seconds, 2), rows_s=round(len(prompts) / seconds, 2),
                  beam_tok_s=round(len(prompts) * width * MAX_TOKENS / seconds, 1), init_s=round(init_s, 1)))


if __name__ == "__main__":
    main()
