"""Decode attention of many sequences as a queue of (sequence, kv head) items, longest contexts first:
a large pure decode step, or the leading decodes of a mixed step (the prefill launch takes the rest).

The default decode launch has one program per (sequence, kv head) and split, dispatched in grid
order, so a step of ragged contexts ends with a few long programs running while most SMs idle:
6-9% of the attention time at P1's batch sizes (docs/perf.md 43). Here a fixed number of programs
(a few an SM) take items from one counter until none are left; the sequences are ranked by context
length, longest first, so the items that finish last are the short ones. Each item is one
sequence's whole context for one kv head: nothing is split and nothing merged, so a sequence's
result is computed exactly as the unsplit default launch computes it.

It pays only when there are several items an SM to balance (``queue_pays``; docs/perf.md 44: over
a bf16 cache 8-9% faster than the default launch at 96-128 sequences of 8 kv heads, 5-7% at
192-256, 7% on P5's long contexts, but 6-9% slower at 48-64, where the default's key splits fill
the GPU and the queue cannot; over an fp8 cache 4-18% faster at 128-256 sequences, slower below).

``decode_order`` ranks the sequences once per step (one small kernel, no host sync); every layer's
launch reuses the order. The last program to leave resets the counter, so one counter serves every
launch and every CUDA-graph replay. Twin: ``reference.paged_attention_ref`` on decode batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.paged_attention_tiles import _attend_tiles, _dot_query, _load_rows, _store_normalised

_LOG2E = 1.4426950408889634
_RANK_BLOCK = 64
# Warps an SM the queue's programs fill: 4 programs of the bf16 tile (2 warps, 230 registers a
# thread on sm_90), 8 of the fp8 tile (1 warp, 246 registers; shared memory lets 7 stay resident).
WARPS_PER_SM = 8
# (sequence, kv head) items an SM from which the queue beats the default launch, by the cache's
# bytes a value (kernels_bench --queue-sweep: bf16 from 5.8 items an SM, fp8 from 7.8; 3.9 and
# 5.8 lose over fp8, 3.9 over bf16).
MIN_ITEMS_PER_SM = {2: 5, 1: 7}


def queue_pays(num_seqs: int, num_kv_heads: int, cache_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``num_seqs`` decode rows (a graph bucket counts its padding rows) should run on the
    queue rather than the default decode launch."""
    from tokenmill.kernels.triton.sm_count import num_sms

    min_items = MIN_ITEMS_PER_SM.get(cache_dtype.itemsize)
    return min_items is not None and num_seqs * num_kv_heads >= min_items * num_sms(device)


def launch_shape(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(tile_n, num_warps, num_stages, programs an SM): the default decode launch's tile
    (``paged_attention_config``), as many programs as fill ``WARPS_PER_SM``."""
    from tokenmill.kernels.triton.paged_attention_config import _config

    group_p = 1  # decode tiles do not depend on the group (16 rows hold any group up to 16)
    config = _config(1, 1, group_p, head_dim, dtype, cache_dtype)
    return config.tile_n, config.num_warps, config.num_stages, max(1, WARPS_PER_SM // config.num_warps)


@triton.jit(do_not_specialize=["num_seqs"])
def _rank_kernel(seq_lens_ptr, order_ptr, num_seqs, BLOCK: tl.constexpr):
    """order[rank] = sequence, where a sequence's rank is the number of sequences before it in
    longest-first order (ties by index): a block of sequences a program, compared with all."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i_valid = i < num_seqs
    len_i = tl.load(seq_lens_ptr + i, mask=i_valid, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_seqs, BLOCK):
        j = start + tl.arange(0, BLOCK)
        len_j = tl.load(seq_lens_ptr + j, mask=j < num_seqs, other=-1)  # -1: never before anyone
        before = (len_j[None, :] > len_i[:, None]) | ((len_j[None, :] == len_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, i, mask=i_valid)


def decode_order(seq_lens: torch.Tensor, *, compile_only: bool = False) -> torch.Tensor:
    """The step's sequences, longest context first (ties by index): int32 [B]."""
    from tokenmill.kernels.triton.precompile import launcher

    order = torch.empty_like(seq_lens, dtype=torch.int32)
    num_seqs = seq_lens.shape[0]
    launcher(_rank_kernel, (triton.cdiv(num_seqs, _RANK_BLOCK),), compile_only)(
        seq_lens, order, num_seqs, BLOCK=_RANK_BLOCK, num_warps=4
    )
    return order


# Host ints that change with the batch are not specialised on (one variant for every step).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])
def _queue_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, seq_lens_ptr, block_tables_ptr, order_ptr, queue_ptr,
    num_seqs, scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_c_blk, stride_c_tok, stride_c_head, stride_bt_seq,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr, CONVERT_ASM: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    row_in_group = rows % GROUP_P
    row_valid = (rows // GROUP_P == 0) & (row_in_group < GROUP)
    total = num_seqs * NUM_KV_HEADS
    item = tl.atomic_add(queue_ptr, 1)
    while item < total:
        seq = tl.load(order_ptr + item // NUM_KV_HEADS)  # kv heads of one sequence run side by side
        kv_head = item % NUM_KV_HEADS
        kv_end = tl.load(seq_lens_ptr + seq)
        if kv_end > 0:  # a graph bucket's padding rows (no keys) rank last and are not written
            row_head = kv_head * GROUP + row_in_group
            token = tl.zeros([BLOCK_M], dtype=tl.int32) + seq  # decode: sequence i's one token is token i
            q = _dot_query(_load_rows(q_ptr, token, row_head, row_valid, stride_q_tok, stride_q_head, HEAD_DIM),
                           scale_log2, FP16_DOTS)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            row_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (kv_end - 1)
            m_i, l_i, acc = _attend_tiles(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt_seq,
                kv_head * stride_c_head, row_pos, kv_end, 0, tl.cdiv(kv_end, TILE_N), scale_log2, stride_c_blk,
                stride_c_tok, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, MASKED=True, FP16_DOTS=FP16_DOTS,
                CONVERT_ASM=CONVERT_ASM,
            )
            _store_normalised(out_ptr, acc, l_i, token, row_head, row_valid, stride_o_tok, stride_o_head, HEAD_DIM)
        item = tl.atomic_add(queue_ptr, 1)
    # The last program out resets the queue for the next launch (every take above came before).
    left = tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel")
    if left == tl.num_programs(0) - 1:
        tl.atomic_xchg(queue_ptr, 0)
        tl.atomic_xchg(queue_ptr + 1, 0)


def new_queue(device: torch.device | str) -> torch.Tensor:
    """The counter pair (items taken, programs left) a launch consumes and leaves at zero. Launches
    that may run at the same time (two streams) need one each."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def queued_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]: one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    order: torch.Tensor,  # [B] int32, from decode_order(seq_lens)
    queue: torch.Tensor,  # from new_queue
    *,
    out: torch.Tensor,
    tile_n: int,
    num_warps: int,
    num_stages: int,
    programs_per_sm: int,
    programs: int | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """Decode attention of B one-token sequences through the item queue (see the module doc).
    ``programs``: the grid, if not ``programs_per_sm`` an SM (tests). ``compile_only``: compile
    this launch's variant and launch nothing (``precompile.py``)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs or order.shape != (num_seqs,):
        raise ValueError("q, seq_lens, block_tables and order must cover the same sequences")
    from tokenmill.kernels.triton.paged_attention import _fp16_dots
    from tokenmill.kernels.triton.precompile import launcher
    from tokenmill.kernels.triton.sm_count import num_sms

    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = max(16, group_p)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (programs or num_sms(q.device) * programs_per_sm,)
    launcher(_queue_decode_kernel, grid, compile_only)(
        q, k_cache, v_cache, out, seq_lens, block_tables, order, queue, num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, TILE_N=tile_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_DOTS=_fp16_dots(kv_cache.dtype, head_dim, block_m), CONVERT_ASM=not triton.knobs.runtime.interpret,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
