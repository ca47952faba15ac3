"""W4A16 GEMM: ``y = x W^T (+ b)`` with W stored as 4-bit codes, dequantized in registers.

W lies as ``tokenmill.quantization.int4.Int4Weights``: codes [ceil(K/8), N] int32 packed along K,
a scale per (group of K, output) and optionally a zero point. A program computes a BLOCK_M x
BLOCK_N tile of y over a range of K: each K-tile loads the words it needs once ([BLOCK_K / 8,
BLOCK_N] int32), shifts each word's 8 codes out into 8 rows of a [BLOCK_K, BLOCK_N] tile in
registers, subtracts the zero point (``u - z`` is an integer in [-16, 15], exact in fp16/bf16),
multiplies with the activations on the tensor cores, and scales the fp32 partial product by the group's scale. A
K-tile never straddles two groups (BLOCK_K divides the group size), so a scale multiplies a whole
[BLOCK_M, BLOCK_N] partial instead of every weight.

Small M (decode) has too few output tiles to keep 132 SMs streaming weights, so K is split over
SPLIT_K programs per tile: each writes its fp32 partial to a workspace and counts itself in on a
per-tile counter; the last to arrive sums the partials in split order (deterministic), adds the
bias, writes y and resets the counter for the next launch (and the next CUDA-graph replay).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Split K only while output tiles are few; past this M the tiles alone fill the GPU.
SPLIT_K_MAX_M = 64


@triton.jit(do_not_specialize=["M", "k_per_split", "split_k"])
def _w4a16_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
    M, N, K, group_size, k_per_split, split_k,
    stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    shifts = tl.arange(0, 8) * 4
    rw = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # One load per word ([BLOCK_K / 8, BLOCK_N]), then its 8 codes spread into K rows in registers.
        word_rows = k0 // 8 + rw
        words = tl.load(qw_ptr + word_rows[:, None] * N + rn[None, :], mask=(word_rows[:, None] * 8 < K) & n_ok[None, :], other=0)
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // group_size
        if HAS_ZEROS:
            zeros = tl.load(zero_ptr + group * N + rn, mask=n_ok, other=0).to(tl.int32)
            w = (codes - zeros[None, :]).to(a.dtype)
        else:
            w = (codes - 8).to(a.dtype)
        scale = tl.load(scale_ptr + group * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        if IEEE:
            part = tl.dot(a, w, input_precision="ieee")
        else:
            part = tl.dot(a, w)
        acc += part * scale[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        # Partials are [split_k, M, N] fp32; .cg loads read L2, where the other SMs' stores landed.
        p_ptrs = partial_ptr + rm[:, None] * N + rn[None, :]
        tl.store(p_ptrs + pid_k * M * N, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is stored before the count (release below)
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, split_k):
                acc += tl.load(p_ptrs + s * M * N, mask=y_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def choose_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict[str, int]:
    """Tile sizes, warps, stages and the K split for an [m, k] x [k, n] product (a fixed small set,
    so few variants compile: BLOCK_M from M's size class, the split a run-time argument)."""
    block_k = 128 if group_size % 128 == 0 or group_size >= k else (64 if group_size % 64 == 0 else 32)
    if m > SPLIT_K_MAX_M:
        return dict(BLOCK_M=64 if m <= 128 else 128, BLOCK_N=128, BLOCK_K=min(block_k, 64), num_warps=8, num_stages=3,
                    split_k=1)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * num_sms and split * 2 <= min(16, k_tiles):
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4, split_k=split)


def counters_needed(n: int) -> int:
    """Size of the per-layer split-K counter buffer: one per output tile of the largest split launch."""
    return triton.cdiv(n, 32) * triton.cdiv(SPLIT_K_MAX_M, 16)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype. ``counters``: int32 zeros (``counters_needed``),
    left zeroed again. ``config`` overrides ``choose_config`` (tests force splits and tiles); ``out``
    receives y (tests poison it)."""
    m, k = x.shape
    n = qweight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = dict(config or choose_config(m, n, k, group_size, _num_sms(x.device)))
    split = cfg.pop("split_k")
    block_k = cfg["BLOCK_K"]
    if group_size < k and group_size % block_k:
        raise ValueError(f"BLOCK_K={block_k} must divide group_size={group_size}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # rounding may leave fewer non-empty splits
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    if split > 1 and grid[0] * grid[1] > counters.numel():
        raise ValueError(f"split-K over {grid[0] * grid[1]} tiles needs that many counters, got {counters.numel()}")
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _w4a16_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        y, partial, counters, m, n, k, group_size, k_per_split, split, x.stride(0), y.stride(0),
        HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, SPLIT=split > 1, IEEE=x.dtype == torch.float32,
        **cfg,
    )
    return y


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H100/H200 so the same splits are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count
