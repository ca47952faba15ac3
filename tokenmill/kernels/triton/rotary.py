"""Rotary position embedding (GPT-NeoX / HF ``rotate_half`` style) applied to q and k in place
(twin: ``reference.rotary_embedding_ref_``).

One program per token rotates all its query heads and key heads, so the token's cos/sin row is
read once for both. The cache row of position p is ``[cos(p * f_0..f_{h-1}), sin(p * f_0..)]``
with h = rotary_dim / 2 (vLLM's layout); dims past rotary_dim (partial rotary) are untouched.
Arithmetic is fp32 with one rounding per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(base_ptr, num_heads, stride_head, cos, sin, HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HALF_P)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    first = base_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_k_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cs_pos,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    Q_HEADS_P: tl.constexpr,
    K_HEADS_P: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_P)
    row = cos_sin_ptr + pos * stride_cs_pos
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    token64 = token.to(tl.int64)
    _rotate_heads(q_ptr + token64 * stride_q_tok, num_q_heads, stride_q_head, cos, sin, HALF, HALF_P, Q_HEADS_P)
    _rotate_heads(k_ptr + token64 * stride_k_tok, num_k_heads, stride_k_head, cos, sin, HALF, HALF_P, K_HEADS_P)


def rotary_embedding_(
    positions: torch.Tensor,  # [T] int32/int64
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous; rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous; rotated in place
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], cos half then sin half (fp32 advised)
) -> None:
    """Apply NeoX-style rope to q and k in place at the given positions (views of qkv are fine)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must be [T, heads, head_dim] with equal T and head_dim, got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dimension")
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > q.shape[2]:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim] with even rotary_dim <= head_dim {q.shape[2]}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")
    if q.shape[0] == 0:
        return
    half = rotary_dim // 2
    _rotary_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos_sin_cache,
        q.shape[1],
        k.shape[1],
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        HALF=half,
        HALF_P=triton.next_power_of_2(half),
        Q_HEADS_P=triton.next_power_of_2(q.shape[1]),
        K_HEADS_P=triton.next_power_of_2(k.shape[1]),
        num_warps=4,
    )
