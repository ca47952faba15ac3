"""Decode attention micro-benchmark: achieved bandwidth of the Triton paged attention kernel.

Default: a P1-like decode step (256 sequences, contexts ~1000, Qwen3-0.6B heads: 16 q / 8 kv,
head_dim 128, block 16, bf16), timed through CUDA-graph replays (no launch gaps), correctness
checked against the plain-torch twin first. Decode attention is memory-bound: the figure of merit
is bytes that must move (each context token's K and V once, q once, out once, block tables)
over time, against the H200's measured 4.3 TB/s copy bandwidth.

Prints one JSON line per measured configuration to stdout (the first is the default launch
shape; the second, bench "qkv_prologue", times the fused norm + rope + KV-store kernel against
the five launches it replaces on the same decode shape (Qwen3's qk-norm on); --sweep adds
tile/warp/stage variants, --long adds few-sequence 32K-context decode with and without
split-KV). Then one row per P6 shape for the varlen attention of pooling models (a 64K-token step
of packed prompts: achieved TFLOP/s, and the speedup over the padded-group SDPA path it replaced);
--varlen-sweep adds its tile variants. --batch-sweep runs only decode steps at P1's graph buckets
(and P2's and P5's steps) over K splits and tiles, bf16 and fp8. --p5 runs only P5's prefill-phase steps instead (bench
"step_attention": a 16,384-token prefill step in TFLOP/s, a mixed step of 256 decodes + prefill
chunks in one launch, split, and split on two streams, and the decodes alone; with --sweep,
prefill tile shapes). Usage:
    python bench/kernels_bench.py [--sweep] [--long] [--varlen-sweep] [--seqs 256 --ctx 1000 ...]
    python bench/kernels_bench.py --p5 [--sweep]
    python bench/kernels_bench.py --batch-sweep [--heads 32]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tokenmill, and the random batches of tests/support/

# The timers and row fields (other benches import them from here too, e.g. quant_gemm_bench.py).
from gpu_timing import _provenance, _time_events, _time_graph  # noqa: E402
from support.kernel_cases import make_paged_batch  # noqa: E402
from tokenmill.kernels.reference import paged_attention_ref  # noqa: E402

HBM_GBPS = 4300.0  # measured device-to-device copy on this workplace's H200s (KINDS.md)


def run_case(
    args: argparse.Namespace, seq_lens: list[int], label: str, config: Any | None,
    cache_dtype: torch.dtype | None = None, graph_batch: int | None = None, graph_max_seq: int | None = None,
    batch: Any | None = None,
) -> dict[str, Any]:
    """``graph_batch``/``graph_max_seq``: choose the launch shape as a CUDA graph of that bucket and
    max_model_len would (the runner's decode graphs), instead of from this batch's own bounds.
    ``batch``: a ``decode_batch`` of these ``seq_lens`` to reuse (sweeps time many configs on one)."""
    from tokenmill.kernels.triton.paged_attention import choose_config, paged_attention

    dtype = getattr(torch, args.dtype)
    if batch is None:
        batch = decode_batch(args, seq_lens, cache_dtype)
    scale = args.head_dim**-0.5
    max_seq = graph_max_seq or max(seq_lens)
    if config is None:
        config = choose_config(
            num_tokens=graph_batch or len(seq_lens), num_seqs=graph_batch or len(seq_lens), num_heads=args.heads, num_kv_heads=args.kv_heads,
            head_dim=args.head_dim, dtype=dtype, max_query_len=1, max_seq_len=max_seq, device=batch.q.device,
            cache_dtype=batch.kv_cache.dtype,
        )
    out = torch.full_like(batch.q, float("nan"))

    def call() -> None:
        paged_attention(
            batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
            max_query_len=1, max_seq_len=max_seq, out=out, config=config,
        )

    call()
    expected = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    err = (out.float() - expected.float()).abs().max().item()
    rel = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    if not (rel < 2e-2):
        raise SystemExit(f"{label}: wrong result (max abs err {err}, rel {rel}) with {config}")
    us_median, us_min = _time_graph(call)
    elem = batch.kv_cache.element_size()
    total_ctx = sum(seq_lens)
    kv_bytes = total_ctx * args.kv_heads * args.head_dim * 2 * elem
    qo_bytes = 2 * len(seq_lens) * args.heads * args.head_dim * batch.q.element_size()
    table_bytes = sum(-(-s // args.block_size) for s in seq_lens) * 4
    total = kv_bytes + qo_bytes + table_bytes
    gbps = total / (us_median * 1e-6) / 1e9
    return {
        **_provenance("decode_attention", label),
        "seqs": len(seq_lens),
        "ctx_mean": round(total_ctx / len(seq_lens), 1),
        "ctx_max": max_seq,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "cache_dtype": str(batch.kv_cache.dtype).removeprefix("torch."),
        "config": {k: getattr(config, k) for k in ("block_q", "tile_n", "num_splits", "num_warps", "num_stages")},
        "bytes": total,
        "us_median": round(us_median, 2),
        "us_min": round(us_min, 2),
        "gbps": round(gbps, 1),
        "frac_of_4300": round(gbps / HBM_GBPS, 3),
        "max_abs_err": err,
        "rel_err": rel,
    }


def decode_batch(args: argparse.Namespace, seq_lens: list[int], cache_dtype: torch.dtype | None = None) -> Any:
    """One decode token per sequence over random paged contexts of ``seq_lens`` (GPU)."""
    return make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, dtype=getattr(torch, args.dtype), device="cuda", seed=0, cache_dtype=cache_dtype,
    )


def protocol_contexts(workload_name: str, num_running: int) -> list[int]:
    """The contexts of a protocol's first decode step with at most ``num_running`` sequences left.

    The protocol's requests as peer_bench.py draws them (``workload``), all running from the start
    as P1's do on the H200: at decode step t request i holds prompt_i + t tokens while
    outputs_i > t. Ragged lengths, as the engine's decode graphs meet them, rather than one length
    with a little jitter.
    """
    from peer_bench import workload  # this folder's copy of the shared protocol script

    prompts, outputs, _ = workload(workload_name)
    for step in range(max(outputs)):
        running = [len(p) + step for p, o in zip(prompts, outputs) if o > step]
        if len(running) <= num_running:
            return running
    return []


def run_batch_sweep(args: argparse.Namespace) -> None:
    """Decode steps of P1's batch sizes (graph buckets 16-256, ragged contexts from ``protocol_contexts``),
    P2's 1,024 and P5's long contexts, bf16 and fp8 caches: the launch each decode graph bakes in
    (max_model_len 4096), then the K split and a few tile/warp/stage shapes around it. Which shapes
    read thin and mid-size steps fastest (P1's steps of 64 or fewer sequences ran at about half
    their KV-read floor: docs/perf.md 29-30)."""
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    # bf16: the 4-warp launch before entry 30, DECODE_WARPS' 2, and around it (1 warp, a deeper
    # pipeline, 128-key tiles; sm_90 compile of the 64-key tile: 120 registers on 4 warps, 234 on 2,
    # and 1 warp spills 240 B); fp8: FP8_CACHE_DECODE_* (32 keys, 1 warp, 6 stages since docs/perf.md 33), the
    # 64-key, 2-warp, 5-stage launch before it, and the bf16 one.
    shapes = {None: ((64, 4, 3), (64, 2, 3), (32, 2, 6), (64, 1, 3), (64, 2, 4), (128, 2, 3)),
              torch.float8_e4m3fn: ((64, 2, 5), (64, 4, 3), (32, 1, 6))}
    steps = [(str(bucket), bucket, protocol_contexts("nano", bucket)) for bucket in (16, 32, 48, 64, 96, 128, 192, 256)]
    steps.append(("1024", 1024, [640] * 1024))  # P2's step (512-token prompts, 256 outputs) halfway through
    steps.append(("p5-256", 256, protocol_contexts("prefill", 256)))  # P5's decodes over 1-3k-token prompts
    for cache_dtype, tiles in shapes.items():
        for label, bucket, seq_lens in steps:
            batch = decode_batch(args, seq_lens, cache_dtype)
            row = run_case(args, seq_lens, f"batch-sweep-{label}-graph", None, cache_dtype, bucket, 4096, batch=batch)
            print(json.dumps({**row, "bucket": bucket}), flush=True)
            for tile_n, num_warps, num_stages in tiles:
                for splits in (1, 2, 4, 8):
                    cfg = AttentionLaunchConfig(block_q=1, tile_n=tile_n, num_splits=splits, num_warps=num_warps, num_stages=num_stages)
                    try:
                        row = run_case(args, seq_lens, f"batch-sweep-{label}", cfg, cache_dtype, batch=batch)
                        print(json.dumps({**row, "bucket": bucket}), flush=True)
                    except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
                        print(json.dumps({"bench": "decode_attention", "case": f"batch-sweep-{label}", "config": cfg.__dict__,
                                          "error": repr(exc)[:300]}), flush=True)
            del batch
            torch.cuda.empty_cache()


def run_qkv_prologue_case(args: argparse.Namespace, tokens: int, label: str) -> dict[str, Any]:
    """The fused qkv prologue vs the unfused sequence (q_norm, k_norm, v copy, rotary, store_kv)."""
    from tokenmill.kernels.reference import qkv_prologue_ref
    from support.kernel_cases import make_qkv_prologue_case
    from tokenmill.kernels.triton.kv_store import store_kv
    from tokenmill.kernels.triton.qkv_prologue import qkv_prologue
    from tokenmill.kernels.triton.rmsnorm import rms_norm
    from tokenmill.kernels.triton.rotary import rotary_embedding_

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    case = make_qkv_prologue_case(
        tokens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, block_size=args.block_size, dtype=dtype,
        qk_norm=True, max_position=40960, device="cuda", seed=0,
    )
    case.kv_cache.nan_to_num_(0.0)  # the timing loop rewrites the same slots; no poison needed here
    q_w, k_w = case.q_norm_weight, case.k_norm_weight
    assert q_w is not None and k_w is not None
    qkv, cache = case.qkv, case.kv_cache
    out = torch.empty((tokens, heads, dim), dtype=dtype, device="cuda")

    def fused() -> None:
        qkv_prologue(*case.args(cache), out=out)

    def unfused() -> None:  # what LlamaAttention ran per layer before the fused kernel (CUDA path)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = rms_norm(q.view(tokens, heads, dim), q_w, case.eps)
        k = rms_norm(k.view(tokens, kv_heads, dim), k_w, case.eps)
        rotary_embedding_(case.positions, q, k, case.cos_sin_cache)
        store_kv(k, v.contiguous().view(tokens, kv_heads, dim), cache, case.slot_mapping)

    fused()
    expected_cache = cache.clone()
    expected = qkv_prologue_ref(*case.args(expected_cache))
    err = (out.float() - expected.float()).abs().max().item()
    if not err < 0.1:
        raise SystemExit(f"{label}: fused qkv prologue wrong (max abs err {err})")
    fused_median, fused_min = _time_graph(fused)
    unfused_median, unfused_min = _time_graph(unfused)
    elem = qkv.element_size()
    total = tokens * ((heads + 2 * kv_heads) * dim * elem * 2 + 16)  # read qkv, write q/k/v, slot + position
    return {
        **_provenance("qkv_prologue", label),
        "tokens": tokens,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "block_size": args.block_size,
        "dtype": args.dtype,
        "qk_norm": True,
        "bytes": total,
        "us_median": round(fused_median, 2),
        "us_min": round(fused_min, 2),
        "unfused_us_median": round(unfused_median, 2),
        "unfused_us_min": round(unfused_min, 2),
        "speedup": round(unfused_median / fused_median, 2),
        "gbps": round(total / (fused_median * 1e-6) / 1e9, 1),
        "max_abs_err": err,
    }


def p5_step(rng: random.Random, *, tokens: int = 16384, decodes: int = 0) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of a P5-like step under a 16,384-token budget: ``decodes`` running
    sequences first (one token at a context of U[1000, 3000]), then the rest of a prompt that the
    previous step cut, then fresh prompts of U[1000, 3000] tokens until the budget, the last one cut."""
    query_lens = [1] * decodes
    seq_lens = [rng.randint(1000, 3000) for _ in range(decodes)]
    left = tokens - decodes
    done = rng.randint(100, 2000)  # the continued prompt's tokens computed last step
    rest = min(left, rng.randint(done + 1, 3000) - done)
    query_lens.append(rest)
    seq_lens.append(done + rest)
    left -= rest
    while left > 0:
        n = min(left, rng.randint(1000, 3000))
        query_lens.append(n)
        seq_lens.append(n)
        left -= n
    return query_lens, seq_lens


def prefill_flops(query_lens: list[int], seq_lens: list[int], heads: int, head_dim: int) -> float:
    """Causal attention FLOPs (QK^T and PV) of the rows with more than one query token."""
    keys = sum(n * (s - n) + n * (n + 1) // 2 for n, s in zip(query_lens, seq_lens) if n > 1)
    return 4.0 * head_dim * heads * keys


def run_step_case(
    args: argparse.Namespace, query_lens: list[int], seq_lens: list[int], label: str, *, num_decode_seqs: int,
    config: Any | None = None, two_streams: bool = False,
) -> dict[str, Any]:
    """A prefill or mixed step through ``paged_attention`` (its launch shapes chosen as the backend
    would, unless ``config`` forces the prefill launch's). ``num_decode_seqs`` 0 runs the step in
    one launch, as before decodes were split off. ``two_streams`` runs the decode launch on a side
    stream beside the prefill launch (an experiment: does the GPU overlap the memory-bound decode
    rows with the compute-bound prefill tiles when both are in flight?)."""
    from tokenmill.kernels.triton import paged_attention as pa

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, block_size=args.block_size,
        dtype=dtype, device="cuda", seed=0, cache_dtype=args.cache_dtype,
    )
    scale = dim**-0.5
    max_q, max_s = max(query_lens), max(seq_lens)
    decode_config, chosen = pa.choose_configs(
        num_tokens=len(batch.q), num_seqs=len(seq_lens), num_decode_seqs=num_decode_seqs, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, max_query_len=max_q, max_seq_len=max_s, device=batch.q.device,
        cache_dtype=batch.kv_cache.dtype,
    )
    config = config or chosen
    out = torch.full_like(batch.q, float("nan"))
    common = dict(
        k_cache=batch.kv_cache[0], v_cache=batch.kv_cache[1], out=out, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_tables=batch.block_tables, scale=scale, max_seq_len=max_s,
        compile_only=False,
    )
    side = torch.cuda.Stream()

    def call() -> None:
        if not two_streams:
            pa.paged_attention(
                batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
                max_query_len=max_q, max_seq_len=max_s, num_decode_seqs=num_decode_seqs, out=out, config=config,
                decode_config=decode_config,
            )
            return
        d = num_decode_seqs
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            pa._launch(batch.q, decode_config, num_launch_seqs=d, first_seq=0, num_launch_tokens=d, **common)
        pa._launch(batch.q, config, num_launch_seqs=len(seq_lens), first_seq=d, num_launch_tokens=len(batch.q) - d, **common)
        main.wait_stream(side)

    call()
    torch.cuda.synchronize()
    expected = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    rel = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    if not (rel < 2e-2) or torch.isnan(out).any():
        raise SystemExit(f"{label}: wrong result (rel err {rel}) with {config} / {decode_config}")
    del expected
    us_median, us_min = _time_graph(call, calls_per_graph=5, replays=20)
    flops = prefill_flops(query_lens, seq_lens, heads, dim)
    decode_ctx = [s for n, s in zip(query_lens, seq_lens) if n == 1]
    decode_bytes = sum(decode_ctx) * kv_heads * dim * 2 * batch.kv_cache.element_size()
    fields = ("block_q", "tile_n", "num_splits", "num_warps", "num_stages")
    return {
        **_provenance("step_attention", label),
        "tokens": len(batch.q),
        "prefill_seqs": sum(1 for n in query_lens if n > 1),
        "prefill_tokens": sum(n for n in query_lens if n > 1),
        "decode_rows": len(decode_ctx),
        "decode_ctx_mean": round(sum(decode_ctx) / len(decode_ctx), 1) if decode_ctx else 0,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "num_decode_seqs": num_decode_seqs,
        "cache_dtype": str(batch.kv_cache.dtype).removeprefix("torch."),
        "two_streams": two_streams,
        "config": {k: getattr(config, k) for k in fields},
        "decode_config": {k: getattr(decode_config, k) for k in fields} if decode_config else None,
        "prefill_gflop": round(flops / 1e9, 1),
        "decode_kv_bytes": decode_bytes,
        "us_median": round(us_median, 2),
        "us_min": round(us_min, 2),
        # All the step's time charged to the prefill rows' FLOPs: the prefill kernel's rate on a pure
        # prefill step, a lower bound of it on a mixed one.
        "prefill_tflops": round(flops / (us_median * 1e-6) / 1e12, 1),
        "rel_err": rel,
    }


def run_p5_cases(args: argparse.Namespace, sweep: bool) -> None:
    """P5's prefill-phase steps (Qwen3-0.6B heads): a pure prefill step, and a mixed step with 256
    decodes in front, in one launch (before), split (now) and split on two streams; the 256
    decodes alone as a pure decode step, to see what the split leaves on top of the two parts.
    ``sweep``: prefill tile shapes on the pure prefill step."""
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    prefill_q, prefill_s = p5_step(random.Random(5))
    print(json.dumps(run_step_case(args, prefill_q, prefill_s, "p5-prefill", num_decode_seqs=0)), flush=True)
    mixed_q, mixed_s = p5_step(random.Random(6), decodes=256)
    print(json.dumps(run_step_case(args, mixed_q, mixed_s, "p5-mixed-one-launch", num_decode_seqs=0)), flush=True)
    print(json.dumps(run_step_case(args, mixed_q, mixed_s, "p5-mixed-split", num_decode_seqs=256)), flush=True)
    print(json.dumps(run_step_case(args, mixed_q, mixed_s, "p5-mixed-split-two-streams", num_decode_seqs=256, two_streams=True)), flush=True)
    print(json.dumps(run_case(args, mixed_s[:256], "p5-mixed-decodes-alone", None, cache_dtype=args.cache_dtype)), flush=True)
    if sweep:
        # What ptxas gives each for sm_90 (head_dim 128, group 2; regs/thread, KB shared -> CTAs an SM):
        # 64/64/8 178-192 regs, 96 KB -> 1; 64/128/8/2 244, 160 KB -> 1; 64/32/8 128, 64 KB -> 2;
        # 32/64/4 187-200, 80 KB -> 2; 32/32/4 138, 48 KB -> 3; 16/64/4 mma.sync, not wgmma. 3 stages
        # and 4 compile to the same PTX here (the indirect K/V loads are double-buffered either way).
        for block_q, tile_n, num_warps, num_stages in (
            (64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (32, 64, 4, 2), (32, 64, 4, 3),
            (32, 32, 4, 3), (16, 64, 4, 3),
        ):
            cfg = AttentionLaunchConfig(block_q=block_q, tile_n=tile_n, num_splits=1, num_warps=num_warps, num_stages=num_stages)
            try:
                row = run_step_case(args, prefill_q, prefill_s, "p5-prefill-sweep", num_decode_seqs=0, config=cfg)
            except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
                row = {"bench": "step_attention", "case": "p5-prefill-sweep", "config": cfg.__dict__, "error": repr(exc)[:300]}
            print(json.dumps(row), flush=True)


# P6's two shapes as one pooling step: (heads, kv heads, head_dim, causal, lengths U[lo, hi], step tokens).
VARLEN_CASES = {
    "p6-qwen3-embed-step64k": (16, 8, 128, True, (8, 384), 65536),
    "p6-minilm-step64k": (12, 12, 32, False, (8, 128), 65536),
}


def run_varlen_case(label: str, config: Any | None = None, compare_sdpa: bool = True) -> dict[str, Any]:
    """The varlen kernel on one pooling step of packed prompts (q, k, v strided views of the qkv
    output, as the models pass them), checked against the twin, timed in a CUDA graph; beside it the
    padded-group torch SDPA path it replaces (``attention/prefill.py``). FLOPs count the two
    matmuls over the visible (query, key) pairs only: L^2 per sequence, or L(L+1)/2 causal."""
    from tokenmill.attention.prefill import prefill_attention, whole_prompt_metadata
    from tokenmill.kernels.reference import varlen_attention_ref
    from support.kernel_cases import make_varlen_batch
    from tokenmill.kernels.triton.varlen_attention import choose_config, varlen_attention

    heads, kv_heads, dim, causal, (lo, hi), step_tokens = VARLEN_CASES[label]
    rng = random.Random(0)
    lens: list[int] = []
    while sum(lens) + hi <= step_tokens:
        lens.append(rng.randint(lo, hi))
    dtype = torch.bfloat16
    batch = make_varlen_batch(lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, device="cuda")
    scale = dim**-0.5
    config = config or choose_config(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
    out = torch.empty_like(batch.q)

    def call() -> None:
        varlen_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal=causal, max_seqlen=hi, out=out, config=config)

    call()
    check = slice(0, int(batch.cu_seqlens[min(len(lens), 64)]))  # the twin loops in Python: check the first 64 sequences
    expected = varlen_attention_ref(batch.q[check], batch.k[check], batch.v[check], batch.cu_seqlens[: min(len(lens), 64) + 1], scale, causal)
    err = (out[check].float() - expected.float()).abs().max().item()
    if not err < 5e-2:
        raise SystemExit(f"{label}: wrong result (max abs err {err}) with {config}")
    us_median, us_min = _time_graph(call)
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in lens)
    flops = 4 * pairs * heads * dim
    row = {
        **_provenance("varlen_attention", label),
        "tokens": sum(lens),
        "seqs": len(lens),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "causal": causal,
        "dtype": "bfloat16",
        "config": {k: getattr(config, k) for k in ("block_q", "tile_n", "num_warps", "num_stages")},
        "us_median": round(us_median, 2),
        "us_min": round(us_min, 2),
        "tflops": round(flops / (us_median * 1e-6) / 1e12, 1),
        "max_abs_err": err,
    }
    if compare_sdpa:
        meta = whole_prompt_metadata(lens, torch.device("cuda"))
        sdpa_us, _ = _time_events(lambda: prefill_attention(batch.q, batch.k, batch.v, meta, scale, causal))
        row.update(sdpa_groups_us_median=round(sdpa_us, 1), speedup_vs_sdpa_groups=round(sdpa_us / us_median, 2))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=1000, help="mean context length")
    parser.add_argument("--jitter", type=float, default=0.1, help="contexts uniform in ctx*(1 +- jitter)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--sweep", action="store_true", help="also time tile/warp/stage/split variants")
    parser.add_argument("--long", action="store_true", help="also time 8 seqs x 32K context, split-KV on and off")
    parser.add_argument("--varlen-sweep", action="store_true", help="also time varlen attention tile/warp/stage variants")
    parser.add_argument("--p5", action="store_true", help="only P5's prefill and mixed steps (with --sweep: prefill tiles)")
    parser.add_argument("--fp8-cache", action="store_true", help="with --p5: the steps over a float8 e4m3 cache")
    parser.add_argument("--batch-sweep", action="store_true", help="only decode steps of P1's batch sizes (and P2's, P5's), K splits and tiles")
    args = parser.parse_args()
    args.cache_dtype = torch.float8_e4m3fn if args.fp8_cache else None
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench.py needs a CUDA GPU")

    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    if args.p5:
        run_p5_cases(args, args.sweep)
        return
    if args.batch_sweep:
        run_batch_sweep(args)
        return
    rng = random.Random(0)
    lo, hi = int(args.ctx * (1 - args.jitter)), int(args.ctx * (1 + args.jitter))
    seq_lens = [rng.randint(max(1, lo), max(1, hi)) for _ in range(args.seqs)]
    print(json.dumps(run_case(args, seq_lens, "p1-decode-default", None)), flush=True)
    print(json.dumps(run_qkv_prologue_case(args, args.seqs, "p1-decode-qkv-prologue")), flush=True)
    # kv_cache_dtype="fp8": the same step reading half the bytes; then both on Llama-3-8B's heads
    # (group 4: P3). Tile, warp, stage and split variants of decode: --batch-sweep (every graph
    # bucket of P1, both head layouts, both caches).
    print(json.dumps(run_case(args, seq_lens, "p1-decode-fp8cache", None, cache_dtype=torch.float8_e4m3fn)), flush=True)
    llama = argparse.Namespace(**{**vars(args), "heads": 32})
    print(json.dumps(run_case(llama, seq_lens, "p3-decode-default", None)), flush=True)
    print(json.dumps(run_case(llama, seq_lens, "p3-decode-fp8cache", None, cache_dtype=torch.float8_e4m3fn)), flush=True)
    # P1's thin tail: ~40 sequences of ~1,800 tokens, launched as the 48-row graph with
    # max_model_len 4096 would.
    tail_lens = [rng.randint(1400, 2200) for _ in range(40)]
    print(json.dumps(run_case(args, tail_lens, "p1-tail-decode-graph", None, graph_batch=48, graph_max_seq=4096)), flush=True)
    for label in VARLEN_CASES:  # P6: one pooling step of packed whole prompts
        print(json.dumps(run_varlen_case(label)), flush=True)
    if args.varlen_sweep:
        from tokenmill.kernels.triton.varlen_attention import VarlenAttentionConfig

        for label in VARLEN_CASES:
            for block_q, tile_n, num_warps, num_stages in ((32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                                                           (128, 64, 8, 3), (128, 32, 4, 3), (32, 32, 4, 2), (64, 32, 4, 4)):
                cfg = VarlenAttentionConfig(block_q, tile_n, num_warps, num_stages)
                try:
                    print(json.dumps(run_varlen_case(label, cfg, compare_sdpa=False)), flush=True)
                except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
                    print(json.dumps({"bench": "varlen_attention", "case": label, "config": cfg.__dict__, "error": repr(exc)[:300]}), flush=True)
    if args.sweep:
        for tile_n in (32, 64, 128):
            for num_warps in (2, 4, 8):
                for num_stages in (2, 3, 4):
                    cfg = AttentionLaunchConfig(block_q=1, tile_n=tile_n, num_splits=1, num_warps=num_warps, num_stages=num_stages)
                    try:
                        print(json.dumps(run_case(args, seq_lens, "p1-decode-sweep", cfg)), flush=True)
                    except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
                        print(json.dumps({"bench": "decode_attention", "case": "p1-decode-sweep", "config": cfg.__dict__, "error": repr(exc)[:300]}), flush=True)
        for splits in (2, 4):
            cfg = AttentionLaunchConfig(block_q=1, tile_n=64, num_splits=splits, num_warps=4, num_stages=3)
            print(json.dumps(run_case(args, seq_lens, "p1-decode-sweep", cfg)), flush=True)
    if args.long:
        long_lens = [rng.randint(30000, 32768) for _ in range(8)]
        print(json.dumps(run_case(args, long_lens, "long-decode-default", None)), flush=True)
        for splits in (1, 4, 16):
            cfg = AttentionLaunchConfig(block_q=1, tile_n=64, num_splits=splits, num_warps=4, num_stages=3)
            print(json.dumps(run_case(args, long_lens, f"long-decode-splits{splits}", cfg)), flush=True)


if __name__ == "__main__":
    main()
