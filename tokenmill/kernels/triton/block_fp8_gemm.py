"""Block-wise FP8 W8A8: activations quantized per token and 128-feature group, and a Triton GEMM
whose weight carries a scale per 128 x 128 block (Qwen3-*-FP8, DeepSeek-style checkpoints).

``quantize_fp8_groups`` gives each ``group``-wide slice of a row its own scale
(``max |x_slice| / 448``, the per-token rule of ``fp8_gemm.quantize_fp8`` applied to a slice) and
writes the codes, a program a slice.

``block_fp8_gemm`` is ``y[m, n] = sum_kb (xq[m, kb] . wq[n, kb]) * x_scale[m, kb] * w_scale[n // 128, kb]``
(+ b): each K step is one 128-feature group, its fp8 product (tensor cores) is scaled by its pair
of scales and added to an fp32 accumulator, so the scales cannot wait for the epilogue as in the
per-channel GEMM. The decode sizes take the per-channel GEMM's plan (``fp8_gemm.runs_swapped``,
``plan_swapped``: operands swapped, K split over programs, ``split_k.store_tile`` summing
the splits); every other size plain 64 x 128 tiles. Written for correctness first: neither path is
tuned yet (bench/quant_gemm_bench.py has no block rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_gemm import fp8_codes, fp8_row_scale, plan_swapped, runs_swapped
from tokenmill.kernels.triton.sm_count import num_sms
from tokenmill.kernels.triton.split_k import store_tile

GROUP = 128  # features a scale covers: the activation groups along K, the weight blocks along N and K


@triton.jit(do_not_specialize=["M"])
def _quantize_fp8_groups_kernel(x_ptr, q_ptr, scale_ptr, M, K, num_groups, stride_xm, stride_qm, GROUP: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    rk = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
    scale = fp8_row_scale(tl.max(tl.abs(x), axis=0))
    tl.store(scale_ptr + row * num_groups + group, scale)
    tl.store(q_ptr + row * stride_qm + rk, fp8_codes(x, scale).to(q_ptr.dtype.element_ty), mask=rk < K)


def quantize_fp8_groups(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 e4m3 codes [M, K], fp32 scales [M, cdiv(K, group)]): a scale per token and
    ``group``-feature slice (the last one partial when K is not a multiple), max(amax / 448, MIN_SCALE)."""
    m, k = x.shape
    if group < 16 or group & (group - 1):
        raise ValueError(f"group must be a power of two of at least 16, got {group}")
    if x.stride(1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_fp8_groups_kernel[(m, groups)](x, q, scales, m, k, groups, x.stride(0), q.stride(0), GROUP=group,
                                                 num_warps=1 if group <= 256 else 4)
    return q, scales


@triton.jit(do_not_specialize=["M"])
def _block_fp8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, M, N, K, num_groups,
                           stride_am, stride_wn, stride_wsn, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = rm < M, rn < N
    a_scale_row = a_scale_ptr + rm * num_groups
    w_scale_row = w_scale_ptr + (rn // GROUP) * stride_wsn  # the weight block each output row lies in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rm[:, None] * stride_am + rk[None, :], mask=m_in[:, None] & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=n_in[None, :] & (rk[:, None] < K), other=0.0)
        part = tl.dot(a, w)
        kb = k0 // GROUP  # BLOCK_K divides GROUP: the step lies in one group
        a_scale = tl.load(a_scale_row + kb, mask=m_in, other=0.0)
        w_scale = tl.load(w_scale_row + kb, mask=n_in, other=0.0)
        acc += part * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_in, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_in[:, None] & n_in[None, :])


@triton.jit(do_not_specialize=["M", "steps_per_split", "split_k"])
def _block_fp8_swapped_kernel(x_ptr, w_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
                              M, N, K, num_groups, steps_per_split, split_k, stride_xm, stride_wn, stride_wsn, stride_ym,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                              HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """y^T = W x^T for few tokens (as fp8_gemm's swapped kernel): BLOCK_N weight rows the MMA's long
    side, the tokens its N, K cut into ``split_k`` runs of ``steps_per_split`` K steps."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_in = rm % M  # rows past M read row rm mod M (never stored)
    n_in = rn < N
    x_scale_row = x_scale_ptr + rm_in * num_groups
    w_scale_row = w_scale_ptr + (rn // GROUP) * stride_wsn
    k_begin = pid_k * steps_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_in = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_in[:, None] & k_in[None, :], other=0.0)
        xt = tl.load(x_ptr + rm_in[None, :] * stride_xm + rk[:, None], mask=k_in[:, None], other=0.0)
        part = tl.dot(w, xt)
        kb = k0 // GROUP
        w_scale = tl.load(w_scale_row + kb, mask=n_in, other=0.0)
        x_scale = tl.load(x_scale_row + kb)
        acc += part * w_scale[:, None] * x_scale[None, :]
    store_tile(tl.trans(acc), rm, rn, M, N, y_ptr, stride_ym, bias_ptr, partial_ptr, counter_ptr, pid_k, split_k,
               pid_n * tl.num_programs(0) + pid_m, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


def block_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype, counters: torch.Tensor | None = None,
                   config: dict[str, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """xq [M, K] and wq [N, K] float8 e4m3, x_scale [M, cdiv(K, 128)] and w_scale [cdiv(N, 128),
    cdiv(K, 128)] fp32 -> [M, N] in ``out_dtype``. ``counters``: the layer's int32 zeros for the split-K
    path (``fp8_gemm.counters_needed(N)``, left zeroed; made for the call when absent). ``config``
    forces the swapped kernel with those settings (``choose_swapped_config``'s keys; BLOCK_K must
    divide 128); ``out`` receives y (tests poison it)."""
    m, k = xq.shape
    n = wq.shape[0]
    groups = triton.cdiv(k, GROUP)
    if wq.shape[1] != k or x_scale.shape != (m, groups) or w_scale.shape != (triton.cdiv(n, GROUP), groups):
        raise ValueError(f"block fp8 shapes disagree: x {tuple(xq.shape)}, w {tuple(wq.shape)}, x_scale "
                         f"{tuple(x_scale.shape)} (expected {(m, groups)}), w_scale {tuple(w_scale.shape)} "
                         f"(expected {(triton.cdiv(n, GROUP), groups)})")
    if xq.stride(1) != 1 or wq.stride(1) != 1 or not x_scale.is_contiguous() or w_scale.stride(1) != 1:
        raise ValueError("block fp8 operands and scales need a contiguous last dim (x_scale contiguous)")
    y = out if out is not None else torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    bias_arg = bias if bias is not None else w_scale
    if config is None and not runs_swapped(m, n, num_sms(xq.device)):
        grid = (triton.cdiv(n, 128), triton.cdiv(m, 64))
        _block_fp8_gemm_kernel[grid](xq, wq, x_scale, w_scale, bias_arg, y, m, n, k, groups, xq.stride(0), wq.stride(0),
                                     w_scale.stride(0), y.stride(0), BLOCK_M=64, BLOCK_N=128, BLOCK_K=GROUP, GROUP=GROUP,
                                     HAS_BIAS=bias is not None, num_warps=4, num_stages=3)
        return y
    plan = plan_swapped(y, k, config, counters)
    if GROUP % plan.meta["BLOCK_K"]:
        raise ValueError(f"BLOCK_K={plan.meta['BLOCK_K']} must divide the {GROUP}-feature scale group")
    _block_fp8_swapped_kernel[plan.grid](xq, wq, x_scale, w_scale, bias_arg, y, plan.partial,
                                         plan.counters if plan.counters is not None else w_scale, m, n, k, groups,
                                         plan.steps_per_split, plan.split, xq.stride(0), wq.stride(0), w_scale.stride(0),
                                         y.stride(0), GROUP=GROUP, HAS_BIAS=bias is not None, SPLIT=plan.split > 1,
                                         **plan.meta)
    return y
