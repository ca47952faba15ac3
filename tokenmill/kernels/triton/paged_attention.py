"""One paged attention kernel for every step: decode, prefill with prefix hits, chunked prefill, mixed.

Twin: ``reference.paged_attention_ref``. The rule it implements is the only one there is: the j-th
new token of sequence i sits at absolute position ``seq_len_i - query_len_i + j`` and attends
causally to the keys ``0..position`` of its paged context. Decode (query_len 1) and prefill
(query_len = seq_len) are just two ends of that rule, so a single kernel covers any mix of them.

How the work is cut (grid = (query blocks, kv heads, kv splits)):
- Query blocks. Each sequence's new tokens are cut into blocks of BLOCK_Q tokens. Sequence i's
  blocks are numbered from ``query_start_loc[i] // BLOCK_Q + i``, an upper bound on how many blocks
  come before it, so the total never exceeds ``T // BLOCK_Q + B`` and the grid depends only on
  tensor shapes. A program finds its sequence by counting the starts at or below its id and exits
  at once when its block lies past the sequence's end. No host value that changes between steps
  reaches the grid, which is what lets CUDA graphs capture decode. (With BLOCK_Q == 1, the
  decode shape, the token index itself is the block number and the grid is exactly T.)
- GQA packing. The ``group = num_heads // num_kv_heads`` query heads that share one kv head are
  stacked with the query tokens into the M rows of one score tile (row = token * GROUP_P + head),
  so each K/V tile is loaded from HBM once per kv head and used by the whole group. M is padded to
  at least 16 rows because tensor-core dots need every operand dimension >= 16 on the GPU; the
  padded rows are masked and cost arithmetic only, which decode has to spare (it is memory-bound).
- Mixed steps. A decode row in a prefill-sized tile would fill one row of 64-128 and pay the
  arithmetic of all of them, so when the host knows that the first ``num_decode_seqs`` sequences
  are one-token decodes (the scheduler serves running sequences first), those get a launch with
  the decode tile and the rest a second launch with the prefill tile. The second launch numbers
  its query blocks from its first sequence's, which the host can compute since every sequence
  before it holds one token.
- Causal masks. In a prefill block, key tiles that end at or before the block's first position
  are seen whole by every row and run without masks; only the one or two tiles on the diagonal
  are masked, and tiles past the block's last position are never visited.
- Split-KV. When the batch is small (few sequences, long contexts), B * kv_heads programs cannot
  fill 132 SMs; each program then covers 1/NUM_SPLITS of the key range, writes an unnormalised
  partial result with its running max and sum, and a second kernel merges the splits. NUM_SPLITS is
  chosen on the host from static bounds only.
Keys are addressed token by token through the block table (``block_tables[i, pos // block_size]``),
so a key tile may span several cache blocks and its width TILE_N is independent of block_size.
Softmax is the online (flash) form in fp32 with exp2 and the scale folded into log2(e).

Where the rest lives: the jit pieces both kernels are built from in ``paged_attention_tiles.py``,
deterministic mode's fixed-split kernels in ``paged_attention_deterministic.py``, the choice of
launch shapes in ``paged_attention_config.py``. This module holds the default kernel, its split
merge and the host side that validates, chooses and launches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# The launch configs live in their own module; importers of this one find them here too.
from tokenmill.kernels.triton.paged_attention_config import (  # noqa: F401
    DETERMINISTIC_PART_KEYS,
    AttentionLaunchConfig,
    _splits_off_decodes,
    choose_config,
    choose_configs,
    launch_configs,
)
from tokenmill.kernels.triton.paged_attention_deterministic import _merge_parts_kernel, _paged_attention_fixed_split_kernel
from tokenmill.kernels.triton.paged_attention_tiles import (
    _attend_tiles,
    _dot_query,
    _load_rows,
    _locate_rows,
    _store_normalised,
    _store_partial,
)
from tokenmill.kernels.triton.precompile import launcher

_LOG2E = 1.4426950408889634
# Wide enough to find the sequence of any program with one vector load when B <= 256.
_SEARCH_BLOCK = 256


# Host ints that change from step to step are not specialised on (Triton would otherwise compile a
# variant for 1, for multiples of 16 and for the rest), so the variants depend on configs alone.
@triton.jit(do_not_specialize=["num_seqs", "block_offset", "token_offset", "stride_bt_seq"])
def _paged_attention_kernel(
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
    block_offset,  # query blocks of earlier sequences that another launch covers (see _launch)
    token_offset,  # this launch's first token: row 0 of the partial buffers
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
    NUM_SPLITS: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    CONVERT_ASM: tl.constexpr,
):
    block_id = tl.program_id(0) + block_offset
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_first, query_len, cached_len, token, row_head, row_valid, row_pos, kv_end = _locate_rows(
        query_start_loc_ptr, seq_lens_ptr, num_seqs, block_id, kv_head, GROUP, GROUP_P, BLOCK_Q, BLOCK_M, SEARCH_BLOCK
    )
    if q_first >= query_len:
        return  # a spare program of the static grid
    q = _load_rows(q_ptr, token, row_head, row_valid, stride_q_tok, stride_q_head, HEAD_DIM)
    q = _dot_query(q, scale_log2, FP16_DOTS)
    # This split's share of the block's key tiles.
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq * stride_bt_seq
    head_off = kv_head * stride_c_head
    if BLOCK_Q == 1:
        # Decode: every row sits at the last position, only the last tile can reach past it.
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, row_pos, kv_end, tile_lo, tile_hi, scale_log2,
            stride_c_blk, stride_c_tok, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, MASKED=True,
            FP16_DOTS=FP16_DOTS, CONVERT_ASM=CONVERT_ASM,
        )
    else:
        # Prefill: a tile that ends at or before the block's first position is seen whole by every
        # row, so it needs no mask; only the one or two tiles on the diagonal do. Tiles past the
        # diagonal were never in range (kv_end).
        full_end = tl.minimum(tl.maximum((cached_len + q_first + 1) // TILE_N, tile_lo), tile_hi)
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, row_pos, kv_end, tile_lo, full_end, scale_log2,
            stride_c_blk, stride_c_tok, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, MASKED=False,
            FP16_DOTS=FP16_DOTS, CONVERT_ASM=CONVERT_ASM,
        )
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table, head_off, row_pos, kv_end, full_end, tile_hi, scale_log2,
            stride_c_blk, stride_c_tok, HEAD_DIM, BLOCK_SIZE, TILE_N, DOT_PRECISION, MASKED=True,
            FP16_DOTS=FP16_DOTS, CONVERT_ASM=CONVERT_ASM,
        )

    if NUM_SPLITS == 1:
        _store_normalised(out_ptr, acc, l_i, token, row_head, row_valid, stride_o_tok, stride_o_head, HEAD_DIM)
    else:
        # Unnormalised partials; an empty split stores acc 0, m -inf, l 0, which the merge weighs 0.
        _store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, acc, m_i, l_i, token - token_offset, row_head, row_valid,
                       split, stride_pa_tok, stride_pa_head, stride_pa_split, stride_pml_tok, stride_pml_head, HEAD_DIM)


@triton.jit(do_not_specialize=["num_seqs", "token_offset"])
def _merge_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    query_start_loc_ptr,
    num_seqs,
    token_offset,
    stride_o_tok,
    stride_o_head,
    stride_pa_tok,
    stride_pa_head,
    stride_pa_split,
    stride_pml_tok,
    stride_pml_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    part_row = tl.program_id(0)
    token = part_row + token_offset
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return  # padding past the last real token: leave the output alone
    splits = tl.arange(0, SPLITS_P)
    present = splits < NUM_SPLITS
    pml = part_row * stride_pml_tok + head * stride_pml_head + splits
    m = tl.load(part_m_ptr + pml, mask=present, other=float("-inf"))
    l = tl.load(part_l_ptr + pml, mask=present, other=0.0)
    # m_max is finite for a real token (split 0 holds key 0, which every query sees); the guards
    # only keep a malformed padding sequence (seq_len < query_len) at 0 instead of NaN.
    m_max = tl.max(m, axis=0)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(present, tl.exp2(m - m_shift), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    pa = part_acc_ptr + part_row * stride_pa_tok + head * stride_pa_head + splits * stride_pa_split
    acc = tl.load(pa[:, None] + dims[None, :], mask=present[:, None], other=0.0)
    denom = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [B + 1] int32, query_start_loc[0] == 0
    seq_lens: torch.Tensor,  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_decode_seqs: int = 0,
    out: torch.Tensor | None = None,
    config: AttentionLaunchConfig | None = None,
    decode_config: AttentionLaunchConfig | None = None,
    decodes_done: bool = False,
    compile_only: bool = False,
) -> torch.Tensor:  # [T, num_heads, head_dim], q.dtype
    """Causal paged attention of the flattened batch (its keys/values already in the cache).

    ``max_query_len`` and ``max_seq_len`` are host-side upper bounds used only to choose tile
    shapes and the split count (see ``choose_config``); the kernels read the true lengths from the
    tensors, so the result is correct for any bounds and the launch never syncs with the device.
    Rows of tokens at or past ``query_start_loc[B]`` (CUDA-graph padding) are not written.

    ``num_decode_seqs``: the first that many sequences have exactly one query token each (a host
    fact: the scheduler serves running decodes first). When longer queries follow, those decodes
    get a launch of their own with the decode tile and the rest the prefill tile; a count larger
    than the true one gives wrong results, a smaller one (0: one launch) only a slower step.
    ``config`` overrides the choice of the (prefill or only) launch, ``decode_config`` that of the
    decode launch (benchmarks, tests of the split path). ``decodes_done``: those leading decodes'
    rows of ``out`` were written by the caller (the item queue, ``paged_attention_queue.py``), so
    only the rest is launched. ``compile_only`` compiles the kernels this call would launch and
    launches nothing (``precompile.py``).
    """
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q must be [T, num_heads, head_dim] with a contiguous last dim, got {tuple(q.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] with a contiguous last dim, "
            f"got {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} differs from q's {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc must be [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], got "
            f"{tuple(query_start_loc.shape)} and {tuple(block_tables.shape)}"
        )
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and a contiguous last dim")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    fixed_parts = config is not None and config.part_keys > 0
    if fixed_parts and decode_config is not None:
        raise ValueError(f"a deterministic config (part_keys {config.part_keys}) runs alone: decode_config must be None")
    # A deterministic config's one tile serves decodes too: its steps stay in one launch.
    split_decodes = not fixed_parts and _splits_off_decodes(num_decode_seqs, num_seqs, max_query_len)
    if decodes_done and not split_decodes:
        raise ValueError("decodes_done needs leading decodes followed by longer queries, and no deterministic config")
    if config is None or (decode_config is None and split_decodes):
        chosen_decode, chosen = choose_configs(
            num_tokens=num_tokens, num_seqs=num_seqs, num_decode_seqs=num_decode_seqs, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=q.dtype, max_query_len=max_query_len,
            max_seq_len=max_seq_len, device=q.device, cache_dtype=kv_cache.dtype,
        )
        config, decode_config = config or chosen, decode_config or chosen_decode
    launch = functools.partial(
        _launch, q, k_cache=kv_cache[0], v_cache=kv_cache[1], out=out, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_tables=block_tables, scale=scale, max_seq_len=max_seq_len, compile_only=compile_only,
    )
    if split_decodes:
        assert decode_config is not None
        d = num_decode_seqs
        if not decodes_done:
            launch(decode_config, num_launch_seqs=d, first_seq=0, num_launch_tokens=d)
        launch(config, num_launch_seqs=num_seqs, first_seq=d, num_launch_tokens=num_tokens - d)
    else:
        launch(config, num_launch_seqs=num_seqs, first_seq=0, num_launch_tokens=num_tokens)
    return out


def _fp16_dots(cache_dtype: torch.dtype, head_dim: int, block_m: int) -> bool:
    """Whether the dots run in fp16 over this cache (``_dot_query``): over a float8 one, except in
    head_dim 256's wide tile, which fp16 dots push from 208 registers to 255 and a spill (sm_90
    compile); there q stays bf16 and the keys and values convert on to it."""
    return cache_dtype.itemsize == 1 and not (head_dim > 128 and block_m >= 64)


def _launch(
    q: torch.Tensor,
    config: AttentionLaunchConfig,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_launch_seqs: int,
    first_seq: int,
    num_launch_tokens: int,
    compile_only: bool,
) -> None:
    """One launch (plus the merge when split) over sequences ``first_seq..num_launch_seqs - 1``,
    whose tokens are the last ``num_launch_tokens`` before the end of the batch or of sequence
    ``num_launch_seqs - 1``. A launch that starts past sequence 0 relies on the sequences before it
    having one token each (so its first token is ``first_seq``), and numbers its query blocks
    from that sequence's first block, which the host can then compute."""
    if config.tile_n < 16 or config.tile_n & (config.tile_n - 1) or config.block_q < 1 or config.block_q & (config.block_q - 1):
        raise ValueError(f"tile_n must be a power of two >= 16 and block_q a power of two, got {config}")
    if config.num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {config.num_splits}")
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    block_m = max(16, config.block_q * group_p)  # tl.dot needs >= 16 rows on tensor cores
    token_offset = first_seq  # one token per earlier sequence
    if config.block_q == 1:
        block_offset, grid_q = token_offset, num_launch_tokens
    else:
        # Sequence i's blocks start at query_start_loc[i] // block_q + i (see _find_sequence). From
        # a first_seq > 0 the floor of the start can gain one over the launch's own tokens: one
        # spare program covers it.
        block_offset = token_offset // config.block_q + first_seq
        grid_q = num_launch_tokens // config.block_q + (num_launch_seqs - first_seq) + (1 if first_seq else 0)
    splits = config.num_splits
    fixed_parts = config.part_keys > 0
    if fixed_parts and (config.part_keys % config.tile_n or config.part_keys & (config.part_keys - 1)):
        raise ValueError(f"part_keys must be a power of two and a multiple of tile_n, got {config}")
    assert not (fixed_parts and first_seq), "deterministic mode runs every step in one launch (see paged_attention)"
    # Partial results: one slot per split, or per key part in deterministic mode.
    slots = -(-max(max_seq_len, 1) // config.part_keys) if fixed_parts else splits
    if splits > 1:
        # Indexed from the launch's first token: a prefill launch after the decodes skips their rows.
        part_acc = torch.empty((num_launch_tokens, num_heads, slots, head_dim), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_launch_tokens, num_heads, slots), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:  # unused by the kernel; any tensor will do as a placeholder pointer
        part_acc = part_m = part_l = out
    pointers = (q, k_cache, v_cache, out, part_acc, part_m, part_l, query_start_loc, seq_lens, block_tables)
    strides = (
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), part_acc.stride(0), part_acc.stride(1), part_acc.stride(2) if splits > 1 else 0,
        part_m.stride(0), part_m.stride(1),
    )
    shape = dict(
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=config.block_q,
        BLOCK_M=block_m, TILE_N=config.tile_n, SEARCH_BLOCK=_SEARCH_BLOCK,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP16_DOTS=_fp16_dots(k_cache.dtype, head_dim, block_m),
        CONVERT_ASM=not triton.knobs.runtime.interpret,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    grid = (grid_q, num_kv_heads, splits)
    if fixed_parts:
        launcher(_paged_attention_fixed_split_kernel, grid, compile_only)(
            *pointers, num_launch_seqs, splits, scale * _LOG2E, *strides, PART_TILES=config.part_keys // config.tile_n,
            ONE_PROGRAM=splits == 1, **shape,
        )
    else:
        launcher(_paged_attention_kernel, grid, compile_only)(
            *pointers, num_launch_seqs, block_offset, token_offset, scale * _LOG2E, *strides, NUM_SPLITS=splits, **shape
        )
    if splits > 1 and fixed_parts:
        launcher(_merge_parts_kernel, (num_launch_tokens, num_kv_heads), compile_only)(
            out, part_acc, part_m, part_l, query_start_loc, seq_lens, num_launch_seqs, *strides[2:4], *strides[8:],
            GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, PART_KEYS=config.part_keys, SEARCH_BLOCK=_SEARCH_BLOCK,
            num_warps=4 if head_dim * group_p >= 1024 else 2,
        )
    elif splits > 1:
        launcher(_merge_splits_kernel, (num_launch_tokens, num_heads), compile_only)(
            out,
            part_acc,
            part_m,
            part_l,
            query_start_loc,
            num_launch_seqs,
            token_offset,
            out.stride(0),
            out.stride(1),
            part_acc.stride(0),
            part_acc.stride(1),
            part_acc.stride(2),
            part_m.stride(0),
            part_m.stride(1),
            NUM_SPLITS=splits,
            SPLITS_P=triton.next_power_of_2(splits),
            HEAD_DIM=head_dim,
            num_warps=4 if head_dim * splits >= 2048 else 2,
        )
