"""``silu(gate) * up`` of the gated MLP in one pass (twin: ``reference.silu_and_mul_ref``).

The MLP's merged gate_up projection yields ``[rows, 2d]`` (gate first); reading both halves and
writing d values once halves the traffic of separate silu and multiply kernels.

When down_proj runs on fp8 (``silu_and_mul_fp8``), the same kernel quantizes its result for it
instead of storing it: no model-dtype intermediate is written and read back, and there is no
``quantize_fp8`` launch. A per-token scale needs the row's largest magnitude before the first code,
so a program takes a whole row in two sweeps (the maximum, then the codes; the second read of the
row hits L2), as ``quantize_fp8`` does; each value is rounded to the model dtype first, as the
unfused path stores it, so the codes and scales are the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_gemm import fp8_codes, fp8_outputs, fp8_row_scale


@triton.jit
def _silu_times_up(row_ptr, cols, d, mask):
    """silu(gate) * up in fp32 for the columns ``cols`` of one [2d] row (gate, up)."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + d + cols, mask=mask, other=0.0).to(tl.float32)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x_row, stride_out_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    out = _silu_times_up(x_ptr + row * stride_x_row, cols, d, mask)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, d, stride_x_row, stride_q_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    biggest = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        out = _silu_times_up(x_row, cols, d, cols < d).to(x_ptr.dtype.element_ty).to(tl.float32)
        biggest = tl.maximum(biggest, tl.abs(out))  # masked columns hold silu(0) * 0 = 0
    scale = fp8_row_scale(tl.max(biggest, axis=0))
    tl.store(scale_ptr + row, scale)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        out = _silu_times_up(x_row, cols, d, cols < d).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + row * stride_q_row + cols, fp8_codes(out, scale).to(q_ptr.dtype.element_ty), mask=cols < d)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must have an even, contiguous last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    return x.reshape(-1, 2 * d), d  # a view for any x whose rows are evenly strided


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2d] (gate, up), last dim contiguous -> [..., d] = silu(gate) * up.

    Returns ``out`` (contiguous, x's dtype) or a new tensor.
    """
    x2, d = _rows(x)
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], d) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous of shape {(*x.shape[:-1], d)}, got {tuple(out.shape)}")
    out2 = out.view(-1, d)
    if out2.numel():
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(out2.shape[0], triton.cdiv(d, block))](
            x2, out2, d, x2.stride(0), out2.stride(0), BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_fp8(x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(silu_and_mul(x))`` in one launch, for down_proj's fp8 input.

    x: [..., 2d] -> (float8 e4m3 codes [rows, d], fp32 scales [rows]) over x's rows flattened: a
    scale per row (max |row| / 448). ``out``: (codes, scales) to write into.
    """
    x2, d = _rows(x)
    codes, scales = fp8_outputs(x2.shape[0], d, x.device, out)
    if codes.numel():
        # 4,096 columns a sweep step (16 a thread at 8 warps): the steps of a row run one after the
        # other, each waiting for its loads, so fewer, wider steps (4 + 4 for Llama-3-8B's 14,336).
        block = min(triton.next_power_of_2(d), 4096)
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](
            x2, codes, scales, d, x2.stride(0), codes.stride(0), BLOCK=block, num_warps=4 if block <= 1024 else 8,
        )
    return codes, scales
