"""The swapped fp8 GEMM past 64 tokens on larger tiles (issue 18: P3 with ``quantization="fp8"``).

At the decode graphs' buckets past 64 rows (96-256) the engine runs o and down (and qkv up to 128
rows) on 64-token x 128-weight-row tiles, one program an SM, and qkv past 128 and gate_up on
``torch._scaled_mm``. A 64 x 128 tile re-reads x once per 128 weight rows and the weight once per 64
tokens: at M = 256 o moves ~100 MB through L2 for 17 MB of weights, ~8 TB/s at its 12.2 µs, and the
step is at ~35% of the fp8 tensor cores' peak. Larger tiles move fewer bytes per product, at the
price of fewer tiles (a K split fills the SMs again, its fp32 partials being L2 traffic too).
Measured on an H200 (403bb60, docs/perf.md 81): every larger tile was slower on o and down at every
bucket, and the best rule of the family was the engine's own; the L2 reading did not hold.

This times, for each of Llama-3-8B's projections at each bucket past 64 rows: ``_scaled_mm`` (fast
accumulation, the engine's path where the swapped kernel does not run), the engine's own choice,
and every candidate tile (tokens x weight rows, warps, stages) at K splits 1, 2, 4 and 8. Then it
scores a family of rules, "tile T, its K split filling up to ``fill`` programs an SM, taken where
T's tiles number at most ``qualify`` x the SMs (else ``_scaled_mm``)", by their summed time over
all shapes and buckets, against the engine's rule; the last row is the best rule, the JSON that
bench/tokenmill_fp8_tiles.py takes (``TOKENMILL_FP8_TILES``) for an end-to-end A/B.
    python bench/fp8_tile_sweep.py > rows.jsonl
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # gpu_timing, tokenmill
from gpu_timing import _provenance  # noqa: E402
from quant_gemm_bench import SHAPES, _copies, _cycled  # noqa: E402

from tokenmill.kernels.triton.fp8_gemm import (  # noqa: E402
    SWAPPED_MAX_M, choose_swapped_config, counters_needed, fp8_gemm, quantize_fp8, runs_swapped)
from tokenmill.kernels.triton.sm_count import num_sms  # noqa: E402
from tokenmill.quantization.fp8 import quantize_rows  # noqa: E402

BUCKETS = (96, 128, 160, 192, 224, 256)  # the decode graphs' batch buckets past 64 rows
# (tokens, weight rows, warps, stages); BLOCK_K 128. Shared memory a stage: (tokens + rows) x 128 B.
# All compile for sm_90 without spills (144-200 KB, up to 255 registers with a K split).
TILES = ((64, 128, 4, 6), (128, 128, 4, 5), (128, 128, 8, 5), (64, 256, 8, 4), (128, 256, 8, 3), (128, 256, 8, 4),
         (256, 128, 8, 3), (256, 128, 8, 4))
SPLITS = (1, 2, 4, 8)


def tile_config(tile: tuple[int, int, int, int], split: int) -> dict[str, int]:
    block_m, block_n, warps, stages = tile
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=stages, split_k=split)


def rule_split(tile: tuple[int, int, int, int], m: int, n: int, k: int, sms: int, fill: int) -> int:
    """The K split a rule gives: doubled while the launch stays within ``fill`` programs an SM and each
    split keeps at least 4 K steps, at most 8."""
    tiles = triton.cdiv(n, tile[1]) * triton.cdiv(m, tile[0])
    split = 1
    while split * 2 <= 8 and tiles * split * 2 <= fill * sms and triton.cdiv(k, 128) // (split * 2) >= 4:
        split *= 2
    return split


def rule_takes(tile: tuple[int, int, int, int], m: int, n: int, sms: int, qualify: float) -> bool:
    """Whether a rule runs the swapped kernel on this product (``qualify`` 0: the engine's own test)."""
    if qualify == 0:
        return runs_swapped(m, n, sms)
    return triton.cdiv(n, tile[1]) * triton.cdiv(m, tile[0]) <= qualify * sms


def sweep(sms: int) -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = _copies(n * k)
        fp8 = [quantize_rows(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
        for m in BUCKETS:
            xq, xs = quantize_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))

            def us(config: dict | None) -> float | None:
                try:
                    return round(_cycled([lambda w=w, s=s: fp8_gemm(xq, xs, w, s, None, torch.bfloat16, counters, config=config)
                                          for w, s in fp8])[0], 2)
                except Exception as exc:  # noqa: BLE001  (a tile past the shared memory or the registers)
                    print(f"# {name} m={m} {config}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                    return None

            fast = _cycled([lambda w=w, s=s: torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                                               out_dtype=torch.bfloat16, use_fast_accum=True) for w, s in fp8])[0]
            engine_swapped = us(choose_swapped_config(m, n, k, sms))
            row = {**_provenance("fp8_tile_sweep", f"llama3-8b-{name}-m{m}"), "n": n, "k": k, "m": m,
                   "scaled_mm_fast_accum_us": round(fast, 2), "engine_swapped_us": engine_swapped,
                   "engine_config": choose_swapped_config(m, n, k, sms), "engine_runs_swapped": runs_swapped(m, n, sms),
                   "tiles": {f"{t[0]}x{t[1]}w{t[2]}s{t[3]}/k{s}": us(tile_config(t, s)) for t in TILES for s in SPLITS}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def score_rules(rows: list[dict], sms: int) -> list[dict]:
    """Every rule of the family, summed over the rows, best first; the engine's rule first of all."""
    def engine_us(row: dict) -> float:
        return row["engine_swapped_us"] if row["engine_runs_swapped"] else row["scaled_mm_fast_accum_us"]

    base = sum(engine_us(r) for r in rows)
    scored = []
    for tile, fill, qualify in itertools.product(TILES, (1, 2), (0, 0.5, 1, 2)):
        total, picks = 0.0, {}
        for r in rows:
            if rule_takes(tile, r["m"], r["n"], sms, qualify):
                split = rule_split(tile, r["m"], r["n"], r["k"], sms, fill)
                t = r["tiles"].get(f"{tile[0]}x{tile[1]}w{tile[2]}s{tile[3]}/k{split}")
                if t is None:
                    break  # the rule picks a tile that did not run: not a candidate
                picks[r["case"]] = split
            else:
                t = r["scaled_mm_fast_accum_us"]
            total += t
        else:
            scored.append({"tile": list(tile), "fill": fill, "qualify": qualify, "total_us": round(total, 1),
                           "vs_engine": round(base / total, 4), "splits": picks})
    scored.sort(key=lambda s: s["total_us"])
    return [{"engine_rule_total_us": round(base, 1)}] + scored


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("fp8_tile_sweep.py needs a CUDA GPU")
    torch.manual_seed(0)
    sms = num_sms(torch.device("cuda"))
    if SWAPPED_MAX_M >= BUCKETS[0]:
        raise SystemExit("the swapped kernel's small-M rule now reaches the buckets swept here")
    rows = sweep(sms)
    scored = score_rules(rows, sms)
    for s in scored[:12]:
        print(json.dumps({**_provenance("fp8_tile_rule", "llama3-8b"), **s}), flush=True)
    best = scored[1]
    rule = {"BLOCK_M": best["tile"][0], "BLOCK_N": best["tile"][1], "num_warps": best["tile"][2],
            "num_stages": best["tile"][3], "fill": best["fill"], "qualify": best["qualify"]}
    print(json.dumps({**_provenance("fp8_tile_best_rule", "llama3-8b"), "rule": rule, "vs_engine": best["vs_engine"]}), flush=True)


if __name__ == "__main__":
    main()
