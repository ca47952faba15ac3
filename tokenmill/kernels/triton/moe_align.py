"""Token-expert pairs grouped by expert, each expert's run padded to whole blocks: the lists the
grouped GEMMs of ``fused_moe.py`` walk.

A router gives each token t its top-K experts; ``p = t * K + k`` names one (token, expert) pair.
``moe_align`` lists the pairs expert by expert and pads each expert's run to a multiple of
BLOCK_M with the sentinel ``T * K``, so every BLOCK_M rows belong to one expert, and says which
expert each block is. Nothing may wait on the host (a decode step runs inside a CUDA graph), so the
outputs have fixed sizes: ``max_padded_rows`` bounds the rows for any routing, ``num_padded`` (on
the device) says how many are in use.

Two ways, one result up to the order of pairs within an expert's run (the GEMMs compute each pair's
row alone, so the order changes no value):
- decode-sized steps (up to ``ONE_LAUNCH_MAX_PAIRS`` pairs): one Triton program, a counting sort
  with atomics (count each expert's pairs, prefix-sum the padded counts, give each pair the next
  row of its expert). torch ops are ~25 small launches (several for the sort alone), a fixed cost
  a layer that a decode step pays 48 times on Qwen3-30B-A3B.
- larger steps: three launches over chunks of ``_CHUNK`` pairs, no atomics: each chunk's count a
  expert (``tl.histogram``); one program turning the counts into each (chunk, expert)'s first row
  (a prefix over the chunks, then over the experts' padded runs) and each block's expert; each
  chunk writing its pairs there, ranked within an expert by a one-hot prefix sum. An expert's
  pairs come in increasing order, as a stable sort gives them. (Before: torch ops, a stable sort,
  ``searchsorted``, ``cumsum``, a scatter: ~25 launches, the sort alone ~0.23 ms a layer at 16,384
  tokens on an H100, docs/perf.md 91; ``_moe_align_torch`` stays as the tests' twin.)
No ``.item()``, ``nonzero`` or ``bincount`` (whose CUDA version reads the input's maximum back to
size its output) anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.precompile import launcher

# The one-launch alignment's limit: its program walks the pairs in chunks of _CHUNK, twice, each
# chunk one round of global atomics (about a microsecond of latency): 16 rounds at the limit.
ONE_LAUNCH_MAX_PAIRS = 8192
_CHUNK = 1024


@triton.jit
def _padded_runs(counts, experts, num_rows, block_experts_ptr, num_padded_ptr, NUM_EXPERTS: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """From each expert's pair count [E_PAD] (0 past NUM_EXPERTS): the padded rows in use and each
    block's expert (stored), and each expert's first row (returned)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # Block b's expert: how many experts' runs end at or before its first row (E past the last run).
    real = experts < NUM_EXPERTS
    num_blocks = num_rows // BLOCK_M
    for b0 in range(0, num_blocks, 64):
        b = b0 + tl.arange(0, 64)
        ended = (ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_experts_ptr + b, tl.sum(ended.to(tl.int32), axis=1), mask=b < num_blocks)
    return ends - padded


# The pair and row counts change with every batch size: not specialised on (no variant per size).
@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _align_kernel(
    ids_ptr,  # [num_pairs] expert of each pair
    sorted_ptr,  # [num_rows] int32 out: pairs grouped by expert, sentinel num_pairs as padding
    block_experts_ptr,  # [num_rows / BLOCK_M] int32 out
    num_padded_ptr,  # [1] int32 out
    scratch_ptr,  # [2 * E_PAD] int32: each expert's pair count, then its next free row
    num_pairs,
    num_rows,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    bins = tl.arange(0, E_PAD)
    tl.store(scratch_ptr + bins, tl.zeros([E_PAD], dtype=tl.int32))
    for r0 in range(0, num_rows, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.full([CHUNK], num_pairs, dtype=tl.int32), mask=r < num_rows)
    tl.debug_barrier()  # the counts are zero before any thread adds to them
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        valid = p < num_pairs
        ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
        tl.atomic_add(scratch_ptr + ids, tl.full([CHUNK], 1, dtype=tl.int32), mask=valid)
    tl.debug_barrier()  # every count is in
    counts = tl.load(scratch_ptr + bins, cache_modifier=".cg")  # from L2, where the atomics landed
    starts = _padded_runs(counts, bins, num_rows, block_experts_ptr, num_padded_ptr, NUM_EXPERTS, BLOCK_M)
    tl.store(scratch_ptr + E_PAD + bins, starts)  # each expert's first row: its next free one
    tl.debug_barrier()  # the first rows are in place before pairs take them
    for p0 in range(0, num_pairs, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        valid = p < num_pairs
        ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
        row = tl.atomic_add(scratch_ptr + E_PAD + ids, tl.full([CHUNK], 1, dtype=tl.int32), mask=valid)
        tl.store(sorted_ptr + row, p, mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "num_rows", "rows_per_chunk"])
def _chunk_counts_kernel(
    ids_ptr,  # [num_pairs] expert of each pair
    counts_ptr,  # [num_chunks, E_PAD] int32 out: each chunk's pairs a expert
    sorted_ptr,  # [num_rows] int32 out: the sentinel num_pairs, rows_per_chunk of them a program
    num_pairs,
    num_rows,
    rows_per_chunk,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    chunk = tl.program_id(0)
    p = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.histogram(ids, E_PAD, mask=valid))
    first = chunk * rows_per_chunk
    for r0 in range(first, tl.minimum(first + rows_per_chunk, num_rows), CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.full([CHUNK], num_pairs, dtype=tl.int32), mask=(r < first + rows_per_chunk) & (r < num_rows))


@triton.jit(do_not_specialize=["num_chunks", "num_rows"])
def _chunk_rows_kernel(
    counts_ptr,  # [num_chunks, E_PAD] int32
    firsts_ptr,  # [num_chunks, E_PAD] int32 out: the row of each chunk's first pair of each expert
    block_experts_ptr,  # [num_rows / BLOCK_M] int32 out
    num_padded_ptr,  # [1] int32 out
    num_chunks,
    num_rows,
    NUM_EXPERTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,  # chunks a pass reads at a time
):
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, TILE):
        c = c0 + tl.arange(0, TILE)
        totals += tl.sum(tl.load(counts_ptr + c[:, None] * E_PAD + experts[None, :], mask=(c < num_chunks)[:, None], other=0), axis=0)
    starts = _padded_runs(totals, experts, num_rows, block_experts_ptr, num_padded_ptr, NUM_EXPERTS, BLOCK_M)
    # A second pass over the counts (not over the rows just written: another thread may hold them):
    # chunk c's first row for expert e = the run's start + e's pairs in the chunks before c.
    before = starts
    for c0 in range(0, num_chunks, TILE):
        c = c0 + tl.arange(0, TILE)
        at = c[:, None] * E_PAD + experts[None, :]
        block = tl.load(counts_ptr + at, mask=(c < num_chunks)[:, None], other=0)
        tl.store(firsts_ptr + at, before[None, :] + tl.cumsum(block, axis=0) - block, mask=(c < num_chunks)[:, None])
        before += tl.sum(block, axis=0)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_scatter_kernel(
    ids_ptr,  # [num_pairs]
    firsts_ptr,  # [num_chunks, E_PAD] int32
    sorted_ptr,  # [num_rows] int32 out
    num_pairs,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,  # pairs ranked at a time: a [SUB, E_PAD] one-hot
):
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    next_row = tl.load(firsts_ptr + chunk * E_PAD + experts)  # each expert's next free row
    for s0 in range(0, CHUNK, SUB):
        p = chunk * CHUNK + s0 + tl.arange(0, SUB)
        valid = p < num_pairs
        ids = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
        mine = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)
        # A pair's row: its expert's next free row + the pairs of that expert before it here.
        row = tl.sum(mine * (next_row[None, :] + tl.cumsum(mine, axis=0) - 1), axis=1)
        tl.store(sorted_ptr + row, p.to(tl.int32), mask=valid)
        next_row += tl.sum(mine, axis=0)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of ``sorted_pairs`` for any routing of ``num_pairs`` pairs, rounded up to whole blocks
    (each non-empty expert pads at most block_m - 1 rows; at most min(E, pairs) are non-empty: a
    decode step with one token and K = 8 gets 8 blocks, not E = 128)."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              compile_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the pairs ``p = t * K + k`` of ``topk_ids`` [T, K] (int32/int64, each in [0, E)) by expert.

    Returns ``(sorted_pairs, block_experts, num_padded)``, all int32 on topk_ids's device:
    ``sorted_pairs`` [``max_padded_rows``]: each expert's pairs (in increasing order from the chunked
    launches; in any order from the one launch), its run padded to a multiple of block_m with the
    sentinel T * K (rows past ``num_padded`` hold it too); ``block_experts`` [rows / block_m]: the
    expert of each block (unused blocks: E, no expert); ``num_padded`` [1]: the rows in use. Static
    shapes and device-side work only (CUDA-graph safe). ``compile_only``: compile the launch this call
    would make (``precompile.launcher``); the lists are then left unfilled.
    """
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return _moe_align_torch(topk_ids, num_experts, block_m)
    if num_pairs > ONE_LAUNCH_MAX_PAIRS:
        return _moe_align_chunks(topk_ids, num_experts, block_m, compile_only)
    device = topk_ids.device
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    sorted_pairs, block_experts, num_padded = _empty_lists(rows, block_m, device)
    scratch = torch.empty(2 * e_pad, dtype=torch.int32, device=device)
    launcher(_align_kernel, (1,), compile_only)(
        topk_ids.reshape(-1), sorted_pairs, block_experts, num_padded, scratch, num_pairs, rows,
        NUM_EXPERTS=num_experts, E_PAD=e_pad, BLOCK_M=block_m, CHUNK=_CHUNK, num_warps=8)
    return sorted_pairs, block_experts, num_padded


def _empty_lists(rows: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align``'s three outputs, unfilled: sorted_pairs [rows], block_experts [rows / block_m], num_padded [1]."""
    return (torch.empty(rows, dtype=torch.int32, device=device),
            torch.empty(rows // block_m, dtype=torch.int32, device=device),
            torch.empty(1, dtype=torch.int32, device=device))


def _moe_align_chunks(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                      compile_only: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` in three launches over chunks of pairs (prefill-sized steps; the module
    docstring): each expert's pairs in increasing order."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    e_pad = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, _CHUNK)
    ids = topk_ids.reshape(-1)
    sorted_pairs, block_experts, num_padded = _empty_lists(rows, block_m, device)
    counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    firsts = torch.empty_like(counts)
    # ~4K-element register tiles whatever E is (8 to a few hundred experts).
    tile = max(1, min(64, 4096 // e_pad))
    launcher(_chunk_counts_kernel, (num_chunks,), compile_only)(
        ids, counts, sorted_pairs, num_pairs, rows, triton.cdiv(rows, num_chunks), E_PAD=e_pad, CHUNK=_CHUNK, num_warps=4)
    launcher(_chunk_rows_kernel, (1,), compile_only)(
        counts, firsts, block_experts, num_padded, num_chunks, rows, NUM_EXPERTS=num_experts, E_PAD=e_pad,
        BLOCK_M=block_m, TILE=tile, num_warps=8)
    launcher(_chunk_scatter_kernel, (num_chunks,), compile_only)(
        ids, firsts, sorted_pairs, num_pairs, E_PAD=e_pad, CHUNK=_CHUNK, SUB=tile, num_warps=4)
    return sorted_pairs, block_experts, num_padded


def _moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align`` in torch ops of fixed output sizes (the tests' twin, and an empty step): each
    expert's pairs in increasing order (a stable sort)."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    flat = topk_ids.reshape(-1)
    # Stable: an expert's pairs in increasing order, so the lists are a function of the routing alone
    # (whichever sort algorithm the device picks for this size).
    expert_of, pair_of = torch.sort(flat, stable=True)
    # starts[e]: the first sorted position of expert e (starts[E] = T * K); blocks[e]: its blocks.
    starts = torch.searchsorted(expert_of, torch.arange(num_experts + 1, device=device, dtype=flat.dtype))
    blocks = torch.div(starts.diff() + (block_m - 1), block_m, rounding_mode="floor")
    block_ends = torch.cumsum(blocks, dim=0)
    # Sorted position i of expert e moves to row i + shift[e], shift = padded start - start.
    shift = (block_ends - blocks) * block_m - starts[:-1]
    dest = torch.arange(num_pairs, device=device).add_(shift[expert_of])
    sorted_pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, pair_of.to(torch.int32))
    # Block b's expert: the first whose blocks end past b.
    block_experts = torch.searchsorted(block_ends, torch.arange(rows // block_m, device=device), right=True, out_int32=True)
    num_padded = (block_ends[-1:] * block_m).to(torch.int32)
    return sorted_pairs, block_experts, num_padded
