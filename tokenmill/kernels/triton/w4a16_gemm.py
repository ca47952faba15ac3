"""W4A16 GEMM: ``y = x W^T (+ b)`` with W stored as 4-bit codes, dequantized in registers.

The weight lies in a layout made for this kernel (``pack_for_kernel``, done once at load from
``tokenmill.quantization.int4.Int4Weights``): K is cut into tiles of 128, and in a tile the int32
word ``j`` (0..15) of output ``n`` holds the codes of features ``16 i + j`` in its nibbles
``i`` = 0..7. So the nibble-``i`` codes of a tile's 16 words are one contiguous 16-feature slice of
K, and the tile's product is eight K=16 dots ``x[:, 16i:16i+16] . ((words >> 4i) & 0xF)`` in which
the unpacking is elementwise: the words go global -> shared memory (asynchronous copies, several
tiles in flight) -> registers in the MMA operand's layout once, and no dequantized weight ever
round-trips through shared memory (the old GPTQ-ordered layout needed a reshape that did: a 16 KB
bf16 store and reload per 4 KB of words; see docs/perf.md entry 15).

A code becomes a bf16/fp16 value without an int->float conversion: ``0x4300 | u`` is the bf16
bit pattern of 128 + u (``0x6400 | u`` the fp16 one of 1024 + u), and subtracting 128 + z gives the
exact integer ``u - z``; the dot's fp32 partial is multiplied by the group's scale (a K slice never
straddles two groups).

Decode sizes (M <= SWAPPED_MAX_M) swap the operands, ``y^T = W x^T``, so the dequantized weight is
the warpgroup MMA's register operand (64 outputs a warpgroup) and the few tokens are its N; K is
split over SPLIT_K programs per tile to keep every SM streaming weights, the partials summed in
split order by the last program of a tile to arrive (``split_k.store_tile``, deterministic).

Larger steps (M >= DEQUANT_MIN_M: prefill, decode batches past 128 sequences) do not run this
GEMM: ``w4a16_linear`` dequantizes the whole weight into a bf16/fp16 scratch
(``dequantize_weight``: one pass that reads 0.5 B and writes 2 B a weight) and hands it to cuBLAS.
Past the swapped range this GEMM's plain tiles ran at 51-233 TFLOP/s on the H200, cuBLAS's bf16
GEMM near the tensor cores' peak (a kernel that dequantizes every tile it loads spends issue
slots on unpacking); the pass costs 2.5 B a weight of HBM traffic, ~4% of Llama-3-8B's
gate_up GEMM at M = 8192 (~0.1 of ~2.6 ms). Which path runs depends only on M, never on data: a
decode CUDA graph of fewer rows holds the GEMM, one of DEQUANT_MIN_M rows or more the pass and
cuBLAS (its scratch in the graphs' pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.split_k import counters_needed as _split_k_counters
from tokenmill.kernels.triton.sm_count import num_sms
from tokenmill.kernels.triton.split_k import store_tile

# The GEMM's fast form (operands swapped, the weight as the wgmma register operand, K split while
# output tiles are few) runs up to this M, in row tiles of at most 64 (a program's tokens are the
# MMA's N: 64 keeps one warpgroup's accumulators in registers).
SWAPPED_MAX_M = 128
# From this M on, dequantize-then-cuBLAS (module docstring). The GEMM's plain tiles ran 2.4-3.6x
# slower than the pass + cuBLAS on every Llama-3-8B projection at M = 128 on the H200 (qkv 83.6
# against 35.2 µs, gate_up 332.6 against 186.3; bench/results/gpu_quant_gemm.jsonl, 566e93c), so
# the GEMM keeps only its swapped range. 65-128 rows take two 64-row swapped tiles: at M = 128 a
# layer's four projections took 205 µs against 327 for the pass + cuBLAS (ae892a2, docs/perf.md 25).
DEQUANT_MIN_M = SWAPPED_MAX_M + 1
K_TILE = 128  # features per packed tile: 16 words of 8 codes; every K step of the kernel is one tile


@triton.jit
def _dequantize(words, shift: tl.constexpr, zero, dtype: tl.constexpr, ASM: tl.constexpr):
    """The codes in nibble ``shift / 4`` of ``words`` minus the zero point, exactly, as ``dtype``."""
    if ASM and (dtype == tl.bfloat16 or dtype == tl.float16):
        # Two words at a time: prmt gathers the 16-bit half of each that holds nibble shift / 4, one
        # shift and one lop3 ((t & 0x000F000F) | magic) make both codes' biased floats in one register.
        amount = tl.full(words.shape, shift % 16, tl.int32)
        half: tl.constexpr = "0x5410" if shift < 16 else "0x7632"  # prmt selector: low or high halves
        magic: tl.constexpr = "0x43004300" if dtype == tl.bfloat16 else "0x64006400"
        asm: tl.constexpr = ("{ .reg .b32 t; prmt.b32 t, $1, $2, " + half + "; shr.b32 t, t, $3; "
                             "lop3.b32 $0, t, 0x000F000F, " + magic + ", 0xEA; }")
        if dtype == tl.bfloat16:
            biased = tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, amount], dtype=tl.bfloat16, is_pure=True, pack=2)
            return biased - (zero + 128).to(tl.bfloat16)
        else:
            biased = tl.inline_asm_elementwise(asm, "=r,r,r,r,r", [words, amount], dtype=tl.float16, is_pure=True, pack=2)
            return biased - (zero + 1024).to(tl.float16)
    codes = (words >> shift) & 0xF
    if dtype == tl.bfloat16:
        biased = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + u
        return biased - (zero + 128).to(tl.bfloat16)
    elif dtype == tl.float16:
        biased = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + u
        return biased - (zero + 1024).to(tl.float16)
    else:
        return (codes - zero).to(dtype)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "split_k"])
def _w4a16_kernel(
    x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, y_ptr, partial_ptr, counter_ptr,
    M, N, K, num_groups, group_size, tiles_per_split, split_k,
    stride_xm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr, SLICE_GROUPS: tl.constexpr, GROUP_IS_TILE: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, DEQUANT_ASM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    # Loads need no masks on the usual shapes: rows past M read row rm mod M (their results are never
    # stored), and EVEN_N / EVEN_K say N and K fill whole tiles. Fewer predicates, fewer instructions.
    # (Not all of them row M - 1: with 32 columns of a 64-row tile on one row, M = 96 ran 1.4-2x
    # slower than M = 128 on the H200; docs/perf.md entry 27.)
    rm_in = rm % M
    n_in = n_ok
    if EVEN_N:
        n_in = tl.full((BLOCK_N,), 1, tl.int1)
    k_in = tl.full((16,), 1, tl.int1)
    rj = tl.arange(0, 16)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    precision: tl.constexpr = "ieee" if IEEE else "tf32"
    # Tile t of K holds features 128 t .. 128 t + 127 in rows 16 t .. 16 t + 15 of the packed words;
    # k_begin is a multiple of 128 by construction, which keeps every x slice 16-byte aligned (the
    # alignment the pipeliner needs to copy it asynchronously).
    k_begin = pid_k * tiles_per_split * 128
    k_end = tl.minimum(k_begin + tiles_per_split * 128, K)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One group per tile (SLICE_GROUPS off): its scale and zero point are loaded a tile ahead, so the
    # loop never waits on them.
    group = k_begin // group_size
    scale = tl.load(scale_ptr + group * N + rn, mask=n_in, other=0.0).to(tl.float32)
    zero = tl.full((BLOCK_N,), 8, tl.int32)
    if HAS_ZEROS:
        zero = tl.load(zero_ptr + group * N + rn, mask=n_in, other=0).to(tl.int32)
    for k0 in range(k_begin, k_end, 128):
        word_rows = k0 // 8 + rj
        if SWAP:
            words = tl.load(qw_ptr + word_rows[None, :] * N + rn[:, None], mask=n_in[:, None], other=0)
        else:
            words = tl.load(qw_ptr + word_rows[:, None] * N + rn[None, :], mask=n_in[None, :], other=0)
        next_scale = scale
        next_zero = zero
        if not SLICE_GROUPS:
            if GROUP_IS_TILE:
                next_group = tl.minimum(k0 // 128 + 1, num_groups - 1)  # no integer division in the loop
            else:
                next_group = tl.minimum((k0 + 128) // group_size, num_groups - 1)
            next_scale = tl.load(scale_ptr + next_group * N + rn, mask=n_in, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                next_zero = tl.load(zero_ptr + next_group * N + rn, mask=n_in, other=0).to(tl.int32)
        if SWAP:
            part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in tl.static_range(8):
            rk = k0 + 16 * i + rj
            if not EVEN_K:
                k_in = rk < K
            if SLICE_GROUPS:
                # Groups of 16..64 features: each 16-feature slice has its own scale and zero point.
                slice_group = tl.minimum((k0 + 16 * i) // group_size, num_groups - 1)
                scale = tl.load(scale_ptr + slice_group * N + rn, mask=n_in, other=0.0).to(tl.float32)
                if HAS_ZEROS:
                    zero = tl.load(zero_ptr + slice_group * N + rn, mask=n_in, other=0).to(tl.int32)
            if SWAP:
                xt = tl.load(x_ptr + rm_in[None, :] * stride_xm + rk[:, None], mask=k_in[:, None], other=0.0)
                w = _dequantize(words, 4 * i, zero[:, None], dtype, DEQUANT_ASM)
                if SLICE_GROUPS:
                    acc += tl.dot(w, xt, input_precision=precision) * scale[:, None]
                else:
                    part = tl.dot(w, xt, part, input_precision=precision)
            else:
                a = tl.load(x_ptr + rm_in[:, None] * stride_xm + rk[None, :], mask=k_in[None, :], other=0.0)
                w = _dequantize(words, 4 * i, zero[None, :], dtype, DEQUANT_ASM)
                if SLICE_GROUPS:
                    acc += tl.dot(a, w, input_precision=precision) * scale[None, :]
                else:
                    part = tl.dot(a, w, part, input_precision=precision)
        if not SLICE_GROUPS:
            if SWAP:
                acc += part * scale[:, None]
            else:
                acc += part * scale[None, :]
            scale = next_scale
            zero = next_zero
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    store_tile(out, rm, rn, M, N, y_ptr, stride_ym, bias_ptr, partial_ptr, counter_ptr, pid_k, split_k,
               pid_m * tl.num_programs(0) + pid_n, HAS_BIAS, SPLIT, BLOCK_M, BLOCK_N)


@triton.jit
def _dequantize_kernel(qw_ptr, scale_ptr, zero_ptr, w_ptr, N, K, num_groups, group_size,
                       BLOCK_N: tl.constexpr, HAS_ZEROS: tl.constexpr, DEQUANT_ASM: tl.constexpr):
    """One 128-feature tile of K x BLOCK_N outputs: the tile's 16 words a column hold nibble i of
    features 16 i + j, so each nibble is a [16, BLOCK_N] slab of w^T, stored contiguous along N."""
    pid_n = tl.program_id(0)
    tile = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, 16)
    n_ok = rn < N
    dtype: tl.constexpr = w_ptr.dtype.element_ty
    words = tl.load(qw_ptr + (tile * 16 + rj)[:, None] * N + rn[None, :], mask=n_ok[None, :], other=0)
    for i in tl.static_range(8):
        k0 = tile * 128 + 16 * i
        # A 16-feature slice lies in one group (group_size is a multiple of 16, or >= K).
        group = tl.minimum(k0 // group_size, num_groups - 1)
        scale = tl.load(scale_ptr + group * N + rn, mask=n_ok, other=0.0).to(tl.float32)
        zero = tl.full((BLOCK_N,), 8, tl.int32)
        if HAS_ZEROS:
            zero = tl.load(zero_ptr + group * N + rn, mask=n_ok, other=0).to(tl.int32)
        w = _dequantize(words, 4 * i, zero[None, :], dtype, DEQUANT_ASM).to(tl.float32) * scale[None, :]
        rk = k0 + rj
        tl.store(w_ptr + rk[:, None] * N + rn[None, :], w.to(dtype), mask=(rk < K)[:, None] & n_ok[None, :])


def dequantize_weight(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                      in_features: int, dtype: torch.dtype, out: torch.Tensor | None = None,
                      dequant_asm: bool | None = None) -> torch.Tensor:
    """``packed`` (``pack_for_kernel``'s layout) -> the weight's transpose w^T [K, N] in ``dtype``,
    ``(u - z) * s`` rounded once from fp32. [K, N] rather than [N, K]: the words lie along N, so
    every store is a contiguous row, and cuBLAS reads either operand order (``w4a16_linear``
    passes its ``.t()`` view). ``out`` receives it (tests poison it); otherwise a fresh tensor from
    torch's caching allocator, which hands the same block to the next layer's call. ``dequant_asm``:
    the inline-PTX unpacking (default: on CUDA devices; the sm_90 compile check forces it)."""
    k, n = in_features, packed.shape[1]
    _check_operands(packed, k, group_size)
    w = out if out is not None else torch.empty((k, n), dtype=dtype, device=packed.device)
    block_n = 128
    asm = packed.device.type == "cuda" if dequant_asm is None else dequant_asm
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, K_TILE))](
        packed, scales, zeros if zeros is not None else scales, w, n, k, scales.shape[0], group_size,
        BLOCK_N=block_n, HAS_ZEROS=zeros is not None, DEQUANT_ASM=asm, num_warps=4,
    )
    return w


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None, counters: torch.Tensor) -> torch.Tensor:
    """``y = x W^T (+ b)`` for x [M, K] at any M: the register-dequant GEMM below DEQUANT_MIN_M,
    dequantize-then-cuBLAS from it on (the choice depends on M alone)."""
    if x.shape[0] < DEQUANT_MIN_M:
        return w4a16_gemm(x, packed, scales, zeros, group_size, bias, counters)
    w_t = dequantize_weight(packed, scales, zeros, group_size, x.shape[1], x.dtype)
    return torch.nn.functional.linear(x, w_t.t(), bias)


def pack_for_kernel(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Codes packed along K eight to a word in feature order (``Int4Weights.qweight``, [ceil(K/8), N])
    -> this kernel's layout, [16 * ceil(K/128), N] int32: in each 128-feature tile, word j's nibble i
    holds feature 16 i + j (past K: the source's padding nibbles or 0; their activations are masked to 0).

    Feature 16 i + j of tile t sits in source word 16 t + 2 i + j // 8, nibble j % 8; moved with
    shifts on [tiles, 2, N] slices, so no [K, N] intermediate is made (an 8B gate_up is 117M codes)."""
    tiles = triton.cdiv(in_features, K_TILE)
    src = torch.nn.functional.pad(qweight, (0, 0, 0, 16 * tiles - qweight.shape[0]))
    src = src.view(tiles, 8, 2, -1)  # [t, i, j // 8, n]
    out = torch.zeros((tiles, 2, 8, src.shape[-1]), dtype=torch.int64, device=qweight.device)  # [t, j // 8, j % 8, n]
    for low in range(8):
        for i in range(8):
            out[:, :, low] |= ((src[:, i] >> (4 * low)) & 0xF).to(torch.int64) << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out)  # the int32 with the same bits
    return out.to(torch.int32).view(16 * tiles, -1)


def choose_config(m: int, n: int, k: int, group_size: int, num_sms: int) -> dict[str, int]:
    """Tile sizes, warps, stages and the K split for an [m, k] x [k, n] product (a fixed small set,
    so few variants compile: BLOCK_M from M's size class, the split a run-time argument)."""
    if m > SWAPPED_MAX_M:
        return dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, split_k=1)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)  # 65-128 rows: two 64-row tiles
    # 128 outputs a program: the per-K-step cost of addressing the eight x slices and waiting on
    # the MMAs is shared by twice the weights of 64 (3.4 instead of 4.9 SASS instructions a weight
    # at M <= 16, compiled for sm_90).
    block_n = 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = triton.cdiv(k, K_TILE)
    # Split K while the doubled launch stays within ~one wave (4 programs an SM: at BLOCK_M <= 32
    # that many fit at 3 stages); a second, partial wave would leave SMs idle at the tail. Each
    # split streams at least 4 K tiles; at most 8 splits (past BLOCK_M 16 the last program sums the
    # partials one dependent L2 load at a time, and 16 never won a sweep: Llama-3-8B's down at
    # M = 32 took 34 µs at 16 splits and 4 stages, 24 at 8 and 3); and the fp32 partials
    # (split * M * N * 4 bytes, through L2) stay at most half the packed weight's bytes (N * K / 2),
    # so fewer splits as M grows.
    split = 1
    while tiles * split * 2 <= 4 * num_sms and split * 2 <= min(8, k_tiles // 4, k // (16 * m)):
        split *= 2
    # 3 stages at every decode size: in the H200 sweep (bench/quant_gemm_bench.py, Llama-3-8B's four
    # projections, M 1-64) the best config had 3 stages in 25 cases of 28 (gate_up at M 1, 4 and 8
    # kept 4). From 32 tokens, a wide weight (its 256-output tiles over all row tiles, K unsplit,
    # give at least half the SMs one) takes 256 outputs a program on two warpgroups, which share
    # each x tile: on gate_up (N 28,672) that ran 36.7 / 52.9 / 57.0 / 91.5 µs against 39.0 / 69.3
    # / 70.4 / 105.7 for 128 on one at M = 32 / 48 / 64 / 96 (9333d16, same K split; docs/perf.md
    # entry 27). Narrower weights (qkv, o, down: 16-24 such tiles) keep one warpgroup, as gate_up
    # does up to 16 tokens, where the sweep's two-warpgroup configs lost.
    num_warps = 4
    if block_m >= 32 and triton.cdiv(n, 256) * triton.cdiv(m, block_m) >= num_sms // 2:
        block_n, num_warps = 256, 8
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=3, split_k=split)


def counters_needed(n: int) -> int:
    """Size of the per-layer split-K counter buffer: one per output tile of the largest split launch."""
    return _split_k_counters(n, SWAPPED_MAX_M)


def w4a16_gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    counters: torch.Tensor,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32, ``packed`` from ``pack_for_kernel`` -> [M, N] in x's dtype.
    ``counters``: int32 zeros (``counters_needed``), left zeroed again. ``config`` overrides
    ``choose_config`` (tests force splits and tiles; ``SWAP`` defaults to M <= SWAPPED_MAX_M);
    ``out`` receives y (tests poison it)."""
    m, k = x.shape
    n = packed.shape[1]
    _check_operands(packed, k, group_size)
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = dict(config or choose_config(m, n, k, group_size, num_sms(x.device)))
    split = cfg.pop("split_k")
    cfg.setdefault("SWAP", m <= SWAPPED_MAX_M)
    cfg.setdefault("DEQUANT_ASM", x.device.type == "cuda")
    k_tiles = triton.cdiv(k, K_TILE)
    tiles_per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles_per_split)  # rounding may leave fewer non-empty splits
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split)
    if split > 1 and grid[0] * grid[1] > counters.numel():
        raise ValueError(f"split-K over {grid[0] * grid[1]} tiles needs that many counters, got {counters.numel()}")
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _w4a16_kernel[grid](
        x, packed, scales, zeros if zeros is not None else scales, bias if bias is not None else scales,
        y, partial, counters, m, n, k, scales.shape[0], group_size, tiles_per_split, split, x.stride(0), y.stride(0),
        SLICE_GROUPS=group_size < k and group_size % K_TILE != 0, GROUP_IS_TILE=group_size == K_TILE,
        EVEN_N=n % cfg["BLOCK_N"] == 0, EVEN_K=k % K_TILE == 0, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None,
        SPLIT=split > 1, IEEE=x.dtype == torch.float32, **cfg,
    )
    return y


def _check_operands(packed: torch.Tensor, k: int, group_size: int) -> None:
    if packed.shape[0] != 16 * triton.cdiv(k, K_TILE):
        raise ValueError(f"packed weight has {packed.shape[0]} rows; K={k} needs {16 * triton.cdiv(k, K_TILE)} (pack_for_kernel)")
    if group_size < k and group_size % 16:
        raise ValueError(f"group_size={group_size}: the W4A16 kernel needs a multiple of 16 (or one group per row)")
