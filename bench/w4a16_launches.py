"""A few launches of the W4A16 decode GEMM on one Llama-3-8B projection, for a profiler to attach
to (gpu_suite part ``ncu-w4a16`` runs Nsight Compute over the fourth; docs/perf.md 35):
    python bench/w4a16_launches.py gate_up 16 [split]
``split`` overrides the engine's K split (the other knobs stay the engine's choice)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tokenmill.kernels.triton.w4a16_gemm import K_TILE, choose_config, counters_needed, w4a16_gemm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def main() -> None:
    name, m = sys.argv[1], int(sys.argv[2])
    n, k = SHAPES[name]
    packed = torch.randint(-(2**31), 2**31 - 1, (16 * triton.cdiv(k, K_TILE), n), device="cuda", dtype=torch.int32)
    scales = (torch.rand(k // 128, n, device="cuda") * 0.004).to(torch.bfloat16)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    config = choose_config(m, n, k, 128, torch.cuda.get_device_properties(0).multi_processor_count)
    if len(sys.argv) > 3:
        config["split_k"] = int(sys.argv[3])
    print(f"{name} M={m} config {config}", flush=True)
    for _ in range(5):
        w4a16_gemm(x, packed, scales, None, 128, None, counters, dict(config))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
