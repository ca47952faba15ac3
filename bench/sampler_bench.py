"""Micro-benchmark of the GPU sampler kernels (``kernels/triton/sampling.sample_tokens``) at the
settings users take: temperature only, top-k / top-p / min-p, penalties, all of them, on
bf16 logits of Qwen's vocabulary (151,936) at 64 / 256 / 1,024 rows.

    python bench/sampler_bench.py [--rows 64 256 1024] [--vocab 151936] [--repeats 20] [--json]
                                  [--cases NAME ...] [--rounds N ...]

Two kinds of logits: "flat", the spread of a random-weight model (normal, std 0.9 after a
temperature of 0.7: what P4 and the chat workloads sample from; top-p keeps most of the
vocabulary there), and "peaked", a real model's shape (normal, std 3, so a few dozen tokens hold
most of the mass). Penalties read per-sequence state like the engine's: 500 prompt tokens and 300
output tokens per row. Prints the median µs per call (CUDA events around one call, after warm-up:
the host's launch time shows where it exceeds the GPU's) and, per case, the GPU time alone (``gpu``:
a CUDA graph of --graph-calls calls replayed, µs per call) and the host time alone (``host``: wall
time of --graph-calls back-to-back calls without a sync, µs per call); with --json, one JSON row per
case (rows, logits, case, us, us_gpu, us_host) for bench/results.

--cases picks cases by name (also the extra ones, "top_p 0.5" and "top_p 0.95", which run only when
named); --rounds N ... runs each top-p-alone case once per number of argmax rounds (0: the exact
path alone, as before the rounds; ``sampling._ROUNDS``), its rows with a field "rounds": N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # gpu_timing, tokenmill
from gpu_timing import _time_events, _time_graph  # noqa: E402
from tokenmill.kernels.triton import sampling  # noqa: E402
from tokenmill.kernels.sampling_args import counts_width  # noqa: E402
from tokenmill.kernels.triton.sampling import Filters, RowState, sample_tokens  # noqa: E402

# case -> (top_k, top_p, min_p, repetition_penalty) at temperature 0.7
CASES = {
    "temperature": (0, 1.0, 0.0, 1.0),
    "top_k 50": (50, 1.0, 0.0, 1.0),
    "top_p 0.9": (0, 0.9, 0.0, 1.0),
    "top_k 100 + top_p 0.95": (100, 0.95, 0.0, 1.0),
    "min_p 0.05": (0, 1.0, 0.05, 1.0),
    "repetition 1.1": (0, 1.0, 0.0, 1.1),
    "top_k 50 + top_p 0.9 + repetition 1.1": (50, 0.9, 0.0, 1.1),
}
# Run only when named in --cases: top-p alone where the argmax rounds reject more (0.5) and less (0.95).
EXTRA_CASES = {
    "top_p 0.5": (0, 0.5, 0.0, 1.0),
    "top_p 0.95": (0, 0.95, 0.0, 1.0),
}


def penalty_state(rows: int, vocab: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(rows, counts_width(vocab), dtype=torch.int16, device=device)
    outputs = torch.randint(0, vocab, (rows, 300), device=device, generator=gen)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=torch.int16))
    words = -(-vocab // 32)
    dense = torch.zeros(rows, words * 32, dtype=torch.int64, device=device)
    dense.scatter_(1, torch.randint(0, vocab, (rows, 500), device=device, generator=gen), 1)
    bits = (dense.view(rows, words, 32) << torch.arange(32, device=device)).sum(-1).to(torch.int32)
    return counts, bits


def host_us(fn, calls: int, repeats: int) -> float:
    """Host time alone: wall time of ``calls`` back-to-back calls without a sync; median µs per call
    (the launch queue is far deeper than ``calls``, so the GPU never holds the host back)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--graph-calls", type=int, default=10, help="calls per CUDA graph and per host timing")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cases", nargs="+", choices=[*CASES, *EXTRA_CASES], help="cases to run (default: CASES)")
    parser.add_argument("--rounds", type=int, nargs="+", help="argmax rounds of top-p-alone rows, each in turn")
    args = parser.parse_args()
    cases = {name: {**CASES, **EXTRA_CASES}[name] for name in args.cases} if args.cases else CASES
    # (name, settings, rounds): top-p-alone cases once per --rounds value, the others once.
    runs = [(name, settings, n) for name, settings in cases.items()
            for n in (args.rounds if args.rounds and settings[1] < 1.0 and settings[0] == 0 else [None])]
    default_rounds = sampling._ROUNDS
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()} vocab={args.vocab} bf16, median µs per sample_tokens call: "
          "one call event-timed / GPU alone (CUDA graph) / host alone")
    labels = [name if n is None else f"{name} r{n}" for name, _, n in runs]
    print(f"{'rows':>5} {'logits':>7}  " + "  ".join(f"{label:>14.14}" for label in labels))
    for rows in args.rows:
        counts, bits = penalty_state(rows, args.vocab, device, gen)
        temperature = torch.full((rows,), 0.7, device=device)
        keys = torch.randint(0, 2**62, (rows,), device=device, generator=gen)
        counters = torch.arange(rows, device=device)
        slots = torch.arange(rows, dtype=torch.int32, device=device)
        no_bias = torch.full((rows,), -1, dtype=torch.int32, device=device)
        for kind, std in (("flat", 0.9 * 0.7), ("peaked", 3.0 * 0.7)):
            # logits = std * normal at T = 1 becomes the described spread after dividing by 0.7
            logits = (torch.randn(rows, args.vocab, device=device, generator=gen) * std).to(torch.bfloat16)
            line = []
            for name, (top_k, top_p, min_p, repetition), rounds in runs:
                sampling._ROUNDS = default_rounds if rounds is None else rounds
                filters = None
                if top_k or top_p < 1.0 or min_p:
                    filters = Filters(torch.full((rows,), top_k, device=device), torch.full((rows,), top_p, device=device),
                                      torch.full((rows,), min_p, device=device))
                state = None
                if repetition != 1.0:
                    factor = torch.full((counts.shape[0],), repetition, device=device)  # per penalty slot
                    zeros = torch.zeros(counts.shape[0], device=device)
                    state = RowState(no_bias, torch.zeros(1, args.vocab, device=device), slots, counts, bits, factor,
                                     zeros, zeros)
                alone = top_p < 1.0 and top_k == 0  # what the runner tells the sampler (SamplingBatch.top_p_alone)
                call = lambda: sample_tokens(logits, temperature, keys, counters, filters, state,  # noqa: E731
                                             top_p_alone=alone)
                us, _ = _time_events(call, calls=1, repeats=args.repeats)
                us_gpu, _ = _time_graph(call, args.graph_calls, args.repeats)
                us_host = host_us(call, args.graph_calls, args.repeats)
                line.append(f"{us:.0f}/{us_gpu:.0f}/{us_host:.0f}")
                if args.json:
                    print(json.dumps({"rows": rows, "vocab": args.vocab, "logits": kind, "case": name, "us": round(us, 1),
                                      "us_gpu": round(us_gpu, 1), "us_host": round(us_host, 1),
                                      **({} if rounds is None else {"rounds": rounds})}))
            print(f"{rows:>5} {kind:>7}  " + "  ".join(f"{cell:>14}" for cell in line))


if __name__ == "__main__":
    main()
