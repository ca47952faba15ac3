"""Mixture-of-experts MLP, ``sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, as two grouped
GEMMs over token-expert pairs (twin: ``reference.fused_moe_ref``).

A router gives each token t its top-K experts ``topk_ids[t, k]`` and weights ``topk_weights[t, k]``;
the flattened index ``p = t * K + k`` names one (token, expert) pair. ``moe_align`` sorts the pairs
by expert and pads each expert's run to a multiple of BLOCK_M with a sentinel (``T * K``), so every
BLOCK_M rows of the sorted list belong to one expert. The GEMM kernel then gives each program one
such block and one BLOCK_N slice of the output: it gathers its rows of A by pair (``x[p // K]`` for
gate_up, ``act[p]`` for down), multiplies them by that expert's weight and scatters the results
back to row ``p``. So no token's activations are ever copied into an expert-sorted buffer, and a
pair's output row is where a per-pair view of the batch expects it.

Why the static shapes: a decode step runs inside a CUDA graph, so nothing here may wait on the
host. The number of padded rows depends on the routing, so the grid covers an upper bound of
blocks and each program reads the real count (``num_padded``) from device memory and returns at
once when its block is unused (the bound, and how the pairs are grouped: ``moe_align.py``).

Rounding: both GEMMs accumulate in fp32 and round their output to x's dtype once (gate_up, then the
SiLU-mul, then down already multiplied by the pair's routing weight); the K pairs of a token are
summed in fp32, in pair order, and rounded once more.

fp8 weights (``quantization="fp8"``): the codes are loaded as they are stored (half the bytes of a
bf16 weight, which is what a decode step's expert GEMMs are bound by) and widened to x's dtype in
registers; each output column's scale multiplies the fp32 accumulator once after the K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.activation import silu_and_mul
from tokenmill.kernels.triton.moe_align import ONE_LAUNCH_MAX_PAIRS, moe_align
from tokenmill.kernels.triton.precompile import launcher
# The tiles of both GEMMs of one call (they share BLOCK_M because they share the alignment).
from tokenmill.kernels.triton.matmul import MatmulConfig as MoeConfig


# ``num_pairs`` (T * K) and ``num_blocks`` change with every batch size: not specialised on (Triton would
# otherwise compile a variant for a 1, and for a multiple of 16), so the variants the engine compiles
# while it starts (graph capture, the profiling step) are all a run needs.
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K_dim]; row r of pair p is p // top_k (x for gate_up, top_k = K) or p (act, top_k = 1)
    w_ptr,  # [E, N, K_dim]: each expert's Linear weight
    out_ptr,  # [num_pairs, N]: row p written by pair p
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32: pairs grouped by expert, sentinel num_pairs as padding
    block_experts_ptr,  # [num_blocks] int32
    num_padded_ptr,  # [1] int32: rows of sorted_pairs in use
    route_ptr,  # [num_pairs] fp32 routing weights (read only with ROUTE)
    w_scale_ptr,  # [E, N] fp32 per-output-channel scales of fp8 weights (read only with W_SCALED)
    num_pairs,
    N,
    K,
    top_k,
    num_blocks,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    ROUTE: tl.constexpr,
    W_SCALED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # GROUP_M row blocks walk N together, so the programs alive at once share weight tiles (an
    # expert's blocks are adjacent in the sorted list) and read them from L2 rather than HBM.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a block past this routing's padded rows: the grid is sized for the worst routing

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    valid = pairs < num_pairs
    # Padding rows read row 0 (any real row would do): no row mask on the loads, and their results
    # are never stored.
    rows = tl.where(valid, pairs // top_k, 0).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_in = (rn % N).to(tl.int64)  # columns past N read a real weight row; never stored
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + expert * stride_we + rn_in[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, BLOCK_N] of W_e^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = rk < K - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if W_SCALED:  # fp8 codes widened in registers; their scale is a column's, applied once below
            b = b.to(a_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if W_SCALED:
        acc = acc * tl.load(w_scale_ptr + expert * stride_se + rn_in)[None, :]
    if ROUTE:
        acc = acc * tl.load(route_ptr + pairs, mask=valid, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (rn < N)[None, :])


# The tiles follow the mean token-expert pairs an expert (T K / E), the rows each expert's GEMM
# has. Swept on an H100 (bench/moe_tile_sweep.py, docs/perf.md 88) with 18 tiles at T = 1-16,384
# on Qwen3-30B-A3B's, Qwen1.5-MoE-A2.7B's and Mixtral-8x7B's experts; each class below was within
# 3% of the best tile at every size the sweep timed in its range, on all three shapes.
# Up to 8 pairs an expert (decode steps): the GEMM streams the touched experts' weights; 16-row
# blocks waste little on padding, and 64-wide, 128-deep tiles keep enough programs in flight
# (Qwen3-30B-A3B's gate_up at one token: 8 experts x 24 column tiles).
SMALL_TILES = MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
# 8-48 (Qwen3-30B-A3B's decode steps of 128-512 sequences): 32-row blocks 256 wide read each weight
# tile for twice the rows (16 x 64 was 1.04-1.24x slower there; the large tiles 1.14x at 34).
MEDIUM_TILES = MoeConfig(block_m=32, block_n=256, block_k=128, num_warps=4, num_stages=2)
# Past 48 (prompt steps): 128 x 256 tiles on two warpgroups, compute-bound (the medium ones were
# 1.06-1.25x slower at 64); 64 x 128 x 64, the class before the sweep, was 1.08-1.6x slower.
LARGE_TILES = MoeConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)


def tile_classes(hidden: int, inter: int, fp8_weights: bool) -> list[tuple[float, MoeConfig]]:
    """(the most mean pairs an expert, tiles) in order, for experts of these sizes. The wide tiles
    keep their operands in registers only where both GEMMs' K (H, I) fill whole K steps: with a
    masked tail they spill (1-16 KB a thread, sm_90; tests/kernel_compile_sm90.py), as the medium
    tiles do on fp8 codes widened in registers (28 B), so those take the small tiles instead."""
    if hidden % 128 or inter % 128:
        return [(float("inf"), SMALL_TILES)]
    return [(8, SMALL_TILES), (48, SMALL_TILES if fp8_weights else MEDIUM_TILES), (float("inf"), LARGE_TILES)]


def precompile_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, dtype: torch.dtype,
                       batch_invariant: bool = False, w13_scale: torch.Tensor | None = None,
                       w2_scale: torch.Tensor | None = None) -> None:
    """Compile (launch nothing) every variant ``fused_experts`` can launch over these experts for calls
    of up to ``max_tokens`` tokens, as the layer calls it (its dtype, its fp8 scales, deterministic
    mode or not): the calls of ``variant_token_counts`` cover them."""
    classes = tile_classes(w13.shape[2], w2.shape[2], w13_scale is not None)
    for tokens in variant_token_counts(classes, w13.shape[0], top_k, max_tokens):
        x = torch.zeros((tokens, w13.shape[2]), dtype=dtype, device=w13.device)
        ids = torch.zeros((tokens, top_k), dtype=torch.int64, device=w13.device)
        fused_experts(x, w13, w2, torch.ones((tokens, top_k), device=w13.device), ids, batch_invariant=batch_invariant,
                      w13_scale=w13_scale, w2_scale=w2_scale, compile_only=True)


def variant_token_counts(classes: list[tuple[float, MoeConfig]], num_experts: int, top_k: int, max_tokens: int) -> list[int]:
    """Token counts of up to ``max_tokens`` whose calls, between them, launch every Triton variant
    ``fused_experts`` can for experts with these ``tile_classes``: one token (the first class, the
    one-launch alignment on its blocks), the fewest that take each later class, and the fewest past
    the one-launch alignment (the chunked alignment, on the blocks of the class that count falls in;
    a later class's first count, past it too, covers that class's). Larger calls add no variant."""
    counts = [1]
    for limit, _ in classes[:-1]:
        counts.append(int(limit * num_experts) // top_k + 1)
    counts.append(ONE_LAUNCH_MAX_PAIRS // top_k + 1)
    return sorted({count for count in counts if count <= max_tokens})


def choose_config(num_pairs: int, num_experts: int, dtype: torch.dtype,
                  classes: list[tuple[float, MoeConfig]]) -> MoeConfig:
    """The tiles of ``classes`` (``tile_classes``) for ``num_pairs`` token-expert pairs over
    ``num_experts`` experts, by the mean pairs an expert (a compiled variant a class, GEMM and dtype).
    fp32 (tests only: FMA dots) takes the class's block rows on narrow tiles in few stages, so its
    operands fit shared memory."""
    tiles = next(config for limit, config in classes if num_pairs <= limit * num_experts)
    if dtype == torch.float32:
        return MoeConfig(block_m=min(tiles.block_m, 64), block_n=32, block_k=32, num_warps=4, num_stages=2)
    return tiles


def moe_gemm(
    a: torch.Tensor,  # [rows, K_dim], last dim contiguous
    w: torch.Tensor,  # [E, N, K_dim], last dim contiguous
    out: torch.Tensor,  # [T * K, N], last dim contiguous, a's dtype
    sorted_pairs: torch.Tensor,
    block_experts: torch.Tensor,
    num_padded: torch.Tensor,
    config: MoeConfig,
    *,
    top_k: int,  # A's row of pair p is p // top_k (x: the router's K; a per-pair act: 1)
    topk_weights: torch.Tensor | None = None,  # [T * K] fp32: multiplies pair p's row when given
    w_scale: torch.Tensor | None = None,  # [E, N] fp32: w holds fp8 codes, each output column scaled by its own
    compile_only: bool = False,  # compile this launch's variant, launch nothing (precompile.launcher)
) -> torch.Tensor:
    """``out[p] = (a[p // top_k] @ (w[e_p] * w_scale[e_p, :, None]).T) * topk_weights[p]`` for every pair p
    of ``moe_align``'s lists (made with ``config.block_m``); rows of pairs that are not listed are left untouched."""
    num_pairs, n = out.shape
    k = a.shape[1]
    if w.shape[2] != k or a.stride(1) != 1 or w.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError(f"moe_gemm: a {tuple(a.shape)} and w {tuple(w.shape)} need the same K and contiguous last dims")
    if w_scale is not None and (w_scale.shape != w.shape[:2] or w_scale.stride(1) != 1 or w_scale.dtype != torch.float32):
        raise ValueError(f"moe_gemm: w_scale must be float32 [{w.shape[0]}, {w.shape[1]}] with contiguous rows")
    num_blocks = block_experts.numel()
    if num_pairs == 0 or num_blocks == 0:
        return out
    grid = (num_blocks * triton.cdiv(n, config.block_n),)
    launcher(_moe_gemm_kernel, grid, compile_only)(
        a, w, out, sorted_pairs, block_experts, num_padded,
        topk_weights if topk_weights is not None else sorted_pairs,  # unread without ROUTE
        w_scale if w_scale is not None else sorted_pairs,  # unread without W_SCALED
        num_pairs, n, k, top_k, num_blocks,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), w_scale.stride(0) if w_scale is not None else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        EVEN_K=k % config.block_k == 0, ROUTE=topk_weights is not None, W_SCALED=w_scale is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def fused_experts(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows :I are gate's weight, I: up's
    w2: torch.Tensor,  # [E, H, I]: down's weight
    topk_weights: torch.Tensor,  # [T, K], fp32 (other float dtypes are converted)
    topk_ids: torch.Tensor,  # [T, K] int32/int64 in [0, E)
    *,
    config: MoeConfig | None = None,
    out: torch.Tensor | None = None,  # [T, H] in x's dtype, contiguous
    batch_invariant: bool = False,
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32 when w13 holds fp8 codes
    w2_scale: torch.Tensor | None = None,  # [E, H] fp32 when w2 holds fp8 codes
    compile_only: bool = False,
) -> torch.Tensor:
    """``out[t] = sum_k topk_weights[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``, e = topk_ids[t,k],
    in x's dtype: align, gate_up GEMM, SiLU-mul, down GEMM (routing weight applied), sum over K.
    No host sync: capturable in a CUDA graph for a fixed T. ``config`` overrides ``choose_config``
    (tests, benchmarks); ``out`` receives the result (tests poison it). ``batch_invariant`` (deterministic
    mode): one tile class at every size, since a row's bits follow its tile (a pair's row is computed
    alone within it, whatever rows share its block), so a token's output does not depend on the
    batch (its k pairs are summed in pair order at every size). ``w13_scale`` / ``w2_scale``: the
    weights are float8 e4m3 codes with a scale per output channel, widened to x's dtype in registers.
    ``compile_only``: compile the Triton variants this call would launch (``ModelRunner.precompile_kernels``);
    the result is then meaningless."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    if w13.shape != (num_experts, 2 * inter, h) or w2.shape != (num_experts, h, inter):
        raise ValueError(f"w13 must be [E, 2I, {h}] and w2 [E, {h}, I], got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids and topk_weights must both be [{t}, K], got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    for w, scale, name in ((w13, w13_scale, "w13"), (w2, w2_scale, "w2")):
        if w.dtype != (x.dtype if scale is None else torch.float8_e4m3fn):
            raise ValueError(f"{name} must be in x's dtype ({x.dtype}), or float8_e4m3fn with {name}_scale; "
                             f"got {w.dtype} {'with' if scale is not None else 'without'} a scale")
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    elif out.shape != (t, h) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous [{t}, {h}] in {x.dtype}")
    if t == 0:
        return out
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if x.stride(1) != 1:
        x = x.contiguous()
    classes = tile_classes(h, inter, w13_scale is not None)
    config = config or choose_config(0 if batch_invariant else num_pairs, num_experts, x.dtype, classes)
    sorted_pairs, block_experts, num_padded = moe_align(topk_ids, num_experts, config.block_m, compile_only)
    lists = (sorted_pairs, block_experts, num_padded, config)
    gate_up = moe_gemm(x, w13, torch.empty((num_pairs, 2 * inter), dtype=x.dtype, device=x.device), *lists, top_k=top_k,
                       w_scale=w13_scale, compile_only=compile_only)
    act = silu_and_mul(gate_up)
    del gate_up  # back to the allocator before down's output is taken
    route = topk_weights.reshape(-1).to(torch.float32)
    if top_k == 1:  # one pair a token: its weighted row is the result, rounded once either way
        return moe_gemm(act, w2, out, *lists, top_k=1, topk_weights=route, w_scale=w2_scale, compile_only=compile_only)
    down = moe_gemm(act, w2, torch.empty((num_pairs, h), dtype=x.dtype, device=x.device), *lists, top_k=1,
                    topk_weights=route, w_scale=w2_scale, compile_only=compile_only)
    del act
    block = min(1024, triton.next_power_of_2(h))
    launcher(_sum_pairs_kernel, (t, triton.cdiv(h, block)), compile_only)(down, out, h, TOP_K=top_k, BLOCK=block)
    return out


@triton.jit
def _sum_pairs_kernel(pairs_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """A token's K pair rows (``down``, [T * K, H]) summed in fp32 in pair order, rounded once: one
    launch (torch's ``sum(dim=1)`` and the copy into ``out`` were two, ~12 µs a decode layer on an
    H100; docs/perf.md 90), and a fixed order whatever T is, so deterministic mode needs nothing else."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    rows = pairs_ptr + token * TOP_K * hidden + cols
    total = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, TOP_K):
        total += tl.load(rows + k * hidden, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=mask)
