"""Where one protocol's time goes: on the host (cProfile over the generate call) or on the GPU
(torch.profiler over a window of engine steps, kernels ranked by device time).

    python bench/profile_step.py qwen3-0.6b nano > profile.txt           # host
    python bench/profile_step.py qwen3-0.6b nano --gpu > profile_gpu.txt  # device, steps 0-39, 300-339, 900-939
    python bench/profile_step.py qwen3-0.6b nano --timeline                # wall time by batch size
    python bench/profile_step.py llama3-8b nano --timeline --fp8-cache     # ... with kv_cache_dtype="fp8"
    python bench/profile_step.py llama3-8b nano --gpu --fp8-weights        # ... with quantization="fp8"
    python bench/profile_step.py qwen3-0.6b chat:repetition --timeline     # workload_bench.py's chat workload, one variant
    python bench/profile_step.py qwen3-0.6b refill:short --timeline        # refill_bench.py's workloads (prompts admitted every step)
    python bench/profile_step.py qwen3-30b-a3b nano --timeline --max-num-seqs=256  # moe_peer_bench.py's shapes; the engine's cap
    python bench/profile_step.py qwen3-0.6b nano --timeline --calls=2      # the same requests twice, token ids moved
                                                                           # (no prefix hits): what the first call pays
    ... --calls=2 --prime=graphs   # every CUDA graph launched once after start-up
    ... --calls=2 --prime=gpu      # the GPU kept busy for 1 s right before call 1
The engine's INFO lines (its GPU memory plan among them) go to stderr.
"""

from __future__ import annotations

import cProfile
import datetime
import io
import logging
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from script_usage import check_usage  # noqa: E402
from moe_peer_bench import peer_bench  # noqa: E402  (peer_bench's table with the mixture-of-experts shapes added)
from refill_bench import refill_workload  # noqa: E402
from workload_bench import chat_settings, chat_workload  # noqa: E402


model_dir, workload = peer_bench.model_dir, peer_bench.workload


def flag_values(name: str) -> list[str]:
    """The values given as ``NAME=value`` after the shape and workload, in order."""
    return [a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith(name + "=")]


def main() -> None:
    check_usage(__doc__, 2)
    shape, name = sys.argv[1], sys.argv[2]
    on_gpu = "--gpu" in sys.argv[3:]
    from tokenmill import LLM, SamplingParams

    kv_cache_dtype = "fp8" if "--fp8-cache" in sys.argv[3:] else "auto"
    quantization = "fp8" if "--fp8-weights" in sys.argv[3:] else None
    seqs = [int(v) for v in flag_values("--max-num-seqs")]
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    llm = LLM(model=model_dir(shape, False), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization, max_num_seqs=seqs[0] if seqs else None)
    prime = flag_values("--prime")
    if "graphs" in prime:
        replay_every_graph(llm)
    if name.startswith("chat:"):  # the chat workload at temperature 0.7 with a workload_bench.py variant's settings
        (prompts, outs), settings = chat_workload(), chat_settings(name.split(":", 1)[1])
    elif name.startswith("refill:"):
        prompts, outs, settings = refill_workload(name.split(":", 1)[1])
    else:
        prompts, outs, settings = workload(name)
    params = [SamplingParams(**settings, ignore_eos=True, max_tokens=o, detokenize=False) for o in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # The warm-up over ids no call uses (moved_ids' last shift), so that no call finds its first
    # prompts in the prefix cache; the protocols' own warm-up shares nothing with them either.
    llm.generate([{"prompt_token_ids": moved_ids(p, WARM_UP_CALL)} for p in prompts[:4]], params[:4], use_tqdm=False)
    if on_gpu:
        profile_device(llm, inputs, params)
        return
    if "--timeline" in sys.argv[3:]:
        calls = [int(v) for v in flag_values("--calls")]
        if "gpu" in prime:
            keep_gpu_busy(1.0)
        for call in range(calls[0] if calls else 1):
            if call:
                # The same lengths and settings over other token ids, so that nothing of the last
                # call's prompts is found in the prefix cache (reset as well).
                if not llm.reset_prefix_cache():
                    raise RuntimeError("the prefix cache could not be reset")
                print(f"-- call {call + 1}, token ids moved by {call * ID_SHIFT} --")
            timeline(llm, [{"prompt_token_ids": moved_ids(p, call)} for p in prompts] if call else inputs, params)
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


# The protocols' token ids are below 10,001 and every shape's vocabulary at least 128,256: ids moved by
# this much, up to 11 times (the last ending at 120,084), stay inside it and meet none of the earlier
# calls' ids (12 shifts ran Llama-3-8B's warm-up past its vocabulary).
ID_SHIFT = 10_007
WARM_UP_CALL = 11


def moved_ids(ids: list[int], call: int) -> list[int]:
    """A prompt's token ids for repeat ``call`` (1, 2, ...) of the same requests: shifted past all the
    earlier calls' ids."""
    if not 0 < call <= WARM_UP_CALL or max(ids) >= ID_SHIFT:  # the last shift is the warm-up's
        raise ValueError(f"moved_ids: call {call} (1-{WARM_UP_CALL} allowed) of ids up to {max(ids)} (below {ID_SHIFT} allowed)")
    return [t + call * ID_SHIFT for t in ids]


def replay_every_graph(llm) -> None:
    """Launch every captured CUDA graph once (each decode bucket's, each prompt bucket's pieces), right
    after start-up while their static inputs still hold the captures' own (slot -1: nothing stored, no
    context: attention skips). Separates a graph's first launch, when the driver uploads it, from the
    calls (`--prime=graphs`, gpu_suite first-call)."""
    import torch

    runner = llm.llm_engine.executor.runner
    start = time.perf_counter()
    graphs = [graph for graph, _ in runner.graphs.graphs.values()] if runner.graphs is not None else []
    if runner.prompt_graphs is not None:
        graphs += [piece for bucket in runner.prompt_graphs.graphs.values() for piece in bucket.pieces]
    for graph in graphs:
        graph.replay()
    if graphs:
        torch.cuda.synchronize()
    print(f"replayed {len(graphs)} CUDA graphs once in {time.perf_counter() - start:.3f} s")


def keep_gpu_busy(seconds: float) -> None:
    """bf16 matrix products for about ``seconds`` (`--prime=gpu`), right before the first call: a GPU
    still coming up from the start-up's idle would then be at speed when the call begins."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
    print(f"kept the GPU busy for {time.perf_counter() - start:.2f} s")


def profile_device(llm, inputs, params) -> None:
    """Windows of engine steps: the first 40 (prefill-heavy), 300-339 (decode) and, where a run has
    that many steps, 900-939 (P1's and P3's thin tail, ~20-40 sequences: entry 29 of docs/perf.md
    found those steps at about half their KV-read floor)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = llm.llm_engine
    windows = {"steps 0-39 (prefill and decode)": range(0, 40), "steps 300-339 (decode)": range(300, 340),
               "steps 900-939 (thin tail)": range(900, 940)}
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
                averages = state["prof"].key_averages()
                table = averages.table(sort_by="device_time_total", row_limit=25)
                host = averages.table(sort_by="self_cpu_time_total", row_limit=25)
                reports.append(f"== {title}: {wall * 1e3:.1f} ms wall for {len(window)} steps ==\n{table}\n"
                               f"-- the same steps by host time (self) --\n{host}")
                state["prof"] = None
        state["n"] = n + 1
        return out

    engine.step = traced_step
    start = time.perf_counter()
    llm.generate(inputs, params, use_tqdm=False)
    print(f"generate under the profiler windows: {time.perf_counter() - start:.2f} s, {state['n']} steps")
    print("\n".join(reports))


def allocator_counts() -> dict[str, float]:
    """What torch's CUDA caching allocator and its pinned host allocator have done so far (empty off
    CUDA): a call that must cudaMalloc (or, short of memory, free every cached block, a device-wide
    sync, and retry) or cudaHostAlloc pays it inside its launches."""
    import torch

    if not torch.cuda.is_available():
        return {}
    device, host = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
    counts = {k: device.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
    counts["reserved_GiB"] = device.get("reserved_bytes.all.current", 0) / 2**30
    counts.update({k: host.get(k, 0) for k in ("num_host_alloc", "num_host_free")})
    counts["host_alloc_s"] = host.get("host_alloc_time.total", 0) / 1e6
    return counts


def timeline(llm, inputs, params) -> None:
    """Wall time of the run split by the step each engine.step call launched: steps with prompt
    tokens (eager forwards, or the prompt graphs' pieces) apart, decode-only steps by how many sequences they carried (the thin
    tail of a batch is where per-step costs that do not shrink with it dominate). Each line also
    gives the time the host spent blocked on the GPU (``StepResult.wait``: near zero means the host
    is the bottleneck there, near the step time means the GPU is) and inside the runner's launch
    (``ModelRunner.execute``: batch building, and the forward's launches; on a GPU-bound step also
    the host blocked on a full launch queue). The run's preemptions come with the total."""
    from tokenmill.engine.step import StepResult

    engine = llm.llm_engine
    runner = engine.executor.runner
    step, execute, wait = engine.step, runner.execute, StepResult.wait
    bins = [(0, 0), (1, 16), (17, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 512), (513, 10**9)]
    rows = {b: dict(steps=0, seconds=0.0, waited=0.0, launching=0.0) for b in bins}
    mixed = dict(steps=0, seconds=0.0, waited=0.0, launching=0.0, tokens=0, seqs=0)
    current = dict(waited=0.0, launching=0.0, plan=None)

    def timed_wait(self):
        start = time.perf_counter()
        wait(self)
        current["waited"] += time.perf_counter() - start

    def timed_execute(plan):
        start = time.perf_counter()
        out = execute(plan)
        current["launching"] += time.perf_counter() - start
        current["plan"] = plan
        return out

    def timed_step(*args, **kwargs):
        current.update(waited=0.0, launching=0.0, plan=None)
        start = time.perf_counter()
        out = step(*args, **kwargs)
        took = time.perf_counter() - start
        plan = current["plan"]
        if plan is None:
            return out
        prompt_tokens = any(s.num_tokens > 1 or not s.samples for s in plan.scheduled)
        row = mixed if prompt_tokens else rows[next(b for b in bins if b[0] <= len(plan.scheduled) <= b[1])]
        row["steps"] += 1
        row["seconds"] += took
        row["waited"] += current["waited"]
        row["launching"] += current["launching"]
        if prompt_tokens:
            mixed["tokens"] += plan.num_batched_tokens
            mixed["seqs"] += len(plan.scheduled)
        return out

    engine.step, runner.execute, StepResult.wait = timed_step, timed_execute, timed_wait
    preempted_before = engine.scheduler.num_preemptions
    allocations_before = allocator_counts()
    try:
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        total = time.perf_counter() - start
    finally:
        engine.step, runner.execute, StepResult.wait = step, execute, wait
    # Preempted sequences are computed again from their tokens: prompt steps beyond the prompts' own.
    # The local wall-clock start, written as nvidia-smi writes its timestamps, to line the call up with
    # a log kept beside it (gpu_suite first-call's GPU clocks).
    began = datetime.datetime.now() - datetime.timedelta(seconds=total)
    print(f"generate: {total:.2f} s; {engine.scheduler.num_preemptions - preempted_before} preemptions; "
          f"started {began.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}")
    if allocations_before:
        after = allocator_counts()
        print("allocators in this call: " + ", ".join(f"{k} {after[k] - v:g}" for k, v in allocations_before.items()))

    def line(title: str, row: dict) -> str:
        n = row["steps"]
        return (f"{title}: {n} steps, {row['seconds']:.2f} s, {row['seconds'] / n * 1e3:.2f} ms a step, "
                f"{row['waited'] / n * 1e3:.2f} ms of it waiting for the GPU, {row['launching'] / n * 1e3:.2f} ms launching")

    if mixed["steps"]:
        print(line("steps with prompt tokens", mixed) +
              f"; {mixed['tokens'] / mixed['steps']:.0f} tokens and {mixed['seqs'] / mixed['steps']:.0f} sequences a step")
    for (lo, hi), row in rows.items():
        if row["steps"]:
            print(line(f"decode steps with {lo}-{hi} running sequences", row))


if __name__ == "__main__":
    main()
