"""The pieces that every paged attention kernel is built from (``paged_attention.py``,
``paged_attention_deterministic.py`` and ``paged_attention_queue.py``): which sequence, query rows
and key range a program serves, the online softmax of its rows over a run of key tiles, and the
store of a finished (normalised) or partial (unnormalised) result. Each is a ``@triton.jit``
function, inlined into the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, block_id, BLOCK_Q: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Index of the last sequence whose first query block is <= block_id (vectorised count, not a
    binary search: one wide load instead of log2(B) dependent round trips to memory)."""
    count = tl.zeros((), dtype=tl.int32)
    for base in range(0, num_seqs, SEARCH_BLOCK):
        idx = base + 1 + tl.arange(0, SEARCH_BLOCK)  # sequence indices 1..B
        in_range = idx <= num_seqs
        starts = tl.load(query_start_loc_ptr + idx, mask=in_range, other=0)
        if BLOCK_Q == 1:
            first_block = starts
        else:
            first_block = starts // BLOCK_Q + idx
        count += tl.sum((in_range & (first_block <= block_id)).to(tl.int32), axis=0)
    return tl.minimum(count, num_seqs - 1)


@triton.jit
def _locate_rows(
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    block_id,
    kv_head,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
):
    """The sequence, query rows and key range of one program's query block.

    Row r of the score tile is query token ``q_first + r // GROUP_P``, head ``r % GROUP_P`` of the
    group. The caller returns at once when ``q_first >= query_len`` (a spare program of the grid).
    """
    seq = _find_sequence(query_start_loc_ptr, num_seqs, block_id, BLOCK_Q, SEARCH_BLOCK)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if BLOCK_Q == 1:
        first_block = q_start
    else:
        first_block = q_start // BLOCK_Q + seq
    q_first = (block_id - first_block) * BLOCK_Q  # first query of this block, within the sequence
    cached_len = tl.load(seq_lens_ptr + seq) - query_len  # keys that were in the cache before this step
    rows = tl.arange(0, BLOCK_M)
    row_tok = q_first + rows // GROUP_P
    row_head = kv_head * GROUP + rows % GROUP_P
    row_valid = (rows // GROUP_P < BLOCK_Q) & (row_tok < query_len) & (rows % GROUP_P < GROUP)
    row_pos = cached_len + row_tok  # absolute position: the last key this row may see
    token = q_start + row_tok
    # Keys this block needs: up to its last real query's position.
    kv_end = cached_len + tl.minimum(q_first + BLOCK_Q, query_len)
    return seq, q_first, query_len, cached_len, token, row_head, row_valid, row_pos, kv_end


@triton.jit
def _load_rows(q_ptr, token, head, valid, stride_q_tok, stride_q_head, HEAD_DIM: tl.constexpr):
    """q[token, head] of the tile's rows (0 for invalid rows)."""
    dims = tl.arange(0, HEAD_DIM)
    rows = q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head
    return tl.load(rows + dims[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _dot_query(q, scale_log2, FP16_DOTS: tl.constexpr):
    """The query rows as the dots take them.

    ``FP16_DOTS`` (a float8 cache; the host decides, ``paged_attention._fp16_dots``): e4m3 keys and
    values convert to fp16 exactly, one instruction per two (to bf16 it takes one more per value:
    a P1 decode tile's loop ran 781 instructions instead of 1,201 on sm_90), and q is pre-scaled
    into log2 units so that it stays 8-11x further from fp16's 65504 than the raw values (saturated
    there; fp16 keeps 3 more mantissa bits of q than bf16). ``_attend_tiles`` then scales scores
    by 1. Otherwise q stays as it is."""
    if FP16_DOTS:
        q = tl.clamp(q.to(tl.float32) * scale_log2, -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _fp8_to_fp16(x, CONVERT_ASM: tl.constexpr):
    """float8 e4m3 -> fp16 (exact). ``CONVERT_ASM`` (compiled for the GPU, not the interpreter): by
    inline PTX that the compiler may not move, so the conversion happens in the registers the load
    lands in and the tile reaches shared memory as fp16. Converted after shared memory instead (what
    Triton does with a plain ``.to``), the values tile of P @ V, whose reduction runs over keys
    while its bytes run along head_dim, has no 8-bit transposing load on sm_90: it is read byte
    by byte (64 loads a thread a tile) and the kernel needs ~210 registers instead of ~120."""
    if CONVERT_ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4,
        )
    return x.to(tl.float16)


@triton.jit
def _attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    table,  # this sequence's row of the block table
    head_off,
    row_pos,
    kv_end,
    tile_lo,
    tile_hi,
    scale_log2,
    stride_c_blk,
    stride_c_tok,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    DETERMINISTIC: tl.constexpr = False,
    FP16_DOTS: tl.constexpr = False,
    CONVERT_ASM: tl.constexpr = False,
):
    """Online softmax of the tile's rows over key tiles ``tile_lo..tile_hi - 1``, in that order,
    continuing the running max m (log2 units), sum l and unnormalised output acc.

    ``MASKED=False`` is for tiles that every row sees whole (all keys before kv_end and at or before
    each row's position): the loads and scores then carry no masks, and the arithmetic on the keys
    is the same as with them.

    ``DETERMINISTIC``: a tile that a row cannot see leaves its state bit for bit unchanged (the
    rescale is exactly 1 where the max did not move, not left to exp2(0) rounding to 1), so a row
    gets the same bits whether its block runs past its own position (prefill) or not (decode).

    ``FP16_DOTS``: q came from ``_dot_query`` in fp16, pre-scaled (the keys and values follow it
    into fp16). ``CONVERT_ASM``: float8 values convert by inline PTX (``_fp8_to_fp16``).
    """
    cols = tl.arange(0, TILE_N)
    dims = tl.arange(0, HEAD_DIM)
    if FP16_DOTS:
        scale_log2 = 1.0  # q came pre-scaled into log2 units (_dot_query)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + cols
        # An all-true constant mask folds away: the unmasked loads are plain (pipelined) copies.
        key_valid = key_pos < kv_end if MASKED else tl.full([TILE_N], 1, tl.int1)
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        key_off = block * stride_c_blk + (key_pos % BLOCK_SIZE) * stride_c_tok + head_off
        # K is loaded transposed, [HEAD_DIM, TILE_N], straight into the layout of q @ k^T.
        k = tl.load(k_cache_ptr + key_off[None, :] + dims[:, None], mask=key_valid[None, :], other=0.0).to(q.dtype)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        if MASKED:
            # Causality also hides keys past kv_end from real rows, since their row_pos < kv_end.
            qk = tl.where(key_pos[None, :] <= row_pos[:, None], qk, float("-inf"))
        # Scores in log2 units are qk * scale_log2 (> 0, so the row max scales with them); scaling
        # inside the exponent's argument makes it one fused multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2)
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        if DETERMINISTIC:
            alpha = tl.where(m_new == m_i, 1.0, alpha)
        p = tl.exp2(qk * scale_log2 - m_shift[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + key_off[:, None] + dims[None, :], mask=key_valid[:, None], other=0.0)
        if v_cache_ptr.dtype.element_ty == tl.float8e4nv:
            v = _fp8_to_fp16(v, CONVERT_ASM)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _store_normalised(out_ptr, acc, l, token, head, valid, stride_o_tok, stride_o_head, HEAD_DIM: tl.constexpr):
    """out[token, head] = acc / l for the valid rows. A real row saw at least its own key, so l > 0
    there (the guard is for padded rows and malformed padding sequences: 0, not NaN)."""
    dims = tl.arange(0, HEAD_DIM)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=valid[:, None],
    )


@triton.jit
def _store_partial(
    part_acc_ptr, part_m_ptr, part_l_ptr, acc, m, l, token, head, valid, slot,
    stride_pa_tok, stride_pa_head, stride_pa_split, stride_pml_tok, stride_pml_head, HEAD_DIM: tl.constexpr,
):
    """The unnormalised (acc, m, l) of the valid rows, in partial slot ``slot`` (a split or a key part)."""
    dims = tl.arange(0, HEAD_DIM)
    pa = part_acc_ptr + token * stride_pa_tok + head * stride_pa_head + slot * stride_pa_split
    tl.store(pa[:, None] + dims[None, :], acc, mask=valid[:, None])
    pml = token * stride_pml_tok + head * stride_pml_head + slot
    tl.store(part_m_ptr + pml, m, mask=valid)
    tl.store(part_l_ptr + pml, l, mask=valid)
