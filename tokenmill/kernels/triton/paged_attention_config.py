"""Which tile each paged attention launch gets (``kernels/triton/paged_attention.py`` runs it).

A config is a compiled variant of the kernel, so the choice depends only on static bounds (tensor
shapes and two host upper bounds), never on values that change within a step: decode takes one
token per program with the GQA group in a 16-row tile, prefill a narrow (16-row) or wide (128-row,
32-key) tile, split-KV only while the grid would leave SMs idle, and deterministic mode one tile
for every step with fixed key parts. ``launch_configs`` lists every config ``choose_config`` can
return, so they are all compiled before a run (``precompile.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton

from tokenmill.kernels.triton.sm_count import num_sms

# Splitting the key range below this many keys per split costs more in the merge than it gains.
_MIN_KEYS_PER_SPLIT = 256
# Splits are added while a launch has fewer than this many programs an SM (fewer leave SMs idle).
PROGRAMS_PER_SM = 2
_MAX_SPLITS = 64
# A prefill tile already holds 16-128 query rows of work; beyond 4 splits only a short chunk
# against a long context would gain, and each allowed count is one more variant to compile.
_MAX_PREFILL_SPLITS = 4
# Deterministic mode's fixed key parts (a multiple of every tile_n): long enough that merging parts
# costs little next to attending over them, short enough to split one long sequence over many SMs.
DETERMINISTIC_PART_KEYS = 512
# Decode over a float8 cache: a tile of keys holds half the bytes of a bf16 one, so the bf16 launch
# (64 keys, 4 warps, one buffer) kept too few bytes in flight. 32-key tiles on 1 warp with 6 stages
# (five tiles in flight), split until ~16 programs an SM, read P1's decode steps in 4-20% less time
# than the 64-key, 2-warp, 5-stage launch at 48-256 sequences (tied at 16-32), P2's 1,024 in 12%
# less and P5's long contexts in 11-13% less (each at its best split), on both Qwen3-0.6B's and
# Llama-3-8B's heads (`kernels_bench.py --batch-sweep`, gpu_kernels.jsonl e2818e3). End to end, one
# machine, shipped / this / shipped: P1 4.51 / 4.19 / 4.51 s, P5 4.65 / 4.46 / 4.65, P3 12.62 /
# 12.35 / 12.60 (docs/perf.md 33). Many small programs: each streams few keys, so the split rule
# fills the SMs with more of them than the bf16 launch's PROGRAMS_PER_SM.
FP8_CACHE_DECODE_WARPS, FP8_CACHE_DECODE_STAGES = 1, 6
FP8_CACHE_DECODE_TILE_N, FP8_CACHE_DECODE_PROGRAMS_PER_SM = 32, 16
# Decode over a bf16/fp16 cache (head_dim <= 128): 2 warps a 64-key tile, not 4. Timed at P1's batch
# sizes (graph buckets 16-256 with P1's ragged contexts, `kernels_bench.py --batch-sweep`), on both
# Qwen3-0.6B's and Llama-3-8B's heads, with the split count the rule below picks, 2 warps took 3-27%
# less time in all 16 cases (92 against 99 µs at 64 sequences, 155 against 161 at 256, 34 against
# 45 at 16; gpu_kernels.jsonl, 844c306). Why is not pinned down; the tile's bytes in flight are the
# same, with half the threads issuing them.
DECODE_WARPS = 2
# Prefill over a float8 cache: the wide tile's keys and values are converted to fp16 on their way
# to the wgmma (in registers, then back through shared memory), which the bf16 tile (128 rows x 32
# keys, 8 warps) pays for dearly: 1,075 µs against 600 over bf16 on P5's 16,384-token prefill step
# (Qwen3-0.6B heads). 64 rows x 64 keys on 4 warps with 2 stages took 622 µs, the best of nine
# tile/warp/stage rows (`kernels_bench.py --p5 --sweep --fp8-cache`; gpu_kernels.jsonl, 7f3f191).
FP8_CACHE_WIDE_ROWS = 64


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile shapes of one launch. Any values give the same result; they only change speed."""

    block_q: int  # query tokens per program (power of two)
    tile_n: int  # keys per inner-loop step (power of two, >= 16)
    num_splits: int  # key-range splits per (query block, kv head); 1 = no merge kernel
    num_warps: int
    num_stages: int
    # Deterministic mode (> 0): keys are cut into parts of this many keys from key 0 (a multiple
    # of tile_n), merged in order, and num_splits only says how many programs share the parts.
    part_keys: int = 0


def choose_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    deterministic: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> AttentionLaunchConfig:
    """Pick tile shapes and the split count from static bounds (shapes and two host upper bounds).

    ``max_query_len == 1`` selects the decode shape (one token per program, a 16-row tile holding
    the GQA group). Otherwise a step with at most 16 rows of queries per sequence (tokens x group)
    takes that 16-row tile, and any longer one the wide tile of 128 rows (64 for head_dim 256, 16
    for fp32). Splits are added only while the grid has fewer than ``PROGRAMS_PER_SM`` programs an
    SM (``FP8_CACHE_DECODE_PROGRAMS_PER_SM`` for decode over a float8 cache), and only as far as
    ``max_seq_len`` leaves each split >= 256 keys. Every value is a compiled variant of the kernel,
    so the choices are few and known in advance (``launch_configs`` lists them).
    ``cache_dtype`` (None: ``dtype``): over a float8 cache decode takes its own warps and stages and
    prefill a narrower wide tile (``FP8_CACHE_*``; head_dim <= 128).

    ``deterministic``: one tile for every step, decode or prefill (the 16-row one: a row's dots and
    reductions then run on the same tile shape, hence round alike, wherever it is computed), fixed
    parts of ``DETERMINISTIC_PART_KEYS`` keys, and as many programs per block as fill the GPU (that
    only changes who computes which part; see ``_paged_attention_fixed_split_kernel``).
    """
    group_p = triton.next_power_of_2(num_heads // num_kv_heads)
    sms = num_sms(device)
    if deterministic:
        config = _deterministic_config(group_p, head_dim, dtype)
        programs = max(1, (num_tokens // config.block_q + num_seqs) * num_kv_heads)
        num_splits = 1
        if programs < 2 * sms:
            wanted = min(math.ceil(2 * sms / programs), -(-max_seq_len // config.part_keys), _MAX_SPLITS)
            num_splits = _next_power_of_2(wanted)
        return dataclasses.replace(config, num_splits=num_splits)
    if max_query_len <= 1:
        block_q, max_splits = 1, _MAX_SPLITS
    else:
        narrow, wide = _prefill_block_qs(group_p, head_dim, dtype, cache_dtype)
        block_q, max_splits = (narrow if max_query_len <= narrow else wide), _MAX_PREFILL_SPLITS
    grid_q = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    programs = max(1, grid_q * num_kv_heads)
    fp8_decode = block_q == 1 and _fp8_cache_tiles(dtype, cache_dtype, head_dim)
    fill = (FP8_CACHE_DECODE_PROGRAMS_PER_SM if fp8_decode else PROGRAMS_PER_SM) * sms
    num_splits = 1
    if programs < fill:
        by_length = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
        wanted = min(math.ceil(fill / programs), by_length, max_splits)
        num_splits = _next_power_of_2(wanted)
    return _config(block_q, num_splits, group_p, head_dim, dtype, cache_dtype)


def choose_configs(
    *,
    num_tokens: int,
    num_seqs: int,
    num_decode_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    deterministic: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> tuple[AttentionLaunchConfig | None, AttentionLaunchConfig]:
    """The configs of a step's launches: (the leading decodes' launch, or None when one launch
    covers the whole step; the other launch). Decodes in a prefill-sized tile would each fill one
    row of 64-128 and pay the arithmetic of all of them, so a mixed step whose first
    ``num_decode_seqs`` sequences are one-token decodes runs them with the decode tile.
    ``deterministic``: always one launch, on the one tile every row shares (``choose_config``)."""
    shape = dict(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, cache_dtype=cache_dtype
    )
    if deterministic or not _splits_off_decodes(num_decode_seqs, num_seqs, max_query_len):
        return None, choose_config(
            num_tokens=num_tokens, num_seqs=num_seqs, max_query_len=max_query_len, max_seq_len=max_seq_len,
            deterministic=deterministic, **shape,
        )
    d = num_decode_seqs
    decode = choose_config(num_tokens=d, num_seqs=d, max_query_len=1, max_seq_len=max_seq_len, **shape)
    rest = choose_config(
        num_tokens=num_tokens - d, num_seqs=num_seqs - d, max_query_len=max_query_len, max_seq_len=max_seq_len, **shape
    )
    return decode, rest


def launch_configs(
    *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, max_seq_len: int, deterministic: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> list[AttentionLaunchConfig]:
    """Every config ``choose_config`` can return for these heads and contexts up to ``max_seq_len``:
    the kernel variants to compile before a run, so that none is compiled in the middle of one.
    (Deterministic mode has one tile: its one-program variant, and when contexts can outgrow a part
    the several-program one, whatever their count, plus the merge kernel, which it compiles.)"""
    group_p = triton.next_power_of_2(num_heads // num_kv_heads)
    if deterministic:
        config = _deterministic_config(group_p, head_dim, dtype)
        return [dataclasses.replace(config, num_splits=n) for n in ((1, 2) if max_seq_len > config.part_keys else (1,))]
    by_length = max(1, max_seq_len // _MIN_KEYS_PER_SPLIT)
    configs = []
    prefill_block_qs = _prefill_block_qs(group_p, head_dim, dtype, cache_dtype)
    for block_q, max_splits in ((1, _MAX_SPLITS), *((b, _MAX_PREFILL_SPLITS) for b in prefill_block_qs)):
        splits = 1
        while splits <= _next_power_of_2(min(by_length, max_splits)):
            configs.append(_config(block_q, splits, group_p, head_dim, dtype, cache_dtype))
            splits *= 2
    return list(dict.fromkeys(configs))  # narrow == wide for fp32


def _prefill_block_qs(group_p: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Query tokens per program of the narrow (16-row) and wide prefill tiles."""
    fp32 = dtype == torch.float32  # tests only: ieee fp32 dots run on FMA units, keep tiles small
    # 128 x 128 fp32 accumulators fit 8 warps without spilling (checked with ptxas for sm_90);
    # head_dim 256 halves the rows; fp32 (FMA dots) keeps the 16 rows of decode.
    wide_rows = 16 if fp32 else FP8_CACHE_WIDE_ROWS if _fp8_cache_tiles(dtype, cache_dtype, head_dim) else 128 if head_dim <= 128 else 64
    return max(1, 16 // group_p), max(1, wide_rows // group_p)


def _fp8_cache_tiles(dtype: torch.dtype, cache_dtype: torch.dtype | None, head_dim: int) -> bool:
    """Whether decode and the wide prefill tile take the float8-cache launches (FP8_CACHE_*), which
    were measured at head_dim 128 with bf16 queries: other head sizes and fp32 (the tests' FMA
    dots) keep their own."""
    return dtype != torch.float32 and cache_dtype is not None and cache_dtype.itemsize == 1 and head_dim <= 128


def _config(
    block_q: int, num_splits: int, group_p: int, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> AttentionLaunchConfig:
    """``cache_dtype``: the KV cache's, when it differs from ``dtype`` (the queries')."""
    fp32 = dtype == torch.float32
    wide = not fp32 and block_q * group_p >= 128
    fp8_tiles = _fp8_cache_tiles(dtype, cache_dtype, head_dim)
    # The wide tile walks keys 32 at a time: on P5's 16,384-token prefill step (Qwen3-0.6B heads,
    # H200) 128 x 32 ran in 602 µs against 679 for 128 x 64, the best of eight tile/warp/stage rows
    # (`kernels_bench.py --p5 --sweep`; bench/results/gpu_kernels.jsonl, a80d492).
    tile_n = 16 if fp32 else 32 if wide or head_dim > 128 else 64
    if block_q == 1:
        if fp8_tiles:
            tile_n, num_warps, num_stages = FP8_CACHE_DECODE_TILE_N, FP8_CACHE_DECODE_WARPS, FP8_CACHE_DECODE_STAGES
        else:
            num_warps, num_stages = (4 if fp32 or head_dim > 128 else DECODE_WARPS), 3
    elif fp8_tiles and block_q * group_p >= FP8_CACHE_WIDE_ROWS:
        tile_n, num_warps, num_stages = 64, 4, 2
    else:
        num_warps = 8 if wide or (not fp32 and head_dim >= 256) else 4
        num_stages = 2 if fp32 else 3
    return AttentionLaunchConfig(block_q, tile_n, num_splits, num_warps, num_stages)


def _deterministic_config(group_p: int, head_dim: int, dtype: torch.dtype) -> AttentionLaunchConfig:
    """Deterministic mode's one tile: the narrow prefill tile (16 rows of tokens x heads), for decode
    too, with decode's tile_n on 4 warps and 3 stages (the launch its speed was measured with;
    DECODE_WARPS was timed on the default kernel only)."""
    narrow, _ = _prefill_block_qs(group_p, head_dim, dtype)
    decode = _config(1, 1, group_p, head_dim, dtype)
    return dataclasses.replace(decode, block_q=narrow, num_warps=4, num_stages=3, part_keys=DETERMINISTIC_PART_KEYS)


def _next_power_of_2(n: int) -> int:
    # Split counts are compile-time constants: powers of two bound the number of variants.
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _splits_off_decodes(num_decode_seqs: int, num_seqs: int, max_query_len: int) -> bool:
    """Whether a step's leading decodes get a launch of their own (there are some, and more)."""
    return 0 < num_decode_seqs < num_seqs and max_query_len > 1
