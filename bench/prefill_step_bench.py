"""P5's prefill-phase attention steps (Qwen3-0.6B heads by default): a 16,384-token prefill step
in TFLOP/s, a mixed step of 256 decodes + prefill chunks in one launch, split, and split on two
streams, and the decodes alone (bench "step_attention"); --sweep adds prefill tile shapes on the
pure prefill step, --fp8-cache runs the steps over a float8 e4m3 cache. Timed through CUDA-graph
replays, checked against the plain-torch twin first. --coresident times a mixed step's decodes on the
item queue beside its prefill launch on a second stream, with few queue programs an SM so that both
kernels' programs can share the SMs (bench "coresident_step"). Usage:
    python bench/prefill_step_bench.py [--sweep] [--fp8-cache] [--coresident]
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]  # the timers, tokenmill, tests/support
from gpu_timing import _provenance, _time_events, _time_graph  # noqa: E402
from kernels_bench import attention_arguments, run_case  # noqa: E402
from support.kernel_cases import make_paged_batch  # noqa: E402
from tokenmill.kernels.reference import paged_attention_ref  # noqa: E402


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


def step_batch(args: Any, query_lens: list[int], seq_lens: list[int], num_decode_seqs: int) -> tuple[Any, Any, Any]:
    """The step's paged batch on the GPU and the (decode, prefill) launch shapes the backend would
    choose for it with ``num_decode_seqs`` leading decodes."""
    from tokenmill.kernels.triton import paged_attention as pa

    dtype = getattr(torch, args.dtype)
    batch = make_paged_batch(
        query_lens, seq_lens, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        block_size=args.block_size, dtype=dtype, device="cuda", seed=0, cache_dtype=args.cache_dtype,
    )
    decode_config, config = pa.choose_configs(
        num_tokens=len(batch.q), num_seqs=len(seq_lens), num_decode_seqs=num_decode_seqs, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=dtype, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), device=batch.q.device, cache_dtype=batch.kv_cache.dtype,
    )
    return batch, decode_config, config


def checked_rel_err(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    """The result's relative error against the twin; a wrong result (or a row left unwritten) stops the bench."""
    got, want = got.float(), want.float()
    rel = ((got - want).norm() / want.norm()).item()
    if not (rel < 2e-2) or torch.isnan(got).any():
        raise SystemExit(f"{what}: wrong result (rel err {rel})")
    return rel


def run_step_case(
    args: Any, query_lens: list[int], seq_lens: list[int], label: str, *, num_decode_seqs: int,
    config: Any | None = None, two_streams: bool = False,
) -> dict[str, Any]:
    """A prefill or mixed step through ``paged_attention`` (its launch shapes chosen as the backend
    would, unless ``config`` forces the prefill launch's). ``num_decode_seqs`` 0 runs the step in
    one launch, as before decodes were split off. ``two_streams`` runs the decode launch on a side
    stream beside the prefill launch (an experiment: does the GPU overlap the memory-bound decode
    rows with the compute-bound prefill tiles when both are in flight?)."""
    from tokenmill.kernels.triton import paged_attention as pa

    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    batch, decode_config, chosen = step_batch(args, query_lens, seq_lens, num_decode_seqs)
    scale = dim**-0.5
    max_q, max_s = max(query_lens), max(seq_lens)
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
    rel = checked_rel_err(out, expected, f"{label} with {config} / {decode_config}")
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


def run_p5_cases(args: Any, sweep: bool) -> None:
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


def run_coresident_cases(args: Any) -> None:
    """A mixed step's memory-bound decodes beside its compute-bound prefill chunks, as they would run
    if the two launches shared the SMs. The engine runs them one after the other: the queue (4
    programs an SM of 2 warps) then the prefill launch (128 x 32 tiles of 8 warps, two an SM by their
    registers). A prefill program leaves room on its SM for one queue program but not for a second
    prefill program, so with one queue program an SM launched first, the prefill tiles run one an SM
    beside it. Timed eagerly (CUDA events over 20 steps): a graph does not keep the launch order of
    two branches. Rows: the decodes alone at 1, 2 and 4 programs an SM, the chunks alone, the two in
    sequence (the engine), and side by side with the queue launched first or second."""
    from tokenmill.kernels.triton import paged_attention as pa
    from tokenmill.kernels.triton import paged_attention_queue as queue

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    for decodes in (256, 128):
        query_lens, seq_lens = p5_step(random.Random(6), decodes=decodes)
        scale, d, max_s = dim**-0.5, query_lens.count(1), max(seq_lens)
        batch, _, config = step_batch(args, query_lens, seq_lens, d)
        tile_n, num_warps, num_stages, engine_per_sm = queue.launch_shape(dtype, batch.kv_cache.dtype, dim)
        out = torch.full_like(batch.q, float("nan"))
        order = queue.decode_order(batch.seq_lens[:d])
        counters = {k: queue.new_queue("cuda") for k in (1, 2, engine_per_sm)}
        # The side stream outranks the step's: when both launches wait on the same event (the step's
        # keys stored), the queue's programs are placed first. A same-priority stream for comparison.
        side_high, side_same = torch.cuda.Stream(priority=-1), torch.cuda.Stream()

        def decode_part(per_sm: int) -> None:
            queue.queued_decode_attention(
                batch.q[:d], batch.kv_cache, batch.seq_lens[:d], batch.block_tables[:d], scale, order, counters[per_sm],
                out=out[:d], tile_n=tile_n, num_warps=num_warps, num_stages=num_stages, programs_per_sm=per_sm,
            )

        def prefill_part() -> None:
            pa._launch(
                batch.q, config, k_cache=batch.kv_cache[0], v_cache=batch.kv_cache[1], out=out,
                query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_tables=batch.block_tables,
                scale=scale, max_seq_len=max_s, num_launch_seqs=len(seq_lens), first_seq=d,
                num_launch_tokens=len(batch.q) - d, compile_only=False,
            )

        def side_by_side(per_sm: int, queue_first: bool, side: torch.cuda.Stream = side_high) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            if not queue_first:
                prefill_part()
            with torch.cuda.stream(side):
                decode_part(per_sm)
            if queue_first:
                prefill_part()
            main.wait_stream(side)

        cases: list[tuple[str, Any, int | None]] = [
            *((f"decodes-alone-{k}-an-sm", functools.partial(decode_part, k), k) for k in (1, 2, engine_per_sm)),
            ("prefill-alone", prefill_part, None),
            ("in-sequence", lambda: (decode_part(engine_per_sm), prefill_part()), engine_per_sm),
            *((f"side-by-side-queue-first-{k}-an-sm", functools.partial(side_by_side, k, True), k) for k in (1, 2, engine_per_sm)),
            ("side-by-side-queue-first-1-an-sm-same-priority", functools.partial(side_by_side, 1, True, side_same), 1),
            *((f"side-by-side-prefill-first-{k}-an-sm", functools.partial(side_by_side, k, False), k)
              for k in (1, 2, engine_per_sm)),
        ]
        expected = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
        decode_ctx = seq_lens[:d]
        decode_bytes = sum(decode_ctx) * kv_heads * dim * 2 * batch.kv_cache.element_size()
        for label, call, per_sm in cases:
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            rows = slice(0, d) if label.startswith("decodes") else slice(d, None) if label == "prefill-alone" else slice(None)
            rel = checked_rel_err(out[rows], expected[rows], f"coresident {label}")
            us_median, us_min = _time_events(call, calls=20, repeats=10)
            print(json.dumps({
                **_provenance("coresident_step", label),
                "decode_rows": d, "decode_ctx_mean": round(sum(decode_ctx) / d, 1), "prefill_tokens": len(batch.q) - d,
                "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
                "cache_dtype": str(batch.kv_cache.dtype).removeprefix("torch."), "queue_programs_per_sm": per_sm,
                "prefill_config": {k: getattr(config, k) for k in ("block_q", "tile_n", "num_warps", "num_stages")},
                "us_median": round(us_median, 2), "us_min": round(us_min, 2),
                "decode_gb_s": round(decode_bytes / (us_median * 1e-6) / 1e9, 1) if label.startswith("decodes") else None,
                "rel_err": rel,
            }), flush=True)
        del expected


def main() -> None:
    parser = attention_arguments(__doc__)
    parser.add_argument("--sweep", action="store_true", help="also time prefill tile shapes")
    parser.add_argument("--coresident", action="store_true", help="only the decodes beside the prefill chunks")
    parser.add_argument("--fp8-cache", action="store_true", help="the steps over a float8 e4m3 cache")
    args = parser.parse_args()
    args.cache_dtype = torch.float8_e4m3fn if args.fp8_cache else None
    if not torch.cuda.is_available():
        raise SystemExit("prefill_step_bench.py needs a CUDA GPU")
    if args.coresident:
        run_coresident_cases(args)
    else:
        run_p5_cases(args, args.sweep)


if __name__ == "__main__":
    main()
