"""``y = x @ W^T (+ bias)`` whose rows do not depend on the batch: deterministic mode's GEMM (twin:
``reference.matmul_ref``).

cuBLAS chooses its kernel, tile shape and split-K by the problem's M, so the bits of one row's
result depend on how many other rows share the call (measured on the H200: 4 of 16 seeded samples
survived being batched with others, issue 21). Here an output element's arithmetic never depends on M:
- no split-K: one program owns each output tile and walks K in order, BLOCK_K (64) at a time, with
  the same tensor-core instruction (BLOCK_M is 64 or 128, so the dot is a warpgroup ``wgmma`` on
  sm_90 at any M; a tile under 64 rows would switch to ``mma.sync``, whose rounding need not match);
- rows past M are masked loads of zeros, which never mix into a real row.
Each output element is therefore the same chain of k16 MMAs over the same 64-deep K slices,
accumulated in fp32 in K order, whatever M is and whichever program it falls in. The tile's rows and
columns only say how many elements one program computes, not how: ``matmul_config`` takes 64 x 64
tiles while they are the way to fill 132 SMs and 128 x 128 ones (8 warps) once those give two waves,
and every tile it can pick gave the same bits on every P1-P3 projection and lm_head at M 256, 1,024
and 4,096 on the H200 (bench/deterministic_bench.py checks it on each run), at 1.2-1.6x cuBLAS's
time where one fixed tile took 1.3-2.1x (issue 21). The CPU interpreter tests and tests/gpu check it bit for bit,
across the switch.

W is stored as nn.Linear keeps it, [N, K] with K contiguous; its [BLOCK_K, BLOCK_N] tiles are read
transposed straight into the dot. Accumulation is fp32; the bias is added in fp32 and the sum
rounded once to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher


# M changes every step: not specialised on, so one compiled variant serves every batch size. The row
# strides are (one value per call site, K or N for contiguous rows): their 16-divisibility is what
# lets Triton prove x's and y's rows 16-byte aligned. Without it x is read with 2-byte loads that
# the pipeliner cannot make asynchronous, so every K step waits for them, and the MMAs stop
# overlapping (measured by compiling for sm_90: 204 registers instead of 116, 32 scalar loads a K
# step; issue 21). The load path does not touch the arithmetic: the same MMA chain either way.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Programs in groups of GROUP_M row tiles walk N together, so the weight tiles they share are
    # read from L2 rather than HBM. Only the assignment of tiles to programs changes with M.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]  # the [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = rk + k0 < K
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape of one GEMM launch (how many outputs a program computes, not how: see above)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


_SMALL_TILE = MatmulConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
_LARGE_TILE = MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
_LARGE_TILE_MIN_PROGRAMS = 256  # about two waves of 132 SMs: below that 128 x 128 tiles leave SMs idle


def matmul_config(m: int, n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile for an [M, K] x [K, N] product in ``dtype``.

    bf16/fp16: 128 x 128 tiles with 8 warps when they make at least two waves of programs (large
    prefill steps, the lm_head, the 8B's gate_up from M 256), else 64 x 64 with 4 warps (decode
    batches: on the H200 at M 256 these beat 64 x 128 and 128 x 128 on every 0.6B and 8B projection
    but gate_up-8B, and 128 x 128 beat them all at M 4,096; rows in bench/results). Both are 64 deep
    in K, so the MMA chain of an output element is the same (see the module docstring). fp32 (tests
    only: FMA dots in ieee fp32, where a different tile could group the products differently) keeps
    one small tile at every M.
    """
    if dtype == torch.float32:
        return MatmulConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
    large = _LARGE_TILE
    if triton.cdiv(m, large.block_m) * triton.cdiv(n, large.block_n) >= _LARGE_TILE_MIN_PROGRAMS:
        return large
    return _SMALL_TILE


def matmul(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K], last dim contiguous
    bias: torch.Tensor | None = None,  # [N]
    *,
    out: torch.Tensor | None = None,  # [M, N], last dim contiguous
    config: MatmulConfig | None = None,
    compile_only: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ weight.T + bias`` with every row's bits independent of M and of the other rows.

    ``config`` overrides the tile shape (tests, benchmarks); the engine always uses ``matmul_config``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if x.dtype != weight.dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x and weight must share a float16/bfloat16/float32 dtype, got {x.dtype} and {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be [{m}, {n}] in {x.dtype} with a contiguous last dim")
    if m == 0 or n == 0:
        return out
    config = config or matmul_config(m, n, k, x.dtype)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    launcher(_matmul_kernel, grid, compile_only)(
        x,
        weight,
        bias if bias is not None else weight,  # unread without HAS_BIAS
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        EVEN_K=k % config.block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
