"""Decode attention micro-benchmark: achieved bandwidth of the Triton paged attention kernel.

Default: a P1-like decode step (256 sequences, contexts ~1000, Qwen3-0.6B heads: 16 q / 8 kv,
head_dim 128, block 16, bf16), timed through CUDA-graph replays (no launch gaps), correctness
checked against the plain-torch twin first. Decode attention is memory-bound: the figure of merit
is bytes that must move (each context token's K and V once, q once, out once, block tables)
over time, against the H200's measured 4.3 TB/s copy bandwidth.

Prints one JSON line per measured configuration to stdout: the default launch shape; bench
"qkv_prologue", the fused norm + rope + KV-store kernel against the five launches it replaces on
the same decode shape (Qwen3's qk-norm on); the step over an fp8 cache, on Llama-3-8B's heads, and
P1's thin tail. --sweep adds tile/warp/stage variants, --long few-sequence 32K-context decode with
and without split-KV. --batch-sweep runs only decode steps at P1's graph buckets (and P2's and
P5's steps) over K splits and tiles, bf16 and fp8; --order-sweep the same steps with their rows in
four orders (request, longest first, shortest first, one uniform length); --queue-sweep the item-queue
kernel (``paged_attention_queue.py``) against the default launch on those steps. The other attention
benches: P5's prefill and mixed steps (``prefill_step_bench.py``), the pooling models' varlen
attention (``varlen_bench.py``).
Usage:
    python bench/kernels_bench.py [--sweep] [--long] [--seqs 256 --ctx 1000 ...]
    python bench/kernels_bench.py --batch-sweep [--heads 32]
    python bench/kernels_bench.py --order-sweep
    python bench/kernels_bench.py --queue-sweep
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
from gpu_timing import _provenance, _time_graph  # noqa: E402
from support.kernel_cases import make_paged_batch  # noqa: E402
from tokenmill.kernels.reference import paged_attention_ref  # noqa: E402

HBM_GBPS = 4300.0  # measured device-to-device copy on this workplace's H200s (KINDS.md)


def attention_arguments(description: str | None) -> argparse.ArgumentParser:
    """The attention shape every attention bench takes (Qwen3-0.6B's heads by default)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    return parser


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


def run_order_sweep(args: argparse.Namespace) -> None:
    """The same decode step with its rows in four orders: the protocol's (request order, as the
    engine's rows arrive), longest context first, shortest first, and every row at the mean
    length (the same bytes, no ragged tail). Programs are dispatched in grid order (token
    fastest), so the order decides which programs finish last; the launch is the graph's own
    (``choose_config`` at the bucket). Both caches, both head layouts (--heads 16 and 32)."""
    steps = [(str(b), b, protocol_contexts("nano", b)) for b in (16, 32, 64, 128, 192, 256)]
    steps.append(("p5-256", 256, protocol_contexts("prefill", 256)))
    for heads in (16, 32):
        layout = argparse.Namespace(**{**vars(args), "heads": heads})
        for cache_dtype in (None, torch.float8_e4m3fn):
            for label, bucket, ctx in steps:
                mean = round(sum(ctx) / len(ctx))
                orders = {"request": ctx, "longest-first": sorted(ctx, reverse=True),
                          "shortest-first": sorted(ctx), "uniform": [mean] * len(ctx)}
                for order, seq_lens in orders.items():
                    row = run_case(layout, seq_lens, f"order-{label}-{order}", None, cache_dtype, bucket, 4096)
                    print(json.dumps({**row, "bucket": bucket, "order": order}), flush=True)
                    torch.cuda.empty_cache()


def run_queue_sweep(args: argparse.Namespace) -> None:
    """The item-queue decode kernel (``paged_attention_queue.py``; docs/perf.md 44) against the
    default launch a graph of the same bucket takes, on the same steps (rows in request order), on
    both head layouts, over a bf16 and an fp8 cache (the engine's launch shape first, then others
    the registers allow; docs/perf.md 46), at the buckets around ``queue_pays``' thresholds and
    above; the ranking launch (once a step for every layer) timed on its own. Rows carry whether
    the engine's rule picks the queue for that step."""
    from tokenmill.kernels.triton.paged_attention_queue import (
        decode_order,
        launch_shape,
        new_queue,
        queue_pays,
        queued_decode_attention,
    )

    steps = [(str(b), b, protocol_contexts("nano", b)) for b in (48, 64, 96, 128, 192, 256)]
    steps += [("1024", 1024, [640] * 1024), ("p5-256", 256, protocol_contexts("prefill", 256))]
    # (tile_n, num_warps, num_stages, programs an SM); sm_90 registers: bf16 (64, 2, 3) 230, (32, 2, 6)
    # 239, (64, 4, 3) 168; fp8 (32, 1, 6) 246, (32, 2, 6) 194, (64, 2, 3) 193.
    dtype = getattr(torch, args.dtype)
    shapes = {  # the engine's shape first
        None: [launch_shape(dtype, torch.bfloat16, args.head_dim), (64, 2, 4, 4), (32, 2, 6, 4), (64, 4, 3, 3)],
        torch.float8_e4m3fn: [launch_shape(dtype, torch.float8_e4m3fn, args.head_dim), (32, 1, 6, 6), (32, 2, 6, 4),
                              (64, 2, 3, 5)],
    }
    for heads in (16, 32):
        layout = argparse.Namespace(**{**vars(args), "heads": heads})
        for cache_dtype, configs in shapes.items():
            for label, bucket, seq_lens in steps:
                batch = decode_batch(layout, seq_lens, cache_dtype)
                base = run_case(layout, seq_lens, f"queue-{label}-graph", None, cache_dtype, bucket, 4096, batch=batch)
                print(json.dumps({**base, "bucket": bucket}), flush=True)
                q, cache, lens, tables = batch.q[: len(seq_lens)], batch.kv_cache, batch.seq_lens, batch.block_tables
                expected = paged_attention_ref(q, cache, batch.query_start_loc, lens, tables, args.head_dim**-0.5)
                order = decode_order(lens)
                order_us = _time_graph(lambda lens=lens: decode_order(lens))[0]
                for tile_n, warps, stages, per_sm in configs:
                    counters, out = new_queue(q.device), torch.full_like(q, float("nan"))

                    def call(counters: torch.Tensor = counters, out: torch.Tensor = out, tile_n: int = tile_n,
                             warps: int = warps, stages: int = stages, per_sm: int = per_sm) -> None:
                        queued_decode_attention(q, cache, lens, tables, args.head_dim**-0.5, order, counters, out=out,
                                                tile_n=tile_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)

                    call()
                    rel = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                    if not rel < 2e-2:
                        raise SystemExit(f"queue {label} {tile_n, warps, stages, per_sm}: wrong result (rel {rel})")
                    us_median, us_min = _time_graph(call)
                    print(json.dumps({**base, "case": f"queue-{label}", "bucket": bucket,
                                      "config": {"tile_n": tile_n, "num_warps": warps, "num_stages": stages,
                                                 "programs_per_sm": per_sm},
                                      "us_median": round(us_median, 2), "us_min": round(us_min, 2),
                                      "order_us": round(order_us, 2),
                                      "gbps": round(base["bytes"] / (us_median * 1e-6) / 1e9, 1),
                                      "frac_of_4300": round(base["bytes"] / (us_median * 1e-6) / 1e9 / HBM_GBPS, 3),
                                      "vs_graph": round(us_median / base["us_median"], 3), "rel_err": rel,
                                      "engine_picks_queue": queue_pays(bucket, args.kv_heads, cache.dtype, q.device)}),
                          flush=True)
                del batch  # (the closures keep the last step's tensors until the next one rebinds them)
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


def main() -> None:
    parser = attention_arguments(__doc__)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--ctx", type=int, default=1000, help="mean context length")
    parser.add_argument("--jitter", type=float, default=0.1, help="contexts uniform in ctx*(1 +- jitter)")
    parser.add_argument("--sweep", action="store_true", help="also time tile/warp/stage/split variants")
    parser.add_argument("--long", action="store_true", help="also time 8 seqs x 32K context, split-KV on and off")
    parser.add_argument("--batch-sweep", action="store_true", help="only decode steps of P1's batch sizes (and P2's, P5's), K splits and tiles")
    parser.add_argument("--queue-sweep", action="store_true", help="only decode steps on the item-queue kernel against the default launch")
    parser.add_argument("--order-sweep", action="store_true", help="only decode steps with their rows in four orders (ragged tails)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench.py needs a CUDA GPU")

    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    if args.batch_sweep:
        run_batch_sweep(args)
        return
    if args.order_sweep:
        run_order_sweep(args)
        return
    if args.queue_sweep:
        run_queue_sweep(args)
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
