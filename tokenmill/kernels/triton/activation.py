"""``silu(gate) * up`` of the gated MLP in one pass (twin: ``reference.silu_and_mul_ref``).

The MLP's merged gate_up projection yields ``[rows, 2d]`` (gate first); reading both halves and
writing d values once halves the traffic of separate silu and multiply kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x_row, stride_out_row, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2d] (gate, up), last dim contiguous -> [..., d] = silu(gate) * up.

    Returns ``out`` (contiguous, x's dtype) or a new tensor.
    """
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must have an even, contiguous last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view for any x whose rows are evenly strided
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
