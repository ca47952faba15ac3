"""What the GPU kernel tests (tests/gpu/test_*_gpu.py) share: the head layouts, the scheduler steps
they run (decode of 64-1024 sequences, mixed, long prefill, few long decodes, a P5 step), the
tolerances against the plain-torch twins, and the dry-run switch.

``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs those tests on the CPU interpreter with tiny
lengths and fp16 for bf16, to check the test files themselves without a GPU (graph/sync tests skip).
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch

DRYRUN = os.environ.get("TOKENMILL_KERNEL_DRYRUN") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"

HEADS = {  # name: (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "llama3-8b": (32, 8, 128),
    "mha-d64": (8, 8, 64),
    "g8-d64": (32, 4, 64),
    "g4-d256": (16, 4, 256),
    "g3-d128": (12, 4, 128),
    "g2-d32": (8, 4, 32),
}


def _dtype(name: str) -> torch.dtype:
    if DRYRUN and name == "bfloat16":
        return torch.float16  # the interpreter's bf16 is not trustworthy
    return getattr(torch, name)


def _len(n: int) -> int:
    """A context/query length, shrunk ~50x in a dry run."""
    return max(1, n // 50) if DRYRUN else n


def _count(n: int) -> int:
    return min(n, 3) if DRYRUN else n


def _attn_tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 P and V in the second dot (8-bit mantissa) and a bf16 output: ~1e-2 against fp32 math.
    return {
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.float32: {"atol": 2e-4, "rtol": 2e-4},
    }[dtype]


def _ulp_tol(dtype: torch.dtype) -> dict[str, float]:
    # Elementwise kernels round like their twins; allow two ulps for fp32 rounding-order flips.
    return {
        torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
        torch.float16: {"atol": 1e-3, "rtol": 2e-3},
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    }[dtype]


def _scenario(name: str, seed: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of one step."""
    rng = random.Random(seed)
    q: list[int] = []
    s: list[int] = []

    def add(query_len: int, seq_len: int) -> None:
        q.append(min(query_len, seq_len))
        s.append(seq_len)

    if name == "decode64":
        for _ in range(_count(64)):
            add(1, rng.randint(1, _len(4096)))
    elif name == "decode256":  # P1-like
        for _ in range(_count(256)):
            add(1, rng.randint(_len(100), _len(2048)))
    elif name == "decode1024":  # P2-like width: the sequence search loops over 4 chunks of 256
        for _ in range(_count(1024) if not DRYRUN else 300):
            add(1, rng.randint(1, _len(800)))
    elif name == "mixed":  # what a token-budget scheduler hands over mid-run
        for _ in range(_count(32)):
            add(1, rng.randint(1, _len(3000)))
        for _ in range(_count(4)):  # fresh prompts
            n = rng.randint(1, _len(700))
            add(n, n)
        for _ in range(_count(4)):  # prefix-cache hits: only the tail is new
            ctx = rng.randint(_len(200), _len(3000))
            add(rng.randint(1, _len(300)), ctx)
        for _ in range(_count(2)):  # a later chunk of a long prompt
            add(_len(256), rng.randint(_len(512), _len(2048)))
        add(0, rng.randint(1, _len(500)))  # scheduled nothing this step
    elif name == "prefill_long":
        add(_len(2048), _len(2048))
        add(_len(1024), _len(4096))
        add(1, _len(5000))
    elif name == "p5_mixed":  # a P5 step: running decodes first, then chunks under a 16,384-token budget
        for _ in range(_count(256)):
            add(1, rng.randint(_len(1000), _len(3000)))
        done = rng.randint(_len(100), _len(2000))  # a prompt cut by the previous step continues
        rest = rng.randint(1, _len(1000))
        add(rest, done + rest)
        left = _len(16384) - _count(256) - rest
        while left > 0:  # fresh prompts, the last one cut
            n = min(left, rng.randint(_len(1000), _len(3000)))
            add(n, n)
            left -= n
    elif name == "few_long_decode":  # split-KV territory: few programs, long contexts
        for _ in range(_count(4)):
            add(1, rng.randint(_len(16384), _len(32768)))
    else:
        raise ValueError(name)
    return q, s


def _batch(scenario: str, heads: str, block_size: int, dtype: torch.dtype, seed: int = 0, **kw: Any) -> Any:
    from support.kernel_cases import make_paged_batch

    num_heads, num_kv_heads, head_dim = HEADS[heads]
    query_lens, seq_lens = _scenario(scenario, seed)
    return make_paged_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=DEVICE, seed=seed, **kw,
    )
