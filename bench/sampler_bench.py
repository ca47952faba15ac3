"""Micro-benchmark of the sampler at N=256 rows, V=151,936 (Qwen's vocab): the top-k / top-p filters
(the old sort-based versions against the sort-free radix-select ones in tokenmill/worker/sampler.py),
and a whole temperature-only draw from bf16 logits (P1's case): the old torch passes against the
one-pass kernel path the Sampler takes now on a GPU.

    python bench/sampler_bench.py [--device cuda] [--rows 256] [--vocab 151936] [--repeats 5]

Prints the median ms per call. The old top-k read max k from the device (a host sync); the new one
takes it from the host, as the runner does. Logits are random normal times a per-row scale (peaked to flat rows),
top_p uniform in [0.5, 1), top_k uniform in [1, 100].
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from tokenmill.worker.sampler import Sampler, SamplingBatch, _top_k, _top_p


def sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The previous implementation: a full [N, V] sort, softmax, cumsum and scatter back."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def topk_max_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The previous implementation: topk(max k), which reads max k back to the host."""
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def torch_draw(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The previous draw: upcast, greedy argmax, temperature, softmax, exponential race, argmax."""
    logits = logits.float()
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / torch.where(temperature == 0.0, 1.0, temperature)[:, None], dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(temperature == 0.0, greedy, (probs / race).argmax(dim=-1))


def median_ms(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    scale = torch.rand(args.rows, 1, generator=gen, device=device) * 4
    logits = torch.randn(args.rows, args.vocab, generator=gen, device=device) * scale
    top_p = torch.rand(args.rows, generator=gen, device=device) * 0.5 + 0.5
    top_k = torch.randint(1, 101, (args.rows,), generator=gen, device=device)
    print(f"device={device} rows={args.rows} vocab={args.vocab} threads={torch.get_num_threads()}, median ms per call")
    cases = {
        "top_p sort (old)": lambda: sorted_top_p(logits, top_p),
        "top_p radix (new)": lambda: _top_p(logits, top_p),
        "top_k topk(max k) (old)": lambda: topk_max_top_k(logits, top_k),
        "top_k host max k (new)": lambda: _top_k(logits, top_k, 100),
    }
    bf16 = logits.to(torch.bfloat16)
    temperature = torch.full((args.rows,), 0.6, device=device)
    draw = SamplingBatch(temperature=temperature, all_greedy=False, top_k=None, max_top_k=0, top_p=None, min_p=None,
                         draw_keys=torch.arange(args.rows, device=device), draw_counters=torch.zeros(args.rows, dtype=torch.int64, device=device))
    sampler = Sampler()
    cases["draw T=0.6, torch passes (old)"] = lambda: torch_draw(bf16, temperature, gen)
    cases["draw T=0.6, Sampler (new)"] = lambda: sampler(bf16, draw).token_ids
    for name, fn in cases.items():
        print(f"{name:34s} {median_ms(fn, device, args.repeats):9.2f} ms")


if __name__ == "__main__":
    main()
