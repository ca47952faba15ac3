"""Varlen attention of the pooling models (issue 15 part 4): one P6-sized step of packed whole
prompts per shape (Qwen3-embedding's causal heads, MiniLM's bidirectional ones), checked against
the twin, timed in a CUDA graph, in TFLOP/s, beside the padded-group torch SDPA path it replaced
(bench "varlen_attention"); --sweep adds tile/warp/stage variants. Usage:
    python bench/varlen_bench.py [--sweep]
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
sys.path[:0] = [str(ROOT / "bench"), str(ROOT), str(ROOT / "tests")]  # the timers, tokenmill, tests/support
from gpu_timing import _provenance, _time_events, _time_graph  # noqa: E402


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
    parser.add_argument("--sweep", action="store_true", help="also time tile/warp/stage variants")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("varlen_bench.py needs a CUDA GPU")
    for label in VARLEN_CASES:
        print(json.dumps(run_varlen_case(label)), flush=True)
    if args.sweep:
        from tokenmill.kernels.triton.varlen_attention import VarlenAttentionConfig

        for label in VARLEN_CASES:
            for block_q, tile_n, num_warps, num_stages in ((32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 8, 2),
                                                           (128, 64, 8, 3), (128, 32, 4, 3), (32, 32, 4, 2), (64, 32, 4, 4)):
                cfg = VarlenAttentionConfig(block_q, tile_n, num_warps, num_stages)
                try:
                    print(json.dumps(run_varlen_case(label, cfg, compare_sdpa=False)), flush=True)
                except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: report, go on)
                    print(json.dumps({"bench": "varlen_attention", "case": label, "config": cfg.__dict__, "error": repr(exc)[:300]}), flush=True)


if __name__ == "__main__":
    main()
