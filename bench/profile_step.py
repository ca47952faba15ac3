"""Where one protocol's wall time goes on the host: cProfile over the generate call.

    python bench/profile_step.py qwen3-0.6b nano > profile.txt
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from peer_bench import model_dir, workload  # noqa: E402


def main() -> None:
    shape, name = sys.argv[1], sys.argv[2]
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    prompts, outs, temperature = workload(name)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:4], params[:4], use_tqdm=False)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(inputs, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - start
    stats = llm.llm_engine.stats
    print(f"{shape} {name}: {seconds:.2f} s under cProfile, {stats.num_steps} steps so far")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
    print(out.getvalue())


if __name__ == "__main__":
    main()
