"""Decode attention as a queue of work items, longest contexts first (an experiment; docs/perf.md 43-44).

The default decode launch has one program per (sequence, kv head), dispatched in grid order, so a
step of ragged contexts ends with a few long programs running while most SMs are idle: 6-9% of
the attention time at P1's batch sizes (``kernels_bench.py --order-sweep``). Splitting every long
context in a static grid cost more than it saved (surplus programs and a merge launch).

Here a fixed number of programs (a few an SM) take items from one counter until none are left.
An item is (sequence, kv head, chunk of the key range): sequences are ranked by context length,
longest first, and a context of more than ``chunk_keys`` keys is cut into up to ``max_chunks``
chunks, so the items that finish last are short ones. A chunk's program stores an unnormalised
partial and counts itself in on its (sequence, kv head) counter; the last chunk to arrive merges
the partials in chunk order (so the result does not depend on who finished first), writes the
output and resets the counter. The last program to leave resets the queue, so the same buffers
serve the next launch and the next CUDA-graph replay.

``decode_work_plan`` builds the ranking once per step (torch ops on ``seq_lens``, no host sync);
every layer's launch reuses it. Twin: ``reference.paged_attention_ref`` on decode batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.paged_attention_tiles import _attend_tiles, _dot_query, _load_rows, _split_tiles, _store_normalised

_LOG2E = 1.4426950408889634
_SEARCH_BLOCK = 256
# Programs an SM: the 64-key tile on 2 warps takes 240 registers a thread (sm_90 compile), so 4 fit.
PROGRAMS_PER_SM = 4


def launch_shape(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(tile_n, num_warps, num_stages): the default decode launch's (``paged_attention_config``),
    on at least 2 warps (on 1, as over an fp8 cache, the merge's state beside the pipeline spills)."""
    from tokenmill.kernels.triton.paged_attention_config import _config

    group_p = 1  # decode tiles do not depend on the group (16 rows hold any group up to 16)
    config = _config(1, 1, group_p, head_dim, dtype, cache_dtype)
    return config.tile_n, max(2, config.num_warps), config.num_stages


@dataclass(frozen=True)
class DecodeWorkPlan:
    """One step's items: ``order[r]`` is the sequence of rank r (longest context first) and its
    items are ``item_start[r]..item_start[r + 1] - 1`` (kv head major, then chunk)."""

    order: torch.Tensor  # [B] int32
    item_start: torch.Tensor  # [B + 1] int32; item_start[B] is the number of items
    chunk_keys: int
    max_chunks: int


def decode_work_plan(seq_lens: torch.Tensor, num_kv_heads: int, chunk_keys: int, max_chunks: int) -> DecodeWorkPlan:
    """The ranking and item counts of a decode step (``chunk_keys`` 0: one chunk a sequence).
    A sequence of length 0 (a padding row) gets no items and its output is not written."""
    if chunk_keys < 0 or max_chunks < 1 or (chunk_keys == 0 and max_chunks != 1):
        raise ValueError(f"need chunk_keys >= 0 and max_chunks >= 1 (1 when chunk_keys is 0), got {chunk_keys}, {max_chunks}")
    order = torch.argsort(seq_lens, descending=True, stable=True)
    ranked = seq_lens[order].to(torch.int64)
    chunks = torch.clamp((ranked + chunk_keys - 1) // chunk_keys, max=max_chunks) if chunk_keys else (ranked > 0).to(torch.int64)
    item_start = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    item_start[1:] = torch.cumsum(chunks * num_kv_heads, 0)
    return DecodeWorkPlan(order.to(torch.int32), item_start, chunk_keys, max_chunks)


@triton.jit
def _find_rank(item_start_ptr, num_seqs, item, SEARCH_BLOCK: tl.constexpr):
    """The last rank r with item_start[r] <= item (one wide load per SEARCH_BLOCK ranks)."""
    count = tl.zeros((), dtype=tl.int32)
    for base in range(0, num_seqs, SEARCH_BLOCK):
        idx = base + 1 + tl.arange(0, SEARCH_BLOCK)
        in_range = idx <= num_seqs
        starts = tl.load(item_start_ptr + idx, mask=in_range, other=0)
        count += tl.sum((in_range & (starts <= item)).to(tl.int32), axis=0)
    return tl.minimum(count, num_seqs - 1)


# Host ints that change with the batch are not specialised on (one variant for every step).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq"])
def _persistent_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    seq_lens_ptr, block_tables_ptr, order_ptr, item_start_ptr, queue_ptr, done_ptr,
    num_seqs, scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_c_blk, stride_c_tok, stride_c_head, stride_bt_seq,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, CHUNK_KEYS: tl.constexpr,
    MAX_CHUNKS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    row_in_group = rows % GROUP_P
    row_valid = (rows // GROUP_P == 0) & (row_in_group < GROUP)
    dims = tl.arange(0, HEAD_DIM)
    total = tl.load(item_start_ptr + num_seqs)
    item = tl.atomic_add(queue_ptr, 1)
    while item < total:
        rank = _find_rank(item_start_ptr, num_seqs, item, SEARCH_BLOCK)
        seq = tl.load(order_ptr + rank)
        kv_end = tl.load(seq_lens_ptr + seq)
        if CHUNK_KEYS > 0:
            num_chunks = tl.minimum(tl.cdiv(kv_end, CHUNK_KEYS), MAX_CHUNKS)
        else:
            num_chunks = 1
        local = item - tl.load(item_start_ptr + rank)
        kv_head = local // num_chunks
        chunk = local % num_chunks
        row_head = kv_head * GROUP + row_in_group
        token = tl.zeros([BLOCK_M], dtype=tl.int32) + seq  # decode: sequence i's one token is token i
        q = _dot_query(_load_rows(q_ptr, token, row_head, row_valid, stride_q_tok, stride_q_head, HEAD_DIM), scale_log2, FP16_DOTS)
        tile_lo, tile_hi = _split_tiles(kv_end, chunk, num_chunks, TILE_N)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        row_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + (kv_end - 1)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt_seq, kv_head * stride_c_head,
            row_pos, kv_end, tile_lo, tile_hi, scale_log2, stride_c_blk, stride_c_tok, HEAD_DIM, BLOCK_SIZE, TILE_N,
            DOT_PRECISION, MASKED=True, FP16_DOTS=FP16_DOTS, CONVERT_ASM=CONVERT_ASM,
        )
        if num_chunks == 1:
            _store_normalised(out_ptr, acc, l_i, token, row_head, row_valid, stride_o_tok, stride_o_head, HEAD_DIM)
        else:
            # Partials [seq, head, chunk, :] and (m, l) [seq, head, chunk, 2], in L2 for the merge.
            slot = (seq * (NUM_KV_HEADS * GROUP) + row_head) * MAX_CHUNKS + chunk
            tl.store(part_acc_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
            tl.store(part_ml_ptr + slot * 2, m_i, mask=row_valid)
            tl.store(part_ml_ptr + slot * 2 + 1, l_i, mask=row_valid)
            tl.debug_barrier()  # every thread's partial is stored before the count (release below)
            counter = done_ptr + seq * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == num_chunks - 1:
                # The last chunk in: merge the chunks in order (.cg: read L2, where the others landed).
                base = (seq * (NUM_KV_HEADS * GROUP) + row_head) * MAX_CHUNKS
                m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
                for c in range(0, num_chunks):
                    m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (base + c) * 2, mask=row_valid, other=0.0, cache_modifier=".cg"))
                m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
                l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
                merged = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
                for c in range(0, num_chunks):
                    w = tl.exp2(tl.load(part_ml_ptr + (base + c) * 2, mask=row_valid, other=0.0, cache_modifier=".cg") - m_shift)
                    l_sum += w * tl.load(part_ml_ptr + (base + c) * 2 + 1, mask=row_valid, other=0.0, cache_modifier=".cg")
                    part = tl.load(part_acc_ptr + (base + c)[:, None] * HEAD_DIM + dims[None, :], mask=row_valid[:, None],
                                   other=0.0, cache_modifier=".cg")
                    merged += part * w[:, None]
                _store_normalised(out_ptr, merged, l_sum, token, row_head, row_valid, stride_o_tok, stride_o_head, HEAD_DIM)
                tl.atomic_xchg(counter, 0)
        item = tl.atomic_add(queue_ptr, 1)
    # The last program out resets the queue for the next launch (every take above came before).
    left = tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel")
    if left == tl.num_programs(0) - 1:
        tl.atomic_xchg(queue_ptr, 0)
        tl.atomic_xchg(queue_ptr + 1, 0)


@dataclass
class PersistentDecodeBuffers:
    """What the launches of a step share: the queue (taken, left), the per-(sequence, kv head)
    counters (zero between launches) and the partials of chunked items."""

    queue: torch.Tensor  # [2] int32
    done: torch.Tensor  # [max_seqs * num_kv_heads] int32
    part_acc: torch.Tensor  # [max_seqs * num_heads * max_chunks * head_dim] fp32
    part_ml: torch.Tensor  # [max_seqs * num_heads * max_chunks * 2] fp32

    @classmethod
    def allocate(cls, max_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_chunks: int,
                 device: torch.device | str) -> PersistentDecodeBuffers:
        chunked = max_chunks > 1
        return cls(
            queue=torch.zeros(2, dtype=torch.int32, device=device),
            done=torch.zeros(max_seqs * num_kv_heads, dtype=torch.int32, device=device),
            part_acc=torch.empty(max_seqs * num_heads * max_chunks * head_dim if chunked else 1, dtype=torch.float32, device=device),
            part_ml=torch.empty(max_seqs * num_heads * max_chunks * 2 if chunked else 1, dtype=torch.float32, device=device),
        )


def persistent_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]: one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    plan: DecodeWorkPlan,
    buffers: PersistentDecodeBuffers,
    *,
    out: torch.Tensor,
    tile_n: int,
    num_warps: int,
    num_stages: int,
    programs_per_sm: int,
    compile_only: bool = False,
) -> torch.Tensor:
    """Decode attention of B one-token sequences through the item queue (see the module doc).
    ``compile_only``: compile this launch's variant and launch nothing (``precompile.py``)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] != num_seqs or plan.order.shape != (num_seqs,):
        raise ValueError("q, seq_lens, block_tables and the plan must cover the same sequences")
    if buffers.done.numel() < num_seqs * num_kv_heads or (
        plan.max_chunks > 1 and buffers.part_ml.numel() < num_seqs * num_heads * plan.max_chunks * 2
    ):
        raise ValueError("the buffers were allocated for fewer sequences or chunks than this plan has")
    from tokenmill.kernels.triton.paged_attention import _fp16_dots
    from tokenmill.kernels.triton.precompile import launcher
    from tokenmill.kernels.triton.sm_count import num_sms

    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = max(16, group_p)

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_sms(q.device) * programs_per_sm,)
    launcher(_persistent_decode_kernel, grid, compile_only)(
        q, k_cache, v_cache, out, buffers.part_acc, buffers.part_ml, seq_lens, block_tables, plan.order,
        plan.item_start, buffers.queue, buffers.done, num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, TILE_N=tile_n, CHUNK_KEYS=plan.chunk_keys, MAX_CHUNKS=plan.max_chunks,
        SEARCH_BLOCK=_SEARCH_BLOCK, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP16_DOTS=_fp16_dots(kv_cache.dtype, head_dim, block_m),
        CONVERT_ASM=not triton.knobs.runtime.interpret, num_warps=num_warps, num_stages=num_stages,
    )
    return out
