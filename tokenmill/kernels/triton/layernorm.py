"""LayerNorm, optionally fused with the residual add before it (twin: ``reference.add_layer_norm_ref``).

BERT is a post-norm transformer: each block ends with ``LayerNorm(dense(x) + residual)``, twice
per layer. In torch that is an add kernel (reads two [T, hidden] tensors, writes one) and a
layer_norm kernel (reads it back, writes the result): five passes over the activations. Fused,
it is three (read x and residual, write the normalised sum), in one launch instead of two.
Rounding follows HF: the sum is rounded to the model dtype (``hidden + input_tensor``), the
statistics and the affine map are fp32, and the result is rounded once, as torch's layer_norm does.

Each program normalises BLOCK_R rows of up to BLOCK_N columns (about 4K elements per program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# num_rows changes every step: not specialised on, so one variant serves every batch size.
@triton.jit(do_not_specialize=["num_rows"])
def _layer_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    num_rows,
    n_cols,
    eps,
    stride_x_row,
    stride_res_row,
    stride_out_row,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + rows[:, None] * stride_res_row + cols[None, :], mask=mask, other=0.0)
        # Round the sum to the model dtype, as HF's `hidden_states + input_tensor` does.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / n_cols
    centred = tl.where(col_ok[None, :], xf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``layer_norm(x + residual)`` over the last dim (x and residual [rows, n], last dim contiguous);
    plain ``layer_norm(x)`` when ``residual`` is None. Returns ``out`` or a new contiguous tensor."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dim, got shape {tuple(x.shape)}")
    num_rows, n_cols = x.shape
    if weight.shape != (n_cols,) or bias.shape != (n_cols,):
        raise ValueError(f"weight and bias must be [{n_cols}], got {tuple(weight.shape)} and {tuple(bias.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be {tuple(x.shape)} with a contiguous last dim, got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with a contiguous last dim, got {tuple(out.shape)}")
    if num_rows == 0:
        return out
    block_n = triton.next_power_of_2(n_cols)
    block_r = max(1, min(16, 4096 // block_n))
    _layer_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        x,
        residual if residual is not None else x,
        weight,
        bias,
        out,
        num_rows,
        n_cols,
        eps,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=8 if block_n >= 4096 else 4,
    )
    return out
