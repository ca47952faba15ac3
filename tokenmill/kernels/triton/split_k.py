"""The end of a split-K GEMM program: its output tile stored, or its fp32 partial summed with the others.

The decode GEMMs (W4A16 and fp8, operands swapped) split K over several programs per output tile
so that a few tokens still keep every SM streaming weights. Each program writes its fp32 partial
to a workspace ``[split_k, M, N]`` and counts itself in on the tile's counter; the last to arrive
sums the partials in split order (so the result does not depend on which program finished
first), adds the bias, writes y and resets the counter for the next launch (and the next CUDA
graph replay). Without a split the tile goes straight to y.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_tile(out, rm, rn, M, N, y_ptr, stride_ym, bias_ptr, partial_ptr, counter_ptr, pid_k, split_k, tile,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out`` [BLOCK_M, BLOCK_N] fp32, rows ``rm`` and columns ``rn`` of y; ``tile`` numbers the
    output tile among those of the launch (its counter)."""
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    y_mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        # .cg loads read L2, where the other SMs' stores landed.
        p_ptrs = partial_ptr + rm[:, None] * N + rn[None, :]
        tl.store(p_ptrs + pid_k * M * N, out, mask=y_mask)
        tl.debug_barrier()  # every thread's partial is stored before the count (release below)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if BLOCK_M == 16:
                # Four partials in flight at a time (a dependent load a split costs an L2 round trip:
                # ~0.5 µs each, 8-16 splits at small M), still summed in split order. Larger tiles
                # keep one at a time: 4 x 32 more registers would cost an SM a program.
                for s0 in range(0, split_k, 4):
                    p0 = tl.load(p_ptrs + s0 * M * N, mask=y_mask, other=0.0, cache_modifier=".cg")
                    p1 = tl.load(p_ptrs + (s0 + 1) * M * N, mask=y_mask & (s0 + 1 < split_k), other=0.0, cache_modifier=".cg")
                    p2 = tl.load(p_ptrs + (s0 + 2) * M * N, mask=y_mask & (s0 + 2 < split_k), other=0.0, cache_modifier=".cg")
                    p3 = tl.load(p_ptrs + (s0 + 3) * M * N, mask=y_mask & (s0 + 3 < split_k), other=0.0, cache_modifier=".cg")
                    total = (((total + p0) + p1) + p2) + p3
            else:
                for s in range(0, split_k):
                    total += tl.load(p_ptrs + s * M * N, mask=y_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)


def counters_needed(n: int, max_rows: int) -> int:
    """Size of a layer's split-K counter buffer: one per output tile of the largest split launch
    (tiles of at least 32 outputs and 16 rows, up to ``max_rows`` rows)."""
    return triton.cdiv(n, 32) * triton.cdiv(max_rows, 16)
