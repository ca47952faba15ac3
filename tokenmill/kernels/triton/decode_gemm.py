"""16-bit decode GEMMs on the swapped, split-K kernel: ``y = x W^T (+ b)`` for few tokens (twin: ``F.linear``).

A decode step's GEMMs are small: Qwen3-0.6B's four projections hold 4-12 MB each, 1-3 µs of HBM
at 4.3 TB/s, yet cuBLAS took 4.4-7.7 µs each inside the decode graphs (docs/perf.md 13, 47): its
tiles walk all of K one after the other and leave most SMs idle on narrow weights. The fp8 path's
swapped kernel (``fp8_gemm._fp8_swapped_kernel``, entry 37) computes ``y^T = W x^T`` with 128
weight rows the MMA's long side and the tokens its N, K split over several programs a tile so that
the launch fills the SMs, and the last program of a tile summing the partials in split order
(``split_k.store_tile``). Here it runs on bf16/fp16 operands without scales, 64 features a K step
(the same bytes a step as fp8's 128).

``runs_decode_gemm`` says which products take it (the sizes alone, so a CUDA graph's replays take
the path its capture took); ``UnquantizedLinearMethod`` calls ``decode_gemm`` for those on CUDA
and ``F.linear`` for the rest.
"""

from __future__ import annotations

import torch
import triton

from tokenmill.kernels.triton import split_k
from tokenmill.kernels.triton.fp8_gemm import _fp8_swapped_kernel

# Up to this many tokens every product takes the swapped kernel; past it, up to MAX_M, only those
# whose 128 x 128 output tiles would fill at most half the SMs (cuBLAS leaves the rest idle).
ALWAYS_MAX_M = 64
MAX_M = 256
BLOCK_K = 64  # 128 bytes of a weight row a K step, as fp8's 128 features


def runs_decode_gemm(m: int, n: int, num_sms: int) -> bool:
    """Whether an [m, K] x [K, n] product takes the swapped kernel."""
    if m <= ALWAYS_MAX_M:
        return 0 < m
    return m <= MAX_M and triton.cdiv(n, 128) * triton.cdiv(m, 128) * 2 <= num_sms


def choose_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """Tiles, warps, stages and K split for [m, k] x [k, n]."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles = triton.cdiv(n, 128) * triton.cdiv(m, block_m)
    k_steps = triton.cdiv(k, BLOCK_K)
    # Split K while the launch stays within one program an SM and each split streams >= 4 K steps.
    split = 1
    while tiles * split * 2 <= num_sms and split * 2 <= min(16, k_steps // 4):
        split *= 2
    stages = 6 if m > block_m else 4
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=BLOCK_K, num_warps=4, num_stages=stages, split_k=split)


def _launch_shape(config: dict[str, int], k: int) -> tuple[dict[str, int], int, int]:
    """(the kernel's meta-parameters, the K split, K steps a split): rounding may leave fewer
    non-empty splits than asked."""
    cfg = dict(config)
    k_steps = triton.cdiv(k, cfg["BLOCK_K"])
    steps_per_split = triton.cdiv(k_steps, cfg.pop("split_k"))
    return cfg, triton.cdiv(k_steps, steps_per_split), steps_per_split


def counters_needed(n: int) -> int:
    """Size of a layer's split-K counter buffer."""
    return split_k.counters_needed(n, MAX_M)


def decode_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
                config: dict[str, int] | None = None, out: torch.Tensor | None = None,
                compile_only: bool = False) -> torch.Tensor:
    """x [M, K] and w [N, K] (bf16 or fp16, last dims contiguous) -> [M, N] in x's dtype.
    ``counters``: the layer's int32 zeros (``counters_needed(N)``), left zeroed again. ``config``
    overrides ``choose_config`` (tests); ``out`` receives y (tests poison it). ``compile_only``
    compiles the launch and runs nothing (``precompile``)."""
    from tokenmill.kernels.triton.precompile import launcher
    from tokenmill.kernels.triton.sm_count import num_sms

    m, k = x.shape
    n = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"x and w need contiguous last dims, got strides {x.stride()} and {w.stride()}")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg, split, steps_per_split = _launch_shape(config or choose_config(m, n, k, num_sms(x.device)), k)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    if split > 1 and grid[0] * grid[1] > counters.numel():
        raise ValueError(f"split-K over {grid[0] * grid[1]} tiles needs that many counters, got {counters.numel()}")
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    unused = counters  # the scale pointers: SCALED=False never reads them
    launcher(_fp8_swapped_kernel, grid, compile_only)(
        x, w, unused, unused, bias if bias is not None else unused, y, partial, counters, m, n, k, steps_per_split, split,
        x.stride(0), w.stride(0), y.stride(0), EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % cfg["BLOCK_K"] == 0,
        HAS_BIAS=bias is not None, SPLIT=split > 1, SCALED=False, **cfg,
    )
    return y


def precompile(layers: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]) -> None:
    """Compile every variant the layers' (weight, bias, counters) can launch (inside
    ``precompile.parallel_compile``): each tile and stage class up to MAX_M tokens, split or not."""
    from tokenmill.kernels.triton.sm_count import num_sms

    seen = set()
    for weight, bias, counters in layers:
        n, k = weight.shape
        sms = num_sms(weight.device)
        for m in range(1, MAX_M + 1):
            if not runs_decode_gemm(m, n, sms):
                continue
            cfg, split, _ = _launch_shape(choose_config(m, n, k, sms), k)
            key = (n, k, weight.dtype, bias is not None, cfg["BLOCK_M"], cfg["num_stages"], split > 1)
            if key in seen:
                continue
            seen.add(key)
            x = torch.empty((m, k), dtype=weight.dtype, device=weight.device)
            decode_gemm(x, weight, bias, counters, compile_only=True)
