"""Deterministic mode's paged attention: a row's keys cut into fixed parts from key 0, merged in order.

``paged_attention.py`` launches these kernels when its config has ``part_keys > 0`` (see
``_paged_attention_fixed_split_kernel``); they share the tile loop and the stores with the default
kernel (``paged_attention_tiles.py``) and differ in how a row's keys are cut and merged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels.triton.paged_attention_tiles import (
    _attend_tiles,
    _dot_query,
    _find_sequence,
    _load_rows,
    _locate_rows,
    _store_normalised,
    _store_partial,
)


@triton.jit
def _merge_part(m_run, l_run, acc_run, m, l, acc):
    """Fold one key part's (m, l, acc) into the running (m, l, acc) of its rows, in fp32.

    The one merge rule of the fixed-split kernels: the attention kernel applies it part after part
    in registers, the merge kernel to parts read back from memory, and both must round alike. So
    the two products-and-sums are explicit fma's (no contraction left to the compiler), and an
    empty part (m -inf, l 0, acc 0) leaves a row that has seen a key bit for bit unchanged.
    """
    m_new = tl.maximum(m_run, m)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.where(m_run == m_new, 1.0, tl.exp2(m_run - m_shift))  # exactly 1 where the max stays (as in _attend_tiles)
    b = tl.where(m == m_new, 1.0, tl.exp2(m - m_shift))
    l_new = tl.fma(l_run, a, l * b)
    acc_new = tl.fma(acc_run, a[:, None], acc * b[:, None])
    return m_new, l_new, acc_new


# The part slots of the partial buffers follow max_seq_len, so their strides change between launches.
_PART_STRIDES = ["stride_pa_tok", "stride_pa_head", "stride_pml_tok", "stride_pml_head"]


@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq", "split_programs", *_PART_STRIDES])
def _paged_attention_fixed_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    split_programs,
    scale_log2,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_tok,
    stride_c_head,
    stride_bt_seq,
    stride_pa_tok,
    stride_pa_head,
    stride_pa_split,
    stride_pml_tok,
    stride_pml_head,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    PART_TILES: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
    ONE_PROGRAM: tl.constexpr,  # split_programs == 1, known when compiling
):
    """Deterministic mode: a row's keys are cut into parts of PART_TILES * TILE_N keys from key 0,
    each part is an online softmax over its tiles in order, and the parts are merged in order by
    ``_merge_part``; so a row's bits depend only on its own position and keys, not on the batch,
    the launch's parallelism (``split_programs``) or whether it is decoded or prefilled.

    With one program per block (``split_programs == 1``, compiled as ``ONE_PROGRAM``) it merges its
    parts in registers and writes the output. With more, program ``split`` does parts split,
    split + split_programs, ... and writes each one's (m, l, acc) for ``_merge_parts_kernel``, which
    merges them the same way.
    Parts past a row's own position are empty for that row (a prefill block's later rows need
    them), and merging an empty part changes nothing.
    """
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_first, query_len, _, token, row_head, row_valid, row_pos, kv_end = _locate_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, block_id, kv_head, GROUP, GROUP_P, BLOCK_Q, BLOCK_M, SEARCH_BLOCK
    )
    if q_first >= query_len:
        return  # a spare program of the static grid
    q = _load_rows(q_ptr, token, row_head, row_valid, stride_q_tok, stride_q_head, HEAD_DIM)
    q = _dot_query(q, scale_log2, FP16_DOTS)
    table = block_tables_ptr + seq * stride_bt_seq
    num_tiles = tl.cdiv(kv_end, TILE_N)
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_run = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # ONE_PROGRAM is a compile-time variant: with a run-time part stride and the partial-store path
    # compiled in, the decode launch needed 197 registers a thread (2 blocks an SM) instead of 156
    # (3), on a memory-bound kernel (issue 21). Both variants run the same tile loop and merge.
    first_part, part_stride = split, split_programs
    if ONE_PROGRAM:
        first_part, part_stride = 0, 1
    for part in range(first_part, tl.cdiv(num_tiles, PART_TILES), part_stride):
        tile_lo = part * PART_TILES
        # Each part starts a fresh online softmax; every tile stays masked (one code path for all).
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m, l, acc = _attend_tiles(
            q, m, l, acc, k_cache_ptr, v_cache_ptr, table, kv_head * stride_c_head, row_pos, kv_end,
            tile_lo, tl.minimum(tile_lo + PART_TILES, num_tiles), scale_log2, stride_c_blk, stride_c_tok,
            HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, MASKED=True, DETERMINISTIC=True,
            FP16_DOTS=FP16_DOTS, CONVERT_ASM=CONVERT_ASM,
        )
        if ONE_PROGRAM:
            m_run, l_run, acc_run = _merge_part(m_run, l_run, acc_run, m, l, acc)
        else:
            _store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, acc, m, l, token, row_head, row_valid, part,
                           stride_pa_tok, stride_pa_head, stride_pa_split, stride_pml_tok, stride_pml_head, HEAD_DIM)
    if ONE_PROGRAM:
        _store_normalised(out_ptr, acc_run, l_run, token, row_head, row_valid, stride_o_tok, stride_o_head, HEAD_DIM)


@triton.jit(do_not_specialize=["num_seqs", *_PART_STRIDES])
def _merge_parts_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    num_seqs,
    stride_o_tok,
    stride_o_head,
    stride_pa_tok,
    stride_pa_head,
    stride_pa_split,
    stride_pml_tok,
    stride_pml_head,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PART_KEYS: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
):
    """One token's heads of one kv head: merge its parts 0, 1, ... up to its own position, in order."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding past the last real token: leave the output alone
    seq = _find_sequence(query_start_loc_ptr, num_seqs, token, 1, SEARCH_BLOCK)
    position = tl.load(seq_lens_ptr + seq) - tl.load(query_start_loc_ptr + seq + 1) + token
    heads = kv_head * GROUP + tl.arange(0, GROUP_P)
    valid = tl.arange(0, GROUP_P) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    m_run = tl.full([GROUP_P], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([GROUP_P], dtype=tl.float32)
    acc_run = tl.zeros([GROUP_P, HEAD_DIM], dtype=tl.float32)
    for part in range(0, position // PART_KEYS + 1):
        pml = token * stride_pml_tok + heads * stride_pml_head + part
        m = tl.load(part_m_ptr + pml, mask=valid, other=float("-inf"))
        l = tl.load(part_l_ptr + pml, mask=valid, other=0.0)
        pa = part_acc_ptr + token * stride_pa_tok + heads * stride_pa_head + part * stride_pa_split
        acc = tl.load(pa[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        m_run, l_run, acc_run = _merge_part(m_run, l_run, acc_run, m, l, acc)
    _store_normalised(out_ptr, acc_run, l_run, tl.full([GROUP_P], token, tl.int32), heads, valid, stride_o_tok, stride_o_head,
                      HEAD_DIM)
