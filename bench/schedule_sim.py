"""The scheduler alone (no model, no GPU) over a protocol's requests at a given KV cache size: how
many steps of each kind a run takes, how many sequences decode together, how often sequences are
preempted and how many prompt tokens are computed again after it. Runs in seconds on the CPU, so a
scheduling question (what more KV cache would buy a KV-bound run, what the re-prefills cost) gets
an answer before any device time is spent; the GPU's own timeline (`profile_step.py --timeline`)
says what such a step costs.

    python bench/schedule_sim.py WORKLOAD KV_TOKENS [KV_TOKENS ...] [--max-num-seqs N] [--budget N]
        [--decode-ms N:MS,...] [--prompt-us US]

WORKLOAD: peer_bench.py's (nano, uniform, sampling, prefill) or refill_bench.py's (short, long).
KV_TOKENS: the cache's size in tokens (Qwen3-30B-A3B: 98,304 bytes a token, so 10.02 GiB is
109,441). Steps are synchronous; the sampled tokens are made up (every request runs to its
max_tokens, as the protocols' ignore_eos). Prints one JSON row per size, with ``model_s``: the
run's time by a cost model of a step, a decode step's milliseconds at N running sequences
(piecewise linear between the points of ``--decode-ms``) plus ``--prompt-us`` a prompt token. The
defaults are Qwen3-30B-A3B's on an H100 from the timeline of lease BD
(`bench/results/gpu_timeline_4a1873d_qwen3-30b-a3b_nano.txt`: a decode step 10.0 / 20.3 / 24.1 /
30.3 ms at up to 16 / 32 / 64 / 128-192 sequences, a prompt step 12.5 ms over a decode step for
~1,685 tokens; its 1- and 1,024-sequence ends are estimates, outside what the timeline saw); the model leaves the host's and the launches' share out, so compare its figures
with each other, not with a measured wall time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_bench import workload  # noqa: E402
from refill_bench import refill_workload  # noqa: E402

from tokenmill.engine.kv_cache import KVCacheManager  # noqa: E402
from tokenmill.engine.request import Request, Sequence  # noqa: E402
from tokenmill.engine.scheduler import Scheduler  # noqa: E402
from tokenmill.engine.step import SamplerOutput, StepResult  # noqa: E402
from tokenmill.sampling_params import SamplingParams  # noqa: E402

# The buckets of profile_step.py --timeline: decode steps by running sequences.
BUCKETS = (16, 32, 64, 128, 192, 256, 512, 10**9)
DECODE_MS = "1:4,16:10,32:20.3,64:24.1,128:30.3,256:30.3,1024:40"
PROMPT_US = 7.4


def decode_ms(points: list[tuple[int, float]], running: int) -> float:
    """A decode step's milliseconds at ``running`` sequences: piecewise linear between ``points``."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if running <= x1:
            return y0 + (y1 - y0) * (max(running, x0) - x0) / (x1 - x0)
    return points[-1][1]


def simulate(prompts: list[list[int]], outs: list[int], kv_tokens: int, max_num_seqs: int, budget: int,
             points: list[tuple[int, float]], prompt_us: float, block_size: int = 16) -> dict:
    seq_ids = itertools.count()
    scheduler = Scheduler(KVCacheManager(kv_tokens // block_size, block_size, True), max_num_seqs, budget,
                          new_sequence=lambda request, index: Sequence(next(seq_ids), index, request, request.prompt_token_ids))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        params = SamplingParams(max_tokens=out, ignore_eos=True)
        request = Request(f"r{i}", None, list(prompt), params)
        request.max_output_tokens = out
        request.sequences = [scheduler.new_sequence(request, 0)]
        scheduler.add(request)
    draw = random.Random(0)
    prompt_steps = prompt_tokens = 0
    model_ms = 0.0
    decode_steps: Counter[int] = Counter()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        # A decode item computes a sequence's one new token; anything else is prompt work (a
        # prompt's chunk, or the tokens of a preempted sequence computed again).
        decodes = sum(1 for item in plan.scheduled if item.num_tokens == 1 and item.seq.num_computed_tokens == item.seq.num_tokens - 1)
        prompt_work = sum(item.num_tokens for item in plan.scheduled) - decodes
        model_ms += decode_ms(points, max(decodes, 1)) + prompt_us * 1e-3 * prompt_work
        if prompt_work:
            prompt_steps += 1
            prompt_tokens += prompt_work
        else:
            decode_steps[next(b for b in BUCKETS if len(plan.scheduled) <= b)] += 1
        sampled = [item for item in plan.scheduled if item.samples]
        ids = torch.tensor([draw.randrange(10_000) for _ in sampled], dtype=torch.int64)
        result = StepResult(sampled, SamplerOutput(ids) if sampled else None)
        scheduler.update_after_launch(plan)
        scheduler.update_from_output(result)
    return {
        "kv_tokens": kv_tokens, "steps_with_prompt_tokens": prompt_steps, "prompt_tokens_computed": prompt_tokens,
        "prompt_tokens_recomputed": prompt_tokens - sum(map(len, prompts)), "preemptions": scheduler.num_preemptions,
        "decode_steps_by_running_seqs": {f"<={b}" if b < 10**9 else f">{BUCKETS[-2]}": decode_steps[b] for b in BUCKETS if decode_steps[b]},
        "decode_steps": sum(decode_steps.values()), "model_s": round(model_ms / 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload")
    parser.add_argument("kv_tokens", type=int, nargs="+")
    parser.add_argument("--max-num-seqs", type=int, default=1024)  # the engine's default on a large GPU
    parser.add_argument("--budget", type=int, default=16384)  # max_num_batched_tokens there
    parser.add_argument("--decode-ms", default=DECODE_MS, help="N:MS points of a decode step's cost")
    parser.add_argument("--prompt-us", type=float, default=PROMPT_US, help="a prompt token's cost")
    args = parser.parse_args()
    make = refill_workload if args.workload in ("short", "long", "score") else workload
    prompts, outs, _ = make(args.workload)
    points = [(int(n), float(ms)) for n, ms in (p.split(":") for p in args.decode_ms.split(","))]
    for kv_tokens in args.kv_tokens:
        row = simulate(prompts, outs, kv_tokens, args.max_num_seqs, args.budget, points, args.prompt_us)
        print(json.dumps({"workload": args.workload, **row}), flush=True)


if __name__ == "__main__":
    main()
