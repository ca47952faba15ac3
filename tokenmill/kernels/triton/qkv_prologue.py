"""Everything between the fused qkv projection and paged attention, in one kernel (twin:
``reference.qkv_prologue_ref``).

Unfused, a decoder layer runs after its qkv GEMM: q_norm and k_norm (Qwen3's per-head RMSNorm),
a copy of v (a strided slice of the GEMM output), rotary on q and k, and the cache store of k and
v: five launches that each move a few megabytes at most. On a GPU decode step those launches,
not the bytes, are the cost, 28 layers over. This kernel reads the qkv output once and
- q heads: optional RMSNorm, rotary, written to a contiguous ``[T, num_heads, head_dim]`` q;
- k heads: optional RMSNorm, rotary, stored straight into the paged cache at the token's slot;
- v heads: stored into the cache at the same slot.
A slot of -1 (a padding token of a CUDA-graph batch) stores nothing; its q row is still computed.

Rounding happens at the same points as in the unfused kernels (``rmsnorm.py``, ``rotary.py``,
``kv_store.py``): fp32 statistics, the normalised row rounded to the model dtype, times the
weight and rounded again; rotary in fp32 on those rounded values, rounded once; k and v cast to
the cache dtype last.

Grid: (token, head group). A head group is up to 2048 elements of q heads, k heads or v heads
(16 heads of 128), so each program moves one contiguous run of the token's row and the three
kinds get their own programs (the k/v ones check the slot and leave at once for padding). A
Qwen3-0.6B decode step (256 tokens, 16 q / 8 kv heads) is 768 programs; a 16K-token prefill
chunk 48K programs of 4 KB each. The grid depends only on shapes, so it is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.kv_store import cast_for_cache

_MAX_GROUP_ELEMENTS = 2048  # elements of one program's head group (about 16 per thread, 4 warps)


@triton.jit
def _norm_rope_store(
    src,  # [heads, HALF_P] pointers to the first halves of the heads in the qkv row
    dst,  # same shape, into the q output or the k cache
    mask,
    w_ptr,
    cos_sin_row,  # this token's row of the cos/sin cache
    eps,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr,
):
    """Optional per-head RMSNorm, then NeoX rotary, of heads split in halves; stores both halves."""
    HALF: tl.constexpr = HEAD_DIM // 2
    DTYPE: tl.constexpr = src.dtype.element_ty
    dims = tl.arange(0, HALF_P)
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        # HF rounds the normalised row to the model dtype before the weight, then the product;
        # rotary then reads those rounded values (rms_norm_ref, then rotary_embedding_ref_).
        x1 = (w1 * (x1 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    cos = tl.load(cos_sin_row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    # One rounding to the model dtype (as the in-place rotary does), then to the destination's.
    tl.store(dst, cast_for_cache((x1 * cos - x2 * sin).to(DTYPE), dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, cast_for_cache((x2 * cos + x1 * sin).to(DTYPE), dst.dtype.element_ty), mask=mask)


@triton.jit
def _qkv_prologue_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    num_kv_heads,
    eps,
    stride_qkv_tok,
    stride_q_out_tok,
    stride_cs_pos,
    stride_c_blk,
    stride_c_tok,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr,
    Q_GROUP: tl.constexpr,
    KV_GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)  # q groups first, then k groups, then v groups
    num_q_groups = tl.cdiv(num_heads, Q_GROUP)
    num_kv_groups = tl.cdiv(num_kv_heads, KV_GROUP)
    row = qkv_ptr + token * stride_qkv_tok
    dims = tl.arange(0, HALF_P)
    if group < num_q_groups:
        heads = group * Q_GROUP + tl.arange(0, Q_GROUP)
        mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
        offs = heads[:, None] * HEAD_DIM + dims[None, :]
        cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_cs_pos
        dst = q_out_ptr + token * stride_q_out_tok + offs
        _norm_rope_store(row + offs, dst, mask, q_weight_ptr, cos_sin_row, eps, HAS_NORM, HEAD_DIM, HALF_P)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # -1: a padding token, which must not touch the cache
            is_v = group >= num_q_groups + num_kv_groups
            heads = (group - num_q_groups - is_v.to(tl.int32) * num_kv_groups) * KV_GROUP + tl.arange(0, KV_GROUP)
            mask = (heads < num_kv_heads)[:, None] & (dims < HALF)[None, :]
            # The cache row [num_kv_heads, head_dim] of one slot is contiguous (checked by the wrapper).
            dst = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_tok + heads[:, None] * HEAD_DIM + dims[None, :]
            src = row + (num_heads + heads[:, None]) * HEAD_DIM + dims[None, :]
            if is_v:
                src += num_kv_heads * HEAD_DIM
                v_ty = v_cache_ptr.dtype.element_ty
                tl.store(v_cache_ptr + dst, cast_for_cache(tl.load(src, mask=mask), v_ty), mask=mask)
                tl.store(v_cache_ptr + dst + HALF, cast_for_cache(tl.load(src + HALF, mask=mask), v_ty), mask=mask)
            else:
                cos_sin_row = cos_sin_ptr + tl.load(positions_ptr + token).to(tl.int64) * stride_cs_pos
                _norm_rope_store(src, k_cache_ptr + dst, mask, k_weight_ptr, cos_sin_row, eps, HAS_NORM, HEAD_DIM, HALF_P)


def _group_heads(num_heads: int, head_dim: int) -> int:
    """Heads per program: all of them up to ~2048 elements (a power of two, at least 1)."""
    return max(1, min(triton.next_power_of_2(num_heads), _MAX_GROUP_ELEMENTS // triton.next_power_of_2(head_dim)))


def qkv_prologue(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], last dim contiguous
    positions: torch.Tensor,  # [T] int32/int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos half then sin half (fp32 advised)
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32/int64, -1 = padding token, not stored
    num_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]; give both norm weights or neither
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], contiguous
) -> torch.Tensor:
    """Norm (optional), rope and cache-store of one layer's qkv output; returns q ``[T, num_heads, head_dim]``.

    ``num_kv_heads`` and ``head_dim`` are read from ``kv_cache``; the rotary dim must be the whole
    head (the models reject partial rotary). Graph-safe: no host sync, grid from shapes only.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [T, {width}] (({num_heads} + 2 * {num_kv_heads}) heads of {head_dim}) with a contiguous "
            f"last dim, got {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    if kv_cache.stride()[2:] != (num_kv_heads * head_dim, head_dim, 1):
        raise ValueError("each kv_cache slot must be one contiguous [num_kv_heads, head_dim] row")
    tokens = qkv.shape[0]
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise ValueError(f"positions and slot_mapping must be [{tokens}], got {tuple(positions.shape)}, {tuple(slot_mapping.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1 or head_dim % 2:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_dim}] (even, full rotary), got {tuple(cos_sin_cache.shape)}")
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None and k_norm_weight is not None:
        if q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,):
            raise ValueError(f"norm weights must be [{head_dim}], got {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)}")
    if out is None:
        out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (tokens, num_heads, head_dim) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{tokens}, {num_heads}, {head_dim}], got {tuple(out.shape)}")
    if tokens == 0:
        return out
    q_group = _group_heads(num_heads, head_dim)
    kv_group = _group_heads(num_kv_heads, head_dim)
    groups = triton.cdiv(num_heads, q_group) + 2 * triton.cdiv(num_kv_heads, kv_group)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _qkv_prologue_kernel[(tokens, groups)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if q_norm_weight is not None else cos_sin_cache,  # unread without HAS_NORM
        k_norm_weight if k_norm_weight is not None else cos_sin_cache,
        out,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        eps,
        qkv.stride(0),
        out.stride(0),
        cos_sin_cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        HAS_NORM=has_norm,
        HEAD_DIM=head_dim,
        HALF_P=triton.next_power_of_2(head_dim // 2),
        Q_GROUP=q_group,
        KV_GROUP=kv_group,
        BLOCK_SIZE=block_size,
        num_warps=4 if max(q_group, kv_group) * head_dim >= 1024 else 2,
    )
    return out
