"""``silu(gate) * up`` of the gated MLP in one pass (twin: ``reference.silu_and_mul_ref``).

The MLP's merged gate_up projection yields ``[rows, 2d]`` (gate first); reading both halves and
writing d values once halves the traffic of separate silu and multiply kernels.

When down_proj runs on fp8 (``silu_and_mul_fp8``), each program also leaves the largest magnitude
of the block it wrote, so the quantization after it knows every row's scale and reads each row
once, a program a block (``fp8_gemm.quantize_fp8_blocks``). A SiLU that quantized its own output
needed a program a row, sweeping it twice, and ran slower than the two launches (docs/perf.md 23);
``quantize_fp8`` alone has the same shape of work (~5-6 µs at down_proj's 14,336 wide at decode
sizes, docs/perf.md 36).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, amax_ptr, d, stride_x_row, stride_out_row, BLOCK: tl.constexpr,
                         STORE_AMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out_row + cols, out, mask=mask)
    if STORE_AMAX:  # of the values as stored (masked columns hold 0)
        tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(out.to(tl.float32)), axis=0))


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2d] (gate, up), last dim contiguous -> [..., d] = silu(gate) * up.

    Returns ``out`` (contiguous, x's dtype) or a new tensor.
    """
    out, _ = _launch(x, out, block_amax=False)
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(silu_and_mul(x))`` for an fp8 linear's input, x [rows, 2d] -> (float8 e4m3 codes
    [rows, d], fp32 scales [rows]): the same bits, in two launches that each spread a row over
    several programs."""
    from tokenmill.kernels.triton.fp8_gemm import quantize_fp8_blocks

    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, 2d] to be quantized, got shape {tuple(x.shape)}")
    out, amax = _launch(x, None, block_amax=True)
    return quantize_fp8_blocks(out, amax, _block(out.shape[-1]))


def _block(d: int) -> int:
    return min(1024, triton.next_power_of_2(d))


def _launch(x: torch.Tensor, out: torch.Tensor | None, *, block_amax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x must have an even, contiguous last dim, got shape {tuple(x.shape)}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)  # a view for any x whose rows are evenly strided
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], d) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous of shape {(*x.shape[:-1], d)}, got {tuple(out.shape)}")
    out2 = out.view(-1, d)
    block = _block(d)
    grid = (out2.shape[0], triton.cdiv(d, block))
    amax = torch.empty(grid, dtype=torch.float32, device=x.device) if block_amax else None
    if out2.numel():
        _silu_and_mul_kernel[grid](
            x2, out2, amax if amax is not None else out2, d, x2.stride(0), out2.stride(0), BLOCK=block,
            STORE_AMAX=block_amax, num_warps=4
        )
    return out, amax
