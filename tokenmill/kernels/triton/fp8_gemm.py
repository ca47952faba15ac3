"""FP8 W8A8: activations quantized to float8 e4m3 per token, and a Triton fp8 GEMM.

``quantize_fp8`` gives each row of x its own scale (``max |x_row| / 448``, or one static scale
for all rows) and writes ``x / scale`` saturated to +-448 as float8 e4m3, in one launch: a
program per row reads the row once, whole (up to ``ONE_PASS_MAX_K`` wide), or twice in blocks
(the maximum, then the codes; the second read hits L2).

``fp8_gemm`` is ``(xq wq^T) * x_scale[:, None] * w_scale[None, :] (+ b)``: fp8 operands on the
tensor cores (QGMMA on Hopper), fp32 accumulation, the scales applied once in the epilogue. The
engine calls ``torch._scaled_mm`` past ``quantization.fp8.TRITON_GEMM_MAX_M`` tokens where it can
(bf16 output, sizes multiples of 16) and this kernel otherwise (up to 16 tokens it measured
faster; fp16 or fp32 output; other sizes); bench/quant_gemm_bench.py compares the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8 e4m3fn
# The smallest scale: keeps an all-zero row finite (x / scale = 0) and matches the twin.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# quantize_fp8 reads a row this wide (Llama-3-8B's 14,336-wide down_proj input included) in one
# pass, whole; the two-pass loop it replaced waited on ~4-6 dependent rounds of loads a row
# (ptxas unrolls each pass 4 deep), ~6 µs at M = 256 for down_proj's input (docs/perf.md 23, 36).
ONE_PASS_MAX_K = 16384


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


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] and wq [N, K] float8 e4m3, x_scale [M] and w_scale [N] fp32 -> [M, N] in ``out_dtype``."""
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    big = block_m == 128
    grid = (triton.cdiv(n, 128 if big else 64), triton.cdiv(m, block_m))
    _fp8_gemm_kernel[grid](xq, wq, x_scale, w_scale, bias if bias is not None else w_scale, y, m, n, k,
                           xq.stride(0), wq.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=128 if big else 64,
                           BLOCK_K=128, HAS_BIAS=bias is not None,
                           num_warps=8 if big else 4, num_stages=3 if big else 4)
    return y
