"""What deterministic mode's kernels cost against the default ones, kernel by kernel, on the H200.

- GEMMs: the batch-invariant Triton matmul (kernels/triton/matmul.py, one tile per weight shape)
  against cuBLAS (F.linear) on the four projections and the lm_head of Qwen3-0.6B and Llama-3-8B, at
  M = 1 ... 16384 (decode batches to prefill steps). Each row also times other wgmma tiles and says
  whether each gives the bits of the tile the engine picks at that M (``matmul_config``): the tile
  follows M because they all do.
- Attention: the fixed-split variant against the default launch on P1's decode shape (256 x ~1000),
  P1's thin tail (40 x ~1800), 8 x 32K contexts, and a prefill of 16 x 1000-token prompts (where
  deterministic mode gives up the wide 128-row tile).
Timing: CUDA-graph replays (bench/gpu_timing.py's timer). One JSON row per case on stdout.
    python bench/deterministic_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timing import _provenance, _time_graph  # noqa: E402
from kernels_bench import run_case  # noqa: E402

SHAPES = {  # name: (N, K) of the weight
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096)},
}


# Other wgmma tiles, each checked for the engine's tile's bits at every M (each output element is
# still one chain of k16 MMAs in k order): the engine's tile follows M on the strength of this check.
ALTERNATIVE_TILES = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3)]


def gemm_rows(rows: list[int]) -> None:
    from tokenmill.kernels.triton.matmul import MatmulConfig, matmul, matmul_config

    torch.manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
            for m in rows:
                base = matmul_config(m, n, k, torch.bfloat16)
                if name == "lm_head" and m > 1024:
                    continue  # the lm_head sees sampled rows only
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                got = matmul(x, w, out=out).clone()
                want = F.linear(x.float(), w.float())
                err = ((got.float() - want).norm() / want.norm()).item()
                if not err < 1e-2:
                    raise SystemExit(f"{model} {name} M={m}: wrong result (rel err {err})")
                cublas_us, _ = _time_graph(lambda: F.linear(x, w))
                ours_us, _ = _time_graph(lambda: matmul(x, w, out=out))
                others = {}
                for tile in ALTERNATIVE_TILES:
                    config = MatmulConfig(*tile)
                    if config == base:
                        continue
                    same = torch.equal(matmul(x, w, config=config), got)
                    us, _ = _time_graph(lambda: matmul(x, w, out=out, config=config))
                    others["x".join(map(str, tile))] = {"us": round(us, 2), "same_bits": same}
                flops = 2 * m * n * k
                print(json.dumps({
                    **_provenance("det_gemm", f"{model}-{name}-m{m}"), "n": n, "k": k, "m": m,
                    "cublas_us": round(cublas_us, 2), "triton_us": round(ours_us, 2), "slowdown": round(ours_us / cublas_us, 3),
                    "triton_tflops": round(flops / ours_us / 1e6, 1), "cublas_tflops": round(flops / cublas_us / 1e6, 1),
                    "config": [base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages], "other_tiles": others,
                }), flush=True)


def attention_rows() -> None:
    import random

    from tokenmill.kernels.triton.paged_attention import choose_config

    cases = [  # label, seq_lens, (heads, kv_heads), graph bucket and max_model_len as the decode graphs use them
        ("p1-decode-256x1000", [random.Random(0).randint(900, 1100) for _ in range(256)], (16, 8), 256, 4096),
        ("p1-tail-40x1800", [random.Random(1).randint(1700, 1900) for _ in range(40)], (16, 8), 48, 4096),
        ("p3-decode-256x1000", [random.Random(2).randint(900, 1100) for _ in range(256)], (32, 8), 256, 4096),
        ("long-8x32k", [32768] * 8, (32, 8), 8, 40960),
    ]
    for label, lens, (heads, kv_heads), bucket, max_len in cases:
        args = argparse.Namespace(heads=heads, kv_heads=kv_heads, head_dim=128, block_size=16, dtype="bfloat16")
        for deterministic in (False, True):
            config = choose_config(num_tokens=bucket, num_seqs=bucket, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                                   dtype=torch.bfloat16, max_query_len=1, max_seq_len=max_len, device=torch.device("cuda"),
                                   deterministic=deterministic)
            variants = [config]
            if deterministic and label.endswith("x1000"):  # fewer registers a thread (110, not 156): 2 blocks of 8 warps an SM
                variants.append(dataclasses.replace(config, num_warps=8))
            for variant in variants:
                name = f"{label}-{'deterministic' if deterministic else 'default'}" + ("-8warps" if variant.num_warps == 8 else "")
                row = run_case(args, lens, name, variant, graph_max_seq=max_len)
                row["bench"] = "det_attention"
                row["config"]["part_keys"] = variant.part_keys
                print(json.dumps(row), flush=True)
    prefill_rows()


def prefill_rows() -> None:
    """16 prompts of 1000 tokens prefilled in one step (P3's heads): attention time, default and deterministic."""
    from support.kernel_cases import make_paged_batch  # tests/ is on sys.path through kernels_bench
    from tokenmill.kernels.triton.paged_attention import choose_config, paged_attention

    for heads, kv_heads, model in ((16, 8, "qwen3-0.6b"), (32, 8, "llama3-8b")):
        lens = [1000] * 16
        batch = make_paged_batch(lens, lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=128, block_size=16,
                                 dtype=torch.bfloat16, device="cuda", seed=0)
        out = torch.empty_like(batch.q)
        for deterministic in (False, True):
            config = choose_config(num_tokens=sum(lens), num_seqs=16, num_heads=heads, num_kv_heads=kv_heads, head_dim=128,
                                   dtype=torch.bfloat16, max_query_len=1000, max_seq_len=1000, device=torch.device("cuda"),
                                   deterministic=deterministic)

            def call() -> None:
                paged_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 128**-0.5,
                                max_query_len=1000, max_seq_len=1000, out=out, config=config)

            us, _ = _time_graph(call, calls_per_graph=3, replays=10)
            flops = 4 * heads * 128 * sum(n * (n + 1) // 2 for n in lens)
            print(json.dumps({
                **_provenance("det_prefill_attention", f"{model}-16x1000-{'deterministic' if deterministic else 'default'}"),
                "us_median": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                "config": {"block_q": config.block_q, "num_warps": config.num_warps, "num_splits": config.num_splits,
                           "part_keys": config.part_keys},
            }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="GEMMs at M = 256, 1024 and 4096 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("deterministic_bench.py needs a CUDA GPU")
    gemm_rows([256, 1024, 4096] if args.quick else [1, 32, 128, 256, 1024, 4096, 16384])
    attention_rows()


if __name__ == "__main__":
    main()
