"""RMSNorm, optionally fused with the residual add before it (twins: ``reference.rms_norm_ref`` and
``reference.fused_add_rms_norm_ref``).

A decoder layer does ``hidden = residual + hidden; normed = norm(hidden)`` twice per layer. Fusing
the add into the norm reads x and residual once and writes both results in the same pass, instead
of a separate add kernel writing the sum and the norm reading it back. The rounding follows HF:
the sum is rounded to the model dtype, statistics are fp32, the normalised row is rounded to the
model dtype and then multiplied by the weight.

When the next linear runs on fp8 (``rms_norm_fp8``), the kernel also quantizes what it would have
stored: the normalised row is in registers, so its largest magnitude, the per-token scale and the
float8 codes cost no extra pass over memory and no launch of their own (``quantize_fp8``). The row
is rounded to the model dtype first, exactly as the unfused path stores it and reads it back, so
the codes and scales are the same bits.

Each program normalises BLOCK_R rows, so short rows (the per-head q/k norms of Qwen3, 128 wide)
still give every program a few thousand elements. Rows may be addressed with two strides
(``[T, heads, head_dim]`` views of a fused qkv output), so the per-head norm needs no copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.fp8_gemm import fp8_codes, fp8_outputs, fp8_row_scale


# num_rows changes every step: not specialised on, so one variant serves every batch size.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    num_rows,
    inner_rows,
    n_cols,
    eps,
    stride_x_outer,
    stride_x_inner,
    stride_res_row,
    stride_out_row,
    stride_res_out_row,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,  # out_ptr takes float8 codes and scale_ptr each row's max |out| / 448
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x_off = (rows64 // inner_rows) * stride_x_outer + (rows64 % inner_rows) * stride_x_inner
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows64[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the model dtype, as HF's `residual + hidden` does, and normalise that.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + rows64[:, None] * stride_res_out_row + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = w[None, :] * normed
    if QUANTIZE:
        out = out.to(x_ptr.dtype.element_ty).to(tl.float32)  # what the unfused path stores and re-reads
        scale = fp8_row_scale(tl.max(tl.abs(out), axis=1))  # padding columns hold 0
        tl.store(scale_ptr + rows64, scale, mask=row_ok)
        out = fp8_codes(out, scale[:, None])
    tl.store(out_ptr + rows64[:, None] * stride_out_row + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fp8``: (codes, scales) to quantize into instead of writing ``out`` (x must be 2-D)."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D or 3-D with a contiguous last dim, got shape {tuple(x.shape)}")
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be [{n_cols}], got {tuple(weight.shape)}")
    if x.dim() == 3:
        inner_rows, stride_outer, stride_inner = x.shape[1], x.stride(0), x.stride(1)
    else:
        inner_rows, stride_outer, stride_inner = 1, x.stride(0), 0
    num_rows = x.numel() // n_cols
    if fp8 is not None:
        out = fp8[0]  # checked by fp8_outputs
    elif out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"out must be contiguous with x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or x.dim() != 2 or residual.stride(-1) != 1:
            raise ValueError(
                f"residual must be 2-D like x {tuple(x.shape)} with a contiguous last dim, got {tuple(residual.shape)}"
            )
        if residual_out is None:
            res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif residual_out.shape != x.shape or residual_out.stride(-1) != 1 or residual_out.dtype != x.dtype:
            raise ValueError(f"residual_out must be x's shape {tuple(x.shape)} and dtype with a contiguous last dim")
        else:
            res_out = residual_out
    if num_rows == 0:
        return out, res_out
    block_n = triton.next_power_of_2(n_cols)
    block_r = max(1, min(16, 4096 // block_n))  # about 4K elements per program
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out if res_out is not None else out,
        fp8[1] if fp8 is not None else weight,
        num_rows,
        inner_rows,
        n_cols,
        eps,
        stride_outer,
        stride_inner,
        residual.stride(0) if residual is not None else 0,
        out.stride(-2),
        res_out.stride(0) if res_out is not None else 0,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=fp8 is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=8 if block_n >= 4096 else 4,
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x ([rows, n] or [T, heads, n], last dim contiguous).

    Returns ``out`` (a new contiguous tensor of x's shape and dtype when not given).
    """
    return _launch(x, weight, eps, None, out, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; x and residual are [rows, n].

    The second result is the residual stream the next layer adds to. Both are new tensors unless
    ``out``/``residual_out`` are given; ``residual_out`` may be ``residual`` itself (each element is
    read before it is written by the same program), which saves an allocation per layer.
    """
    out, res_out = _launch(x, weight, eps, residual, out, residual_out)
    assert res_out is not None
    return out, res_out


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``quantize_fp8(rms_norm(x (+ residual)))`` in one pass, for an fp8 linear's input.

    x (and residual) [rows, n] -> (float8 e4m3 codes [rows, n], fp32 scales [rows], the residual sum
    or None): a scale per row (max |row| / 448). The residual sum stays in x's dtype, as
    ``fused_add_rms_norm`` returns it; ``residual_out`` and ``out`` (codes, scales) as there.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, n] to be quantized, got shape {tuple(x.shape)}")
    codes, scales = fp8_outputs(x.shape[0], x.shape[1], x.device, out)
    _, res_out = _launch(x, weight, eps, residual, None, residual_out, (codes, scales))
    return codes, scales, res_out
