"""Attention over whole prompts packed without padding and without a KV cache (twin:
``reference.varlen_attention_ref``): the attention of pooling models.

A pooling step computes every prompt whole and keeps nothing, so q, k and v come straight from
the layer's projection: ``[T, heads, head_dim]`` tensors holding the tokens of B sequences side
by side, sequence i owning rows ``cu_seqlens[i]:cu_seqlens[i+1]``. Each sequence attends only to
itself, bidirectionally (BERT) or causally (decoders used as embedders or classifiers; the
``CAUSAL`` constexpr). There is no padding anywhere: no token computes or stores for another's
length, and no ``[B, L, L]`` mask exists.

How the work is cut (grid = (B * blocks per sequence, kv heads)):
- Query blocks. Each sequence's tokens are cut into blocks of BLOCK_Q; program ``pid`` is block
  ``pid % n`` of sequence ``pid // n``, with ``n = cdiv(max_seqlen, BLOCK_Q)`` from the host's
  bound, so finding its sequence is one division (no search over ``cu_seqlens``). Blocks past a
  shorter sequence's end exit at once. Within a sequence the blocks run last first: in causal mode
  the last block has the most keys, and starting it first shortens the tail of the launch.
- GQA packing. The ``group`` query heads that share a kv head are stacked with the block's tokens
  into the M rows of the score tile (row = token * GROUP_P + head), so each K/V tile is read once
  per kv head and serves the whole group, as in ``paged_attention.py``.
- Masking only where needed. Key tiles that every row of the block sees whole (below the causal
  diagonal, or inside the sequence for bidirectional attention) run without a mask; only the
  tiles on the diagonal or across the sequence's end pay for ``where``.
Softmax is the online (flash) form in fp32, with exp2 and the scale folded into log2(e). Tile
shapes depend on the heads and dtype only, never on lengths, so one compiled variant serves every
step of a model (a variant first met mid-run would stall it for a second or so).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

_LOG2E = 1.4426950408889634


@triton.jit
def _load_keys(ptrs, key, dims, seq_len, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr):
    """A [TILE_N, HEAD_DIM_P] tile of keys or values; zeros past the sequence (MASKED) and past head_dim."""
    if MASKED:
        return tl.load(ptrs, mask=(key < seq_len)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM == HEAD_DIM_P:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _attend_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_base,  # this sequence's first key row, this kv head
    v_base,
    stride_k_tok,
    stride_v_tok,
    row_tok,  # [BLOCK_M] each row's token within the sequence
    key_lo,
    key_hi,  # keys [key_lo, key_hi) in steps of TILE_N; key_hi may pass seq_len only when MASKED
    seq_len,
    scale_log2,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over a run of key tiles; MASKED tiles hide keys a row may not see."""
    cols = tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM_P)
    for start in range(key_lo, key_hi, TILE_N):
        key = start + cols
        k = _load_keys(k_base + key[:, None] * stride_k_tok + dims[None, :], key, dims, seq_len, MASKED, HEAD_DIM, HEAD_DIM_P)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            if CAUSAL:
                visible = key[None, :] <= row_tok[:, None]
            else:
                visible = (key < seq_len)[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_keys(v_base + key[:, None] * stride_v_tok + dims[None, :], key, dims, seq_len, MASKED, HEAD_DIM, HEAD_DIM_P)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Nothing that changes between steps is specialised on (Triton would compile a variant for 1, for
# multiples of 16 and for the rest of each int), so one variant per model serves every step.
@triton.jit(do_not_specialize=["blocks_per_seq"])
def _varlen_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    blocks_per_seq,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = pid // blocks_per_seq
    block = blocks_per_seq - 1 - pid % blocks_per_seq  # last block first (it has the most keys)
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    q_first = block * BLOCK_Q
    if q_first >= seq_len:
        return  # a block past this sequence's end

    # Row r of the score tile is token q_first + r // GROUP_P, head r % GROUP_P of the group.
    rows = tl.arange(0, BLOCK_M)
    row_tok = q_first + rows // GROUP_P
    row_head = kv_head * GROUP + rows % GROUP_P
    row_ok = (rows // GROUP_P < BLOCK_Q) & (row_tok < seq_len) & (rows % GROUP_P < GROUP)
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM
    token = (seq_start + row_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + row_head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    # Keys [0, full_end) are visible to every row of the block; [full_end, kv_end) need the mask.
    if CAUSAL:
        kv_end = tl.minimum(q_first + BLOCK_Q, seq_len)
        full_end = ((q_first + 1) // TILE_N) * TILE_N  # tiles wholly at or below the block's first row
    else:
        kv_end = seq_len
        full_end = (seq_len // TILE_N) * TILE_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    seq_off = seq_start.to(tl.int64)
    k_base = k_ptr + seq_off * stride_k_tok + kv_head * stride_k_head
    v_base = v_ptr + seq_off * stride_v_tok + kv_head * stride_v_head
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_k_tok, stride_v_tok, row_tok, 0, full_end, seq_len, scale_log2,
        False, CAUSAL, HEAD_DIM, HEAD_DIM_P, TILE_N, DOT_PRECISION,
    )
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_k_tok, stride_v_tok, row_tok, full_end, kv_end, seq_len, scale_log2,
        True, CAUSAL, HEAD_DIM, HEAD_DIM_P, TILE_N, DOT_PRECISION,
    )
    # Every real row saw at least one key (itself, or the whole sequence), so l_i > 0 there; the
    # guard keeps padded rows at 0 instead of NaN.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_tok + row_head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@dataclass(frozen=True)
class VarlenAttentionConfig:
    """Tile shapes of one launch. Any values give the same result; they only change speed."""

    block_q: int  # query tokens per program (power of two)
    tile_n: int  # keys per inner-loop step (power of two, >= 16)
    num_warps: int
    num_stages: int


def choose_config(*, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> VarlenAttentionConfig:
    """Tile shapes from the heads and dtype alone (one compiled variant per model).

    bf16/fp16: 128-row score tiles (64 for head_dim > 128): with 8 warps each of the two
    warpgroups issues wgmma on its own 64 rows, the usual flash-attention shape on Hopper; 64-key tiles
    (32 past head_dim 128) three stages deep: K and V tiles of 64 x 128 bf16 are 16 KB each, so
    the pipeline and the q tile stay well under the 227 KB of shared memory. The GQA group shares
    the rows, so a Qwen3 block (group 2) is 64 tokens. fp32 (tests only: FMA dots) keeps 16 x 16.
    """
    group_p = triton.next_power_of_2(num_heads // num_kv_heads)
    dim_p = _padded_head_dim(head_dim)
    if dtype == torch.float32:
        return VarlenAttentionConfig(block_q=max(1, 16 // group_p), tile_n=16, num_warps=4, num_stages=2)
    rows = 128 if dim_p <= 128 else 64
    return VarlenAttentionConfig(
        block_q=max(1, rows // group_p),
        tile_n=64 if dim_p <= 128 else 32,
        num_warps=8 if dim_p >= 128 else 4,
        num_stages=3 if dim_p <= 128 else 2,
    )


def _padded_head_dim(head_dim: int) -> int:
    # A power of two for tl.arange, and >= 16 for tensor-core dots (tiny test models have 8).
    return max(16, triton.next_power_of_2(head_dim))


def _check_heads(x: torch.Tensor, name: str, tokens: int, head_dim: int) -> None:
    if x.dim() != 3 or x.shape[0] != tokens or x.shape[2] != head_dim or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [{tokens}, heads, {head_dim}] with a contiguous last dim, got shape {tuple(x.shape)} "
            f"strides {x.stride()}"
        )


def varlen_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous (strided views of a qkv output are fine)
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [B + 1] int32, cu_seqlens[0] == 0, non-decreasing
    scale: float,
    *,
    causal: bool,
    max_seqlen: int,
    out: torch.Tensor | None = None,
    config: VarlenAttentionConfig | None = None,
    compile_only: bool = False,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype
    """Each sequence's tokens attend to that sequence alone: all of it, or causally.

    ``max_seqlen`` is a host-side upper bound on every sequence's length (it sizes the grid; the
    kernel reads the true lengths from ``cu_seqlens``, so the launch never syncs). Rows of tokens
    at or past ``cu_seqlens[B]`` are not written. Query head h reads kv head
    ``h // (num_heads // num_kv_heads)`` (GQA as in HF ``repeat_kv``). ``config`` overrides the
    tile shapes (benchmarks, tests); ``compile_only`` compiles what the call would launch and
    launches nothing (``precompile.py``).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {tuple(q.shape)}")
    tokens, num_heads, head_dim = q.shape
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_heads(x, name, tokens, head_dim)
    num_kv_heads = k.shape[1]
    if v.shape[1] != num_kv_heads or num_heads % num_kv_heads:
        raise ValueError(f"k and v need the same number of heads, dividing q's {num_heads}; got {k.shape[1]} and {v.shape[1]}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in 1..256, got {head_dim}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one of float16, bfloat16, float32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be a 1-D int32 tensor [B + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if out is None:
        out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be [{tokens}, {num_heads}, {head_dim}] {q.dtype} with a contiguous last dim")
    num_seqs = cu_seqlens.shape[0] - 1
    if tokens == 0 or num_seqs == 0 or max_seqlen <= 0:
        return out
    if config is None:
        config = choose_config(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=q.dtype)
    if config.tile_n < 16 or config.tile_n & (config.tile_n - 1) or config.block_q < 1 or config.block_q & (config.block_q - 1):
        raise ValueError(f"tile_n must be a power of two >= 16 and block_q a power of two, got {config}")
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    blocks_per_seq = triton.cdiv(max_seqlen, config.block_q)
    if num_seqs * blocks_per_seq >= 2**31:
        raise ValueError(f"{num_seqs} sequences of up to {max_seqlen} tokens make too many query blocks for one launch")
    launcher(_varlen_attention_kernel, (num_seqs * blocks_per_seq, num_kv_heads), compile_only)(
        q,
        k,
        v,
        out,
        cu_seqlens,
        blocks_per_seq,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        CAUSAL=causal,
        GROUP=group,
        GROUP_P=group_p,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=_padded_head_dim(head_dim),
        BLOCK_Q=config.block_q,
        BLOCK_M=max(16, config.block_q * group_p),  # tl.dot needs >= 16 rows on tensor cores
        TILE_N=config.tile_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
