"""Where one protocol's time goes: on the host (cProfile over the generate call) or on the GPU
(torch.profiler over a window of engine steps, kernels ranked by device time).

    python bench/profile_step.py qwen3-0.6b nano > profile.txt           # host
    python bench/profile_step.py qwen3-0.6b nano --gpu > profile_gpu.txt  # device, steps 0-39 and 300-339
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
    on_gpu = "--gpu" in sys.argv[3:]
    from tokenmill import LLM, SamplingParams

    llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0)
    prompts, outs, temperature = workload(name)
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:4], params[:4], use_tqdm=False)
    if on_gpu:
        profile_device(llm, inputs, params)
        return
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


def profile_device(llm, inputs, params) -> None:
    """Two windows of engine steps: the first 40 (prefill-heavy) and 300-339 (decode)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    windows = {"steps 0-39 (prefill and decode)": range(0, 40), "steps 300-339 (decode)": range(300, 340)}
    step = engine.step
    state = {"n": 0, "prof": None, "t0": 0.0}
    reports = []

    def traced_step(*args, **kwargs):
        n = state["n"]
        for title, window in windows.items():
            if n == window.start:
                torch.cuda.synchronize()
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()
        out = step(*args, **kwargs)
        for title, window in windows.items():
            if n == window.stop - 1 and state["prof"] is not None:
                torch.cuda.synchronize()
                wall = time.perf_counter() - state["t0"]
                state["prof"].__exit__(None, None, None)
                table = state["prof"].key_averages().table(sort_by="device_time_total", row_limit=25)
                reports.append(f"== {title}: {wall * 1e3:.1f} ms wall for {len(window)} steps ==\n{table}")
                state["prof"] = None
        state["n"] = n + 1
        return out

    engine.step = traced_step
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    print(f"generate under the profiler windows: {time.perf_counter() - start:.2f} s, {state['n']} steps")
    print("\n".join(reports))


if __name__ == "__main__":
    main()
