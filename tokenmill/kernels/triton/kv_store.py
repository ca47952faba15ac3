"""Write the new tokens' keys and values into the paged KV cache (twin: ``reference.store_kv_ref``).

One program per token: it reads the token's slot, and copies all its kv heads for k and v at
once. A slot of -1 marks a padding token of a CUDA-graph batch and is skipped, so the runner can
pad a decode batch to the captured size without touching anybody's cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


_FP8_E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def cast_for_cache(x, CACHE_DTYPE: tl.constexpr):
    """x in the cache's dtype. A float8 e4m3 cache saturates at +-448, as the twin and the torch
    backend do (torch's own cast gives NaN past it on some versions: 2.11 on CUDA does)."""
    if CACHE_DTYPE == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -_FP8_E4M3_MAX, _FP8_E4M3_MAX)
    return x.to(CACHE_DTYPE)


@triton.jit
def _kv_store_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    HEADS_P: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    src_k = k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :]
    src_v = v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :]
    dst = block * stride_c_blk + offset * stride_c_tok + heads[:, None] * stride_c_head + dims[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(k_cache_ptr + dst, cast_for_cache(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, cast_for_cache(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], last dim contiguous (a view of qkv is fine)
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = padding token, not stored
) -> None:
    """Store k and v of T tokens in their cache slots (cast to the cache dtype). Graph-safe."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [T, num_kv_heads, head_dim], got {tuple(k.shape)} and {tuple(v.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {k.shape[1]}, {k.shape[2]}], got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last (head_dim) dimension")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _kv_store_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim),
        HEADS_P=triton.next_power_of_2(num_kv_heads),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
