"""Tiles for the fused mixture-of-experts GEMMs (``kernels/triton/fused_moe.py``), swept on the GPU.

The engine's tile classes by the mean token-expert pairs an expert (``fused_moe.tile_classes``) were
read off this sweep's rows (docs/perf.md 88; before it, two classes reasoned, never timed). It times the whole
``fused_experts`` call (alignment, gate_up, SiLU-mul, down, the sum over K) under CUDA-graph
replays with every candidate tile at token counts from one decode token to a long prompt step, on
the expert shapes of the families the engine serves: Qwen3-30B-A3B (128 small experts, 8 a token),
Qwen1.5-MoE-A2.7B (Qwen2-MoE: 60 experts of 1,408, 4 a token) and Mixtral-8x7B (8 large experts, 2 a
token). Each call cycles through four routings so the weights come from HBM, not L2.

Then it scores a family of rules, "by the mean pairs an expert (T K / E), a bucket's tile", choosing
each bucket's tile by the summed time relative to the best tile of each (shape, T) in it, so no one
shape decides. The last row (``"bench": "moe_tile_rule"``) is that rule, the JSON
``bench/tokenmill_moe_tiles.py`` takes (``TOKENMILL_MOE_TILES``) for an end-to-end A/B, with the
rule's summed time against the engine's own over every row.

With vLLM importable (its bundle on PYTHONPATH) and ``--vllm``, each (shape, T) also times vLLM
0.26.0's ``fused_experts`` on the same inputs, with its own tile tables (``vllm_us``).
    python bench/moe_tile_sweep.py [--vllm] [shape ...] > rows.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # gpu_timing, tokenmill
from gpu_timing import _provenance, _time_graph  # noqa: E402
from moe_bench import _routings  # noqa: E402  (ROUTINGS random routings a call cycles through)

from tokenmill.kernels.triton import fused_moe  # noqa: E402
from tokenmill.kernels.triton.fused_moe import MoeConfig  # noqa: E402

SHAPES = {  # name: (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 4096, 16384)
# Upper edges of the rule's buckets of mean pairs an expert (the last is open).
BUCKETS = (0.5, 2.0, 8.0, 32.0, 128.0, 512.0, float("inf"))


def _tile(m: int, n: int, k: int, warps: int, stages: int, group: int = 8) -> MoeConfig:
    return MoeConfig(block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages, group_m=group)


CANDIDATES = (
    fused_moe.SMALL_TILES, fused_moe.LARGE_TILES,
    _tile(16, 64, 64, 4, 5), _tile(16, 64, 128, 4, 3), _tile(16, 64, 256, 4, 2), _tile(16, 128, 128, 4, 3),
    _tile(16, 128, 64, 4, 4), _tile(16, 256, 128, 8, 2), _tile(16, 64, 128, 4, 4, 1),
    _tile(32, 64, 128, 4, 3), _tile(32, 128, 128, 4, 3), _tile(32, 256, 128, 4, 2),
    _tile(64, 128, 64, 4, 3), _tile(64, 256, 64, 8, 3), _tile(64, 128, 128, 4, 3),
    _tile(128, 128, 64, 8, 3), _tile(128, 256, 64, 8, 4), _tile(128, 256, 64, 8, 4, 1),
)


def _timed(calls: list, tokens: int) -> float:
    """Median µs per call of ``calls`` in turn under graph replays (fewer replays for long calls)."""
    median, _ = _time_graph(lambda: [c() for c in calls], calls_per_graph=4 if tokens <= 512 else 1,
                            replays=30 if tokens <= 1024 else 8)
    return median / len(calls)


def _vllm_experts():
    """vLLM's fused_experts, or None where vLLM does not import (no bundle)."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    except Exception as exc:  # noqa: BLE001 - any import failure means no vLLM column
        print(json.dumps({"bench": "moe_tile_sweep", "vllm": f"not importable: {exc!r}"[:300]}), flush=True)
        return None
    return fused_experts


def sweep(name: str, vllm_experts) -> list[dict]:
    hidden, inter, experts, top_k = SHAPES[name]
    torch.manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5
    rows = []
    for tokens in TOKENS:
        if tokens * top_k * 3 * max(hidden, 2 * inter) * 2 > 8 << 30:
            continue  # the per-pair buffers past a few GB: no engine step is that large
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        routings = _routings(tokens, experts, top_k)
        want = fused_moe.fused_experts(x, w13, w2, *routings[0], config=fused_moe.SMALL_TILES).float()
        engine = fused_moe.choose_config(tokens * top_k, experts, x.dtype, fused_moe.tile_classes(hidden, inter, False))
        row = {**_provenance("moe_tile_sweep", f"{name}-t{tokens}"), "shape": name, "tokens": tokens,
               "pairs_per_expert": tokens * top_k / experts, "engine": dataclasses.asdict(engine), "us": {}}
        for cand in CANDIDATES:
            got = fused_moe.fused_experts(x, w13, w2, *routings[0], config=cand).float()
            torch.testing.assert_close(got, want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)
            us = _timed([lambda w=w, i=i, c=cand: fused_moe.fused_experts(x, w13, w2, w, i, config=c)
                         for w, i in routings], tokens)
            row["us"][_key(cand)] = round(us, 2)
        row["engine_us"] = row["us"][_key(engine)]
        row["best"], row["best_us"] = min(row["us"].items(), key=lambda kv: kv[1])
        if vllm_experts is not None:
            try:
                theirs = vllm_experts(x, w13, w2, *routings[0]).float()
                row["vllm_max_diff_rel"] = round(float((theirs - want).abs().max() / want.abs().max()), 5)
                row["vllm_us"] = round(_timed([lambda w=w, i=i: vllm_experts(x, w13, w2, w, i) for w, i in routings],
                                              tokens), 2)
            except Exception as exc:  # noqa: BLE001 - record why, keep sweeping
                row["vllm_error"] = repr(exc)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _key(cfg: MoeConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}g{cfg.group_m}"


def _bucket(pairs_per_expert: float) -> float:
    return next(edge for edge in BUCKETS if pairs_per_expert <= edge)


def best_rule(rows: list[dict]) -> dict:
    """Each bucket's tile: the least summed time relative to each (shape, T)'s best tile."""
    rule, total_rule, total_engine = [], 0.0, 0.0
    by_key = {_key(c): c for c in CANDIDATES}
    for edge in BUCKETS:
        inside = [r for r in rows if _bucket(r["pairs_per_expert"]) == edge]
        if not inside:
            continue
        score = {k: sum(r["us"][k] / r["best_us"] for r in inside) for k in by_key}
        chosen = min(score, key=score.get)
        rule.append({"max_pairs_per_expert": edge if edge != float("inf") else None,
                     **dataclasses.asdict(by_key[chosen])})
        total_rule += sum(r["us"][chosen] for r in inside)
        total_engine += sum(r["engine_us"] for r in inside)
    return {**_provenance("moe_tile_rule", "rule"), "rule": rule, "rule_us_sum": round(total_rule, 1),
            "engine_us_sum": round(total_engine, 1)}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("moe_tile_sweep.py needs a CUDA GPU")
    args = sys.argv[1:]
    vllm_experts = _vllm_experts() if "--vllm" in args else None
    names = [a for a in args if a in SHAPES] or list(SHAPES)
    rows = [row for name in names for row in sweep(name, vllm_experts)]
    print(json.dumps(best_rule(rows)), flush=True)


if __name__ == "__main__":
    main()
