"""FP8 W8A8: activations quantized to float8 e4m3 per token, and a Triton fp8 GEMM.

``quantize_fp8`` gives each row of x its own scale (``max |x_row| / 448``, or one static scale
for all rows) and writes ``x / scale`` saturated to +-448 as float8 e4m3, in one launch: a
program per row reads the row once, whole (up to ``ONE_PASS_MAX_K`` wide), or twice in blocks
(the maximum, then the codes; the second read hits L2). ``quantize_fp8_blocks`` gives the same
bits for an x whose writer left each block's largest magnitude (the SiLU before down_proj): a
program a block, one read.

``fp8_gemm`` is ``(xq wq^T) * x_scale[:, None] * w_scale[None, :] (+ b)``: fp8 operands on the
tensor cores (QGMMA on Hopper), fp32 accumulation, the scales applied in the epilogue. At decode
sizes (``runs_swapped``) the operands are swapped, ``y^T = W x^T``: 128 weight rows are the
MMA's long side and the few tokens its N, and K is split over several programs a tile
(``split_k.store_tile`` sums them) so that every SM streams weights. A decode step's GEMM reads
each weight byte once and does little arithmetic with it, so what counts is keeping HBM busy;
cuBLAS's fp8 kernels (``torch._scaled_mm``) split nothing and left most SMs idle on Llama-3-8B's
narrow projections (o and down at M = 256: 64 output tiles for 132 SMs; docs/perf.md 37).
Elsewhere the engine calls ``_scaled_mm`` where it can (bf16 output, sizes multiples of 16) and
the plain tiles here otherwise; bench/quant_gemm_bench.py compares them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton import split_k
from tokenmill.kernels.triton.sm_count import num_sms
from tokenmill.kernels.triton.split_k import store_tile

FP8_MAX = 448.0  # largest finite float8 e4m3fn
# The smallest scale: keeps an all-zero row finite (x / scale = 0) and matches the twin.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# quantize_fp8 reads a row up to this wide in one pass, whole. On the H200 (94a97d6, docs/perf.md 36)
# that took o_proj's 4,096-wide input from 21.4 to 15.7 µs at M = 4,096 (2.8-3.4 to 2.4-2.8 at M
# <= 256), but down_proj's 14,336-wide one on 16 warps from 68 to 101 µs at M = 4,096 (5.1-7.0 µs
# at M <= 256, as the two passes): wider rows keep the two-pass loop.
ONE_PASS_MAX_K = 8192
# Up to this many tokens the swapped, split-K GEMM always runs. On the H200 (94a97d6, 721a060) it beat
# _scaled_mm with fast accumulation on all four of Llama-3-8B's projections up to 32 tokens (a layer
# 78 against 106 µs at M = 16) and on three of them at 64 (gate_up 36 against 39, down 26 against 39).
SWAPPED_MAX_M = 64
# Past it, up to this many, only on narrow weights (``runs_swapped``): _scaled_mm splits nothing, so
# where its 128 x 128 output tiles would fill at most half the SMs it leaves the rest idle (o and
# down at M = 256: 64 tiles for 132 SMs), and the swapped kernel on 64-row tiles ran o 12.2 against
# 14.6 µs and down 32.6 against 39.6 there (7d615c7); gate_up, 224 tiles wide, stays with cuBLAS.
NARROW_SWAPPED_MAX_M = 256


@triton.jit
def fp8_row_scale(amax):
    """The per-token scale of a row whose largest magnitude is ``amax``: max(amax / 448, MIN_SCALE), the
    quotient correctly rounded (as the twin's tensor division). Shared with the kernels that quantize
    their own output for the next fp8 linear (the RMSNorms), so every path rounds alike."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))  # FP8_MAX, MIN_SCALE


@triton.jit
def fp8_codes(x, scale):
    """x / scale saturated to +-448, in fp32 (the caller casts to float8 e4m3 as it stores)."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)


@triton.jit(do_not_specialize=["M"])
def _quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, M, K, stride_xm, stride_qm,
                         STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    if ONE_PASS:  # the whole row in registers: one read, all of it in flight at once
        rk = tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        if not STATIC:
            scale = fp8_row_scale(tl.max(tl.abs(x), axis=0))
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_qm + rk, fp8_codes(x, scale).to(q_ptr.dtype.element_ty), mask=rk < K)
    else:
        if not STATIC:
            biggest = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                rk = k0 + tl.arange(0, BLOCK)
                biggest = tl.maximum(biggest, tl.abs(tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)))
            scale = fp8_row_scale(tl.max(biggest, axis=0))
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_qm + rk, fp8_codes(x, scale).to(q_ptr.dtype.element_ty), mask=rk < K)


@triton.jit(do_not_specialize=["M"])
def _quantize_fp8_blocks_kernel(x_ptr, q_ptr, scale_ptr, amax_ptr, M, K, num_blocks, stride_xm, stride_qm,
                                BLOCK: tl.constexpr, BLOCKS_P: tl.constexpr):
    """One BLOCK-wide block of a row whose blocks' largest magnitudes the kernel that wrote x left in
    ``amax_ptr`` [M, num_blocks]: the row's scale from them, then this block's codes (one read)."""
    row = tl.program_id(0)
    block = tl.program_id(1)
    blocks = tl.arange(0, BLOCKS_P)
    amax = tl.max(tl.load(amax_ptr + row * num_blocks + blocks, mask=blocks < num_blocks, other=0.0), axis=0)
    scale = fp8_row_scale(amax)
    if block == 0:
        tl.store(scale_ptr + row, scale)
    rk = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
    tl.store(q_ptr + row * stride_qm + rk, fp8_codes(x, scale).to(q_ptr.dtype.element_ty), mask=rk < K)


def quantize_fp8_blocks(x: torch.Tensor, block_amax: torch.Tensor, block: int,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(x)`` (per-token scales) for an x whose writer also left, for each row, the
    largest magnitude of each ``block``-wide block (``block_amax`` [M, cdiv(K, block)] fp32): the
    same codes and scales, bit for bit (the row's maximum is the maximum of its blocks'), in one read
    of x by a program a block instead of one a row."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dim, got strides {x.stride()}")
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    num_blocks = triton.cdiv(k, block)
    if block_amax.shape != (m, num_blocks) or block_amax.dtype != torch.float32 or not block_amax.is_contiguous():
        raise ValueError(f"block_amax must be contiguous float32 [{m}, {num_blocks}], got {block_amax.dtype} {tuple(block_amax.shape)}")
    q, scales = fp8_outputs(m, k, x.device, out)
    if m:
        _quantize_fp8_blocks_kernel[(m, num_blocks)](x, q, scales, block_amax, m, k, num_blocks, x.stride(0), q.stride(0),
                                                     BLOCK=block, BLOCKS_P=triton.next_power_of_2(num_blocks),
                                                     num_warps=4)
    return q, scales


def fp8_outputs(rows: int, cols: int, device: torch.device,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes [rows, cols] float8 e4m3, scales [rows] fp32) a quantizing kernel writes: ``out``
    checked, or new tensors."""
    if out is None:
        return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
                torch.empty((rows,), dtype=torch.float32, device=device))
    codes, scales = out
    if codes.shape != (rows, cols) or codes.dtype != torch.float8_e4m3fn or codes.stride(-1) != 1:
        raise ValueError(f"out codes must be float8_e4m3fn [{rows}, {cols}] with a contiguous last dim, "
                         f"got {codes.dtype} {tuple(codes.shape)}")
    if scales.shape != (rows,) or scales.dtype != torch.float32 or not scales.is_contiguous():
        raise ValueError(f"out scales must be contiguous float32 [{rows}], got {scales.dtype} {tuple(scales.shape)}")
    return codes, scales


def quantize_fp8(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 e4m3 [M, K], fp32 scales [M]); ``static_scale`` (one fp32) for every row."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q, scales = fp8_outputs(m, k, x.device)
    if m:
        # Rows up to ONE_PASS_MAX_K wide are read once, whole (a program's loads all in flight);
        # longer ones in blocks, twice (the maximum, then the codes).
        one_pass = k <= ONE_PASS_MAX_K
        block = triton.next_power_of_2(k) if one_pass else 2048
        _quantize_fp8_kernel[(m,)](x, q, scales, static_scale if static_scale is not None else scales, m, k,
                                   x.stride(0), q.stride(0), STATIC=static_scale is not None, BLOCK=block,
                                   ONE_PASS=one_pass, num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16))
    return q, scales


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, stride_am, stride_wn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.dot(a, w)
    acc = acc * tl.load(a_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
    acc = acc * tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M", "steps_per_split", "split_k"])
def _fp8_swapped_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
                        M, N, K, steps_per_split, split_k, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """y^T = W x^T for few tokens: BLOCK_N weight rows are the MMA's 64-row side (read once, from
    HBM, the only large operand), the tokens its N; K cut into ``split_k`` runs of ``steps_per_split``
    K steps."""
    # Row tiles vary fastest: the programs that share a weight tile run together, so only the first
    # reads it from HBM.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M read row rm mod M (never stored) and whole tiles go unmasked: fewer predicates.
    rm_in = rm % M
    n_in = rn < N
    if EVEN_N:
        n_in = tl.full((BLOCK_N,), 1, tl.int1)
    # Written as a multiple of BLOCK_K, so the compiler knows every slice is 16-byte aligned (the
    # alignment its pipeliner needs to copy them asynchronously).
    k_begin = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_in = tl.full((BLOCK_K,), 1, tl.int1)
        if not EVEN_K:
            k_in = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        xt = tl.load(x_ptr + rm_in[None, :] * stride_xm + rk[:, None], mask=k_in[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    # Scaled before the split-K sum: scaling is linear, and the last program then only adds.
    acc = acc * tl.load(w_scale_ptr + rn, mask=n_in, other=0.0)[:, None]
    acc = acc * tl.load(x_scale_ptr + rm_in)[None, :]
    store_tile(tl.trans(acc), rm, rn, M, N, y_ptr, stride_ym, bias_ptr, partial_ptr, counter_ptr, pid_k, split_k,
               pid_n * tl.num_programs(0) + pid_m, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def runs_swapped(m: int, n: int, num_sms: int) -> bool:
    """Whether an [m, K] x [K, n] product takes the swapped kernel (see SWAPPED_MAX_M and
    NARROW_SWAPPED_MAX_M); it depends on the sizes alone, so a CUDA graph's replays take its path."""
    if m <= SWAPPED_MAX_M:
        return True
    return m <= NARROW_SWAPPED_MAX_M and triton.cdiv(n, 128) * triton.cdiv(m, 128) * 2 <= num_sms


def choose_swapped_config(m: int, n: int, k: int, num_sms: int) -> dict[str, int]:
    """Tiles, warps, stages and K split of the swapped GEMM for [m, k] x [k, n] (BLOCK_M from M's size
    class, so few variants compile; the split is a run-time argument)."""
    # Past 64 tokens, 64-row tiles: the row tiles of one weight tile run side by side (the grid's
    # fastest axis), so the weight comes from HBM once; 128-row tiles on 8 warps lost to _scaled_mm
    # on all four of Llama-3-8B's projections at M 96-256 (94a97d6).
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 128, 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_steps = triton.cdiv(k, block_k)
    # Split K while the launch stays within one program an SM, each split streaming at least 4 K
    # steps, and the fp32 partials (split x M x N x 4 bytes) at most half the weight's bytes. Two
    # programs an SM lost in the H200 sweep (94a97d6): o and down at 8 splits against 4, 11.3 against
    # 9.7 µs and 22.8 against 21.6 at M = 16, 19.8 against 13.7 and 32.6 against 25.9 at M = 64.
    split = 1
    while tiles * split * 2 <= num_sms and split * 2 <= min(16, k_steps // 4) and split * 2 * m * 8 <= k:
        split *= 2
    # Several row tiles of one weight tile: 6 stages, ~15% faster than 4 (down at M = 128: 26.1
    # against 30.8 µs in 8b82670's sweep, 27.9 against 32.0 under Nsight Compute at c6446c2; the
    # 71-72 µs one 7d615c7 lease recorded at 4 stages did not reproduce, docs/perf.md 39). One row
    # tile: 4 stages, within +-7% of 6 either way.
    stages = 6 if m > block_m else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=stages, split_k=split)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, counters: torch.Tensor | None = None,
             config: dict[str, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """xq [M, K] and wq [N, K] float8 e4m3, x_scale [M] and w_scale [N] fp32 -> [M, N] in ``out_dtype``.
    Where ``runs_swapped`` says so the swapped, split-K kernel (``counters``: the layer's int32
    zeros, ``counters_needed(N)``, left zeroed again; made for the call when absent); otherwise the
    plain tiles. ``config`` overrides ``choose_swapped_config`` (tests and the bench's sweep); ``out``
    receives y (tests poison it)."""
    m, k = xq.shape
    n = wq.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    if config is None and not runs_swapped(m, n, num_sms(xq.device)):
        return _fp8_gemm_plain(xq, x_scale, wq, w_scale, bias, y)
    plan = plan_swapped(y, k, config, counters)
    cfg = plan.meta
    _fp8_swapped_kernel[plan.grid](xq, wq, x_scale, w_scale, bias if bias is not None else w_scale, y, plan.partial,
                                   plan.counters if plan.counters is not None else w_scale, m, n, k, plan.steps_per_split,
                                   plan.split, xq.stride(0), wq.stride(0), y.stride(0), EVEN_N=n % cfg["BLOCK_N"] == 0,
                                   EVEN_K=k % cfg["BLOCK_K"] == 0, HAS_BIAS=bias is not None, SPLIT=plan.split > 1, **cfg)
    return y


class SwappedPlan(NamedTuple):
    """A swapped, split-K launch: its tiles, warps and stages (``meta``), K steps a split, the
    non-empty splits, the grid, the counters (None when K is not split) and where partials go."""

    meta: dict[str, int]
    steps_per_split: int
    split: int
    grid: tuple[int, int, int]
    counters: torch.Tensor | None
    partial: torch.Tensor


def plan_swapped(y: torch.Tensor, k: int, config: dict[str, int] | None,
                 counters: torch.Tensor | None) -> SwappedPlan:
    """The launch of a swapped GEMM writing ``y`` [M, N] from K features: ``config`` or
    ``choose_swapped_config``'s; ``counters`` checked, or made for the call when K is split; the fp32
    partials' workspace ([split, M, N], or y itself without a split). Shared by the block-wise GEMM."""
    m, n = y.shape
    meta = dict(config or choose_swapped_config(m, n, k, num_sms(y.device)))
    split = meta.pop("split_k")
    k_steps = triton.cdiv(k, meta["BLOCK_K"])
    steps_per_split = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps_per_split)  # rounding may leave fewer non-empty splits
    grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), split)
    if split > 1:
        if counters is None:
            counters = torch.zeros(counters_needed(n), dtype=torch.int32, device=y.device)
        if grid[0] * grid[1] > counters.numel():
            raise ValueError(f"split-K over {grid[0] * grid[1]} tiles needs that many counters, got {counters.numel()}")
    partial = torch.empty((split, m, n), dtype=torch.float32, device=y.device) if split > 1 else y
    return SwappedPlan(meta, steps_per_split, split, grid, counters, partial)


def _fp8_gemm_plain(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """Products the swapped kernel does not take, where the engine cannot use ``_scaled_mm`` (fp16 or
    fp32 output, sizes not multiples of 16): 128 x 128 tiles."""
    m, k = xq.shape
    n = wq.shape[0]
    grid = (triton.cdiv(n, 128), triton.cdiv(m, 128))
    _fp8_gemm_kernel[grid](xq, wq, x_scale, w_scale, bias if bias is not None else w_scale, y, m, n, k,
                           xq.stride(0), wq.stride(0), y.stride(0), BLOCK_M=128, BLOCK_N=128, BLOCK_K=128,
                           HAS_BIAS=bias is not None, num_warps=8, num_stages=3)
    return y


def counters_needed(n: int) -> int:
    """Size of a layer's split-K counter buffer (one per output tile of the largest split launch)."""
    return split_k.counters_needed(n, NARROW_SWAPPED_MAX_M)
