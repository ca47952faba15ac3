"""A linear layer's LoRA update in one launch: y += x A_s^T B_s^T for each token's adapter slot s.

The layer keeps every slot's A and B side by side (tokenmill/lora/layers.py): rows
``(j S + s) R ... + R`` of ``a`` are slot s's A for sublayer j (q, k, v of a stacked q/k/v), and
the same columns of ``b`` its B, non-zero only in sublayer j's output rows. In torch the update
is three launches (a shrink GEMM over every slot, a one-hot mask, an expand ``addmm``); in a
decode step of a small model those launches, not their arithmetic, are the cost (~20% of a
Qwen3-0.6B step with rank-16 adapters on every projection).

Here one program takes a tile of tokens and a run of output columns. For each slot that a token
of the tile uses, it makes those tokens' low-rank activations t = x A_s^T (every sublayer's R
columns at once, so the output columns need not know their sublayer: B is zero outside it),
and adds t B_s^T to those tokens' rows of y in place (the other rows are left as they are). The
shrink is made again by every program along the output columns, so the kernel is for small
steps (decode); layers.FUSED_MAX_TOKENS leaves larger ones to the torch path, where three
launches cost little.
Tokens with no adapter (slot -1) cost nothing but their tile's slot check; each row's sums run
in a fixed order, independent of the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher
from tokenmill.kernels.triton.sm_count import num_sms

BLOCK_N = 128
BLOCK_K = 64


# The token count and the runs per program vary from step to step: not specialised on (one variant
# per token tile instead of one per token count's divisibility).
@triton.jit(do_not_specialize=["num_tokens", "column_runs"])
def _lora_update_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, slots_ptr,
    num_tokens, out_features, in_features, column_runs,
    stride_x, stride_a, stride_b, stride_y,
    NUM_SLOTS: tl.constexpr, NUM_SUBLAYERS: tl.constexpr, RANK: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=-1)
    # Column c of a slot's low-rank activations: sublayer c // RANK, rank c % RANK (WIDTH pads
    # NUM_SUBLAYERS * RANK to a power of two of at least 16, as tl.dot needs).
    c = tl.arange(0, WIDTH)
    c_ok = c < NUM_SUBLAYERS * RANK
    ks = tl.arange(0, BLOCK_K)
    first_run = tl.program_id(1) * column_runs
    for s in range(NUM_SLOTS):
        mine = slots == s
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            rows_a = ((c // RANK) * NUM_SLOTS + s) * RANK + c % RANK
            t = tl.zeros((BLOCK_T, WIDTH), dtype=tl.float32)
            for k in range(0, in_features, BLOCK_K):
                kk = k + ks
                x = tl.load(x_ptr + tokens[:, None] * stride_x + kk[None, :],
                            mask=token_ok[:, None] & (kk[None, :] < in_features), other=0.0)
                a = tl.load(a_ptr + rows_a[None, :] * stride_a + kk[:, None],
                            mask=c_ok[None, :] & (kk[:, None] < in_features), other=0.0)
                t = tl.dot(x, a, t, input_precision=DOT_PRECISION)
            # Rounded to the model dtype before the expand, as the torch path's shrink output is. Rows
            # of tokens on other slots are made too, but never stored.
            t = t.to(y_ptr.dtype.element_ty)
            for run in range(column_runs):
                cols = (first_run + run) * BLOCK_N + tl.arange(0, BLOCK_N)
                col_ok = cols < out_features
                b = tl.load(b_ptr + cols[None, :] * stride_b + rows_a[:, None],
                            mask=c_ok[:, None] & col_ok[None, :], other=0.0)
                where = y_ptr + tokens[:, None] * stride_y + cols[None, :]
                keep = (token_ok & mine)[:, None] & col_ok[None, :]
                y = tl.load(where, mask=keep, other=0.0)
                tl.store(where, (y.to(tl.float32) + tl.dot(t, b, input_precision=DOT_PRECISION)).to(y_ptr.dtype.element_ty), mask=keep)


def _launch_shape(num_tokens: int, out_features: int, sms: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_T, column runs per program, grid): a program takes several runs of BLOCK_N columns
    (fewer shrinks made again) as long as the grid still fills every SM once."""
    block_t = 16 if num_tokens <= 16 else 64
    token_tiles = triton.cdiv(num_tokens, block_t)
    column_tiles = triton.cdiv(out_features, BLOCK_N)
    runs = 1
    while runs < 8 and token_tiles * triton.cdiv(column_tiles, runs * 2) >= sms:
        runs *= 2
    return block_t, runs, (token_tiles, triton.cdiv(column_tiles, runs))


def lora_update_(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                 num_slots: int, num_sublayers: int, rank: int, compile_only: bool = False) -> torch.Tensor:
    """y[t] += x[t] A_s^T B_s^T with s = token_slots[t] (-1: nothing), in place; returns y.

    x [T, in], y [T, out] contiguous rows; a [J S R, in], b [out, J S R] as layers.LoRAUpdate keeps them."""
    num_tokens, in_features = x.shape
    out_features = y.shape[1]
    block_t, runs, grid = _launch_shape(num_tokens, out_features, num_sms(x.device))
    width = max(16, triton.next_power_of_2(num_sublayers * rank))
    launcher(_lora_update_kernel, grid, compile_only)(
        x, a, b, y, token_slots, num_tokens, out_features, in_features, runs,
        x.stride(0), a.stride(0), b.stride(0), y.stride(0),
        NUM_SLOTS=num_slots, NUM_SUBLAYERS=num_sublayers, RANK=rank, WIDTH=width,
        BLOCK_T=block_t, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=2,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 models: full fp32 products
    )
    return y
