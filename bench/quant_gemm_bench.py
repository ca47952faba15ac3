"""Quantized GEMMs on Llama-3-8B's projections against bf16 cuBLAS (torch's F.linear).

W4A16 (issue 18's target: >= 2.5x the bf16 GEMM at decode sizes M 1-64): our Triton kernel with
the engine's own choice of tiles and K split, and the best of a small sweep of its knobs (so a
better heuristic shows up as a gap between the two), plus the operands-not-swapped and
plain-Triton-dequant variants the engine does not launch (every config's time in the row), and
past 64 rows also one 128-row tile and the dequantize pass + cuBLAS those sizes ran before; at
prefill sizes (M 256-16384) the kernel against dequantize-then-cuBLAS (where the two cross decides
DEQUANT_MIN_M). FP8 at M 1-4096: activation quantization alone, ``torch._scaled_mm`` (rowwise
scales) with exact and with fast accumulation (the engine's where the swapped kernel does not
run), our swapped split-K fp8 GEMM up to NARROW_SWAPPED_MAX_M rows with the engine's config and a
sweep around it (``runs_swapped`` says where the engine takes it), the plain Triton tiles, and the
engine's whole fp8 linear (quantize + GEMM) against bf16. ``fused``: the add + RMSNorm before qkv and
gate_up alone, followed by ``quantize_fp8`` (the path before the fusion), and quantizing its own
output (the engine's path).

Every timing is a CUDA-graph replay (bench/gpu_timing.py's timer) cycling through enough
copies of the weights to exceed the 60 MB L2 twice over, so weights come from HBM as they do in
a decode step that reads every layer. One JSON row per (shape, M, kind). ``block``: the
block-wise fp8 linear (Qwen3-*-FP8's layout) beside the per-channel one and bf16.
    python bench/quant_gemm_bench.py [w4a16] [fp8] [fused] [block]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # gpu_timing, tokenmill
from gpu_timing import _provenance, _time_graph  # noqa: E402

from tokenmill.kernels.triton.fp8_gemm import (  # noqa: E402
    NARROW_SWAPPED_MAX_M, choose_swapped_config, fp8_gemm, quantize_fp8, runs_swapped)
from tokenmill.kernels.triton.fp8_gemm import counters_needed as fp8_counters_needed  # noqa: E402
from tokenmill.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm_fp8  # noqa: E402
from tokenmill.kernels.triton.sm_count import num_sms  # noqa: E402
from tokenmill.kernels.triton.w4a16_gemm import (  # noqa: E402
    DEQUANT_MIN_M, K_TILE, choose_config, counters_needed, dequantize_weight, w4a16_gemm)
from tokenmill.quantization.fp8 import quantize_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
L2_BYTES = 60 * 2**20
# Sizes the swapped GEMM runs (rows past 64 in 64-row tiles, or one 128-row tile in the sweep), then
# prefill sizes from DEQUANT_MIN_M up to a whole 32 x 512-token prompt batch in one step.
DECODE_M = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128)
PREFILL_M = (256, 512, 1024, 4096, 16384)


def _copies(weight_bytes: int) -> int:
    return max(2, -(-2 * L2_BYTES // weight_bytes))


def _cycled(calls: list) -> tuple[float, float]:
    """Per-call microseconds of calls[i] run one after another (one graph replay runs them all)."""
    median, low = _time_graph(lambda: [c() for c in calls], calls_per_graph=1)
    return median / len(calls), low / len(calls)


def _sweep(auto: dict, m: int) -> list[dict]:
    """The knobs of the decode-size W4A16 kernel around the engine's choice: the K split (a
    quarter, half, the same and twice) at 3 and 4 pipeline stages, half and the same at 5 and 6,
    64 outputs a program, 256 on one warpgroup, two warpgroups a program, and the two paths it
    does not take (operands not swapped; the plain-Triton dequant instead of the inline-PTX one)."""
    configs = []
    splits = sorted({max(1, auto["split_k"] // 4), max(1, auto["split_k"] // 2), auto["split_k"], min(16, auto["split_k"] * 2)})
    for stages in (3, 4):
        for split in splits:
            configs.append(dict(auto, BLOCK_N=128, num_warps=4, num_stages=stages, split_k=split))
    # Deeper pipelines: at M <= 16 a program streams only 4-14 K tiles (qkv and o at 8 splits: 4), and
    # 3 stages keep two tiles in flight, so it waits on memory at least twice; 5-6 stages ask for
    # (nearly) all of a short program's words at once. sm_90 compile at M = 1: 29 / 54 / 66 KB of shared
    # memory and 80 / 80 / 96 registers at 3 / 5 / 6 stages, no spills (3-7 programs an SM).
    configs += [dict(auto, BLOCK_N=128, num_warps=4, num_stages=stages, split_k=split)
                for stages in (5, 6) for split in sorted({max(1, auto["split_k"] // 2), auto["split_k"]})]
    configs.append(dict(auto, BLOCK_N=64, num_warps=4))
    # 256 outputs on one warpgroup: each 16-feature slice's MMAs wait for completion before the next
    # slice is dequantized into the same registers (sm_90 SASS at M = 16: 8 waits a K tile, each after
    # 2 HGMMAs at 128 outputs); 256 outputs put 4 HGMMAs under each wait and take 2.6 instead of 3.2
    # instructions a weight (168 registers, 46 KB: three programs an SM). Half the output tiles, so
    # the K split doubled too.
    configs += [dict(auto, BLOCK_N=256, num_warps=4, num_stages=3, split_k=split)
                for split in sorted({auto["split_k"], min(16, auto["split_k"] * 2)})]
    # Two warpgroups a program: more warps to hide the MMA waits (113 registers at M 64, 128
    # outputs, against 224 for one), against more instructions a weight (4.8 vs 3.5 SASS).
    configs += [dict(auto, BLOCK_N=block_n, num_warps=8, num_stages=3) for block_n in (128, 256)]
    configs += [dict(auto, SWAP=False), dict(auto, DEQUANT_ASM=False)]
    if m > 64:
        # Past 64 rows: all of them in one tile on two warpgroups (one dequantization for 128
        # tokens; 225 registers, 115 KB of shared memory, one program an SM), K split 1-4.
        configs += [dict(auto, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, split_k=split) for split in (1, 2, 4)]
    return configs


def bench_w4a16() -> None:
    sms = num_sms(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        copies = _copies(n * k // 2)
        # Random words in the kernel's layout ([16 * K / 128, N], what pack_for_kernel makes at load):
        # every bit pattern is a valid set of codes, and the kernel's cost does not depend on them.
        packed = [torch.randint(-(2**31), 2**31 - 1, (16 * triton.cdiv(k, K_TILE), n), device="cuda", dtype=torch.int32)
                  for _ in range(copies)]
        scales = [(torch.rand(k // 128, n, device="cuda") * 0.004).to(torch.bfloat16) for _ in range(copies)]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(_copies(n * k * 2))]
        counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
        for m in DECODE_M:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us, _ = _cycled([lambda w=w: F.linear(x, w) for w in dense])
            auto = choose_config(m, n, k, 128, sms)
            auto_us, _ = _cycled([lambda i=i: w4a16_gemm(x, packed[i], scales[i], None, 128, None, counters) for i in range(copies)])
            best = (auto_us, auto)
            variant_us = {}
            sweep = {}  # every config's time, so a later heuristic can be read off the rows
            for cfg in _sweep(auto, m):
                try:
                    us, _ = _cycled([lambda i=i, cfg=cfg: w4a16_gemm(x, packed[i], scales[i], None, 128, None, counters, cfg)
                                     for i in range(copies)])
                except Exception as exc:  # noqa: BLE001  (a config that does not fit: skip it)
                    print(f"# {name} M={m} {cfg}: {repr(exc)[:100]}", file=sys.stderr)
                    continue
                sweep[_label(cfg)] = round(us, 2)
                for knob in ("SWAP", "DEQUANT_ASM"):
                    if knob in cfg:
                        variant_us[knob] = round(us, 2)
                if us < best[0]:
                    best = (us, cfg)
            row = {**_provenance("w4a16_gemm", f"llama3-8b-{name}-m{m}"), "n": n, "k": k, "m": m,
                   "bf16_cublas_us": round(bf16_us, 2), "w4a16_us": round(auto_us, 2), "w4a16_config": auto,
                   "speedup": round(bf16_us / auto_us, 2), "w4a16_gbps": round(n * k / 2 / auto_us / 1e3, 1),
                   "best_sweep_us": round(best[0], 2), "best_sweep_config": best[1],
                   "unswapped_us": variant_us.get("SWAP"), "plain_dequant_us": variant_us.get("DEQUANT_ASM"), "sweep": sweep}
            if m > 64:  # what these sizes ran before (docs/perf.md entry 25): the pass, then cuBLAS
                row["dequant_cublas_us"] = round(_dequant_cublas_us(x, packed, scales), 2)
            print(json.dumps(row), flush=True)
        for m in PREFILL_M:
            print(json.dumps(_prefill_row(name, n, k, m, packed, scales, dense, counters)), flush=True)


def _label(cfg: dict) -> str:
    """A sweep config in a few characters: rows x outputs, warps, stages, K split, and any path flag."""
    flags = "".join(f" {knob}={cfg[knob]}" for knob in ("SWAP", "DEQUANT_ASM") if knob in cfg)
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} k{cfg['split_k']}{flags}"


def _dequant_cublas_us(x: torch.Tensor, packed: list, scales: list) -> float:
    """Per call: each layer's dequantize pass into a fresh scratch, then cuBLAS on it (``w4a16_linear``
    from DEQUANT_MIN_M on)."""
    k = x.shape[1]
    us, _ = _cycled([lambda i=i: F.linear(x, dequantize_weight(packed[i], scales[i], None, 128, k, torch.bfloat16).t())
                     for i in range(len(packed))])
    return us


def _prefill_row(name: str, n: int, k: int, m: int, packed: list, scales: list, dense: list, counters: torch.Tensor) -> dict:
    """Past the decode sizes: the register-dequant GEMM, the dequantize pass alone, cuBLAS on its
    output (w^T [K, N], read through a .t() view), the two together (what w4a16_linear runs from
    DEQUANT_MIN_M on), and bf16 cuBLAS on a [N, K] weight; the engine's path is the one
    w4a16_linear takes at this M."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = len(packed)
    scratch = dequantize_weight(packed[0], scales[0], None, 128, k, torch.bfloat16)
    bf16_us, _ = _cycled([lambda w=w: F.linear(x, w) for w in dense])
    kernel_us, _ = _cycled([lambda i=i: w4a16_gemm(x, packed[i], scales[i], None, 128, None, counters) for i in range(copies)])
    dequant_us, _ = _cycled([lambda i=i: dequantize_weight(packed[i], scales[i], None, 128, k, torch.bfloat16, out=scratch)
                             for i in range(copies)])
    scratch_linear_us, _ = _time_graph(lambda: F.linear(x, scratch.t()), calls_per_graph=1)
    both_us = _dequant_cublas_us(x, packed, scales)
    engine = "dequant_cublas" if m >= DEQUANT_MIN_M else "kernel"
    engine_us = both_us if engine == "dequant_cublas" else kernel_us
    tflops = lambda us: round(2 * m * n * k / us / 1e6, 1)  # noqa: E731
    return {**_provenance("w4a16_gemm", f"llama3-8b-{name}-m{m}"), "n": n, "k": k, "m": m,
            "bf16_cublas_us": round(bf16_us, 2), "w4a16_us": round(engine_us, 2), "engine_path": engine,
            "speedup": round(bf16_us / engine_us, 2), "kernel_us": round(kernel_us, 2),
            "w4a16_config": choose_config(m, n, k, 128, num_sms(torch.device("cuda"))),
            "dequant_us": round(dequant_us, 2), "dequant_gbps": round(n * k * 2.5 / dequant_us / 1e3, 1),
            "cublas_on_scratch_us": round(scratch_linear_us, 2), "dequant_cublas_us": round(both_us, 2),
            "bf16_tflops": tflops(bf16_us), "kernel_tflops": tflops(kernel_us), "dequant_cublas_tflops": tflops(both_us)}


def _fp8_sweep(auto: dict) -> list[dict]:
    """The swapped fp8 GEMM's knobs around the engine's choice: the K split halved and doubled,
    3, 4 and 6 pipeline stages, 256-feature K steps, 64 weight rows a program, and the other warp count."""
    configs = [dict(auto, split_k=s) for s in sorted({max(1, auto["split_k"] // 2), auto["split_k"] * 2})]
    configs += [dict(auto, num_stages=stages) for stages in (3, 4, 6)]
    configs += [dict(auto, BLOCK_K=256, num_stages=stages) for stages in (2, 3)]
    configs += [dict(auto, BLOCK_N=64, split_k=s) for s in sorted({auto["split_k"], auto["split_k"] * 2})]
    configs.append(dict(auto, num_warps=8 if auto["num_warps"] == 4 else 4))
    return [c for c in configs if c != auto]


def bench_fp8() -> None:
    sms = num_sms(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        copies = _copies(n * k)
        fp8 = [quantize_rows(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(_copies(n * k * 2))]
        counters = torch.zeros(fp8_counters_needed(n), dtype=torch.int32, device="cuda")
        for m in (1, 4, 16, 32, 64, 96, 128, 192, 256, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_fp8(x)
            bf16_us, _ = _cycled([lambda w=w: F.linear(x, w) for w in dense])
            quant_us, _ = _time_graph(lambda: quantize_fp8(x))
            scaled_us, _ = _cycled([lambda w=w, s=s: torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                                                         out_dtype=torch.bfloat16) for w, s in fp8])
            fast_us, _ = _cycled([lambda w=w, s=s: torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :],
                                                                       out_dtype=torch.bfloat16, use_fast_accum=True) for w, s in fp8])

            def triton_us(config: dict | None) -> float | None:
                try:
                    return _cycled([lambda w=w, s=s: fp8_gemm(xq, xs, w, s, None, torch.bfloat16, counters, config=config)
                                    for w, s in fp8])[0]
                except Exception as exc:  # noqa: BLE001  (a sweep config past the shared memory)
                    print(f"# {name} m={m} {config}: {type(exc).__name__}", file=sys.stderr)
                    return None

            flops = 2 * m * n * k
            tflops = lambda us: round(flops / us / 1e6, 1) if us else None  # noqa: E731
            row = {**_provenance("fp8_gemm", f"llama3-8b-{name}-m{m}"), "n": n, "k": k, "m": m,
                   "bf16_cublas_us": round(bf16_us, 2), "quantize_us": round(quant_us, 2),
                   "scaled_mm_us": round(scaled_us, 2), "scaled_mm_fast_accum_us": round(fast_us, 2)}
            swapped_path = runs_swapped(m, n, sms)  # the engine's choice
            if m <= NARROW_SWAPPED_MAX_M:  # the swapped kernel at every size it may take, chosen or not
                auto = choose_swapped_config(m, n, k, sms)
                swapped = triton_us(None)
                sweep = [(c, triton_us(c)) for c in _fp8_sweep(auto)]
                best_cfg, best_us = min([(auto, swapped)] + [(c, t) for c, t in sweep if t], key=lambda ct: ct[1])
                engine_us = swapped if swapped_path else fast_us
                row.update(swapped_us=round(swapped, 2), swapped_config=auto, swapped_gbps=round(n * k / swapped / 1e3, 1),
                           swapped_best_us=round(best_us, 2), swapped_best_config=best_cfg,
                           sweep=[[c, round(t, 2) if t else None] for c, t in sweep])
            else:
                engine_us = fast_us
            if not swapped_path:
                row.update(triton_fp8_us=round(triton_us(None), 2))
            row.update(engine_gemm_us=round(engine_us, 2),
                       # the engine's fp8 linear: quantize, then the swapped GEMM or _scaled_mm (fast accumulation)
                       linear_speedup=round(bf16_us / (quant_us + engine_us), 2),
                       bf16_tflops=tflops(bf16_us), fast_accum_tflops=tflops(fast_us), engine_tflops=tflops(engine_us))
            print(json.dumps(row), flush=True)


def bench_block() -> None:
    """Block-wise fp8 (128 x 128 weight blocks, activations per token and 128-group: Qwen3-*-FP8)
    beside the per-channel fp8 linear the engine runs and bf16 cuBLAS, each a whole linear
    (activation quantization included), at decode and prompt sizes (docs/perf.md 119's prediction)."""
    from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm, quantize_fp8_groups

    sms = num_sms(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        copies = _copies(n * k)
        fp8 = [quantize_rows(torch.randn(n, k, device="cuda") * 0.02) for _ in range(copies)]
        blocks = [(codes, torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda") * 1e-3) for codes, _ in fp8]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(_copies(n * k * 2))]
        counters = torch.zeros(fp8_counters_needed(n), dtype=torch.int32, device="cuda")
        for m in (1, 4, 16, 32, 64, 128, 256, 1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def channel(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # the engine's per-channel fp8 linear
                xq, xs = quantize_fp8(x)
                if runs_swapped(m, n, sms):
                    return fp8_gemm(xq, xs, w, s, None, torch.bfloat16, counters)
                return torch._scaled_mm(xq, w.t(), scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

            def block(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
                xq, xs = quantize_fp8_groups(x)
                return block_fp8_gemm(xq, xs, w, s, None, torch.bfloat16, counters)

            bf16_us, _ = _cycled([lambda w=w: F.linear(x, w) for w in dense])
            channel_us, _ = _cycled([lambda w=w, s=s: channel(w, s) for w, s in fp8])
            block_us, _ = _cycled([lambda w=w, s=s: block(w, s) for w, s in blocks])
            group_quant_us, _ = _time_graph(lambda: quantize_fp8_groups(x))
            row = {**_provenance("block_fp8_gemm", f"llama3-8b-{name}-m{m}"), "n": n, "k": k, "m": m,
                   "bf16_cublas_us": round(bf16_us, 2), "channel_linear_us": round(channel_us, 2),
                   "block_linear_us": round(block_us, 2), "group_quantize_us": round(group_quant_us, 2),
                   "block_vs_channel": round(channel_us / block_us, 2), "block_vs_bf16": round(bf16_us / block_us, 2),
                   "swapped": runs_swapped(m, n, sms)}
            print(json.dumps(row), flush=True)


def bench_fused() -> None:
    """Per call, CUDA-graph replays (inputs in L2, as the previous GEMM leaves them in a decode step)."""
    hidden = 4096
    weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    for m in (16, 64, 256, 1024, 4096):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        cases = {
            "add_rms_norm": (lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
                             lambda: quantize_fp8(fused_add_rms_norm(x, residual, weight, 1e-5)[0]),
                             lambda: rms_norm_fp8(x, weight, 1e-5, residual=residual)),
        }  # (SiLU-and-mul quantizing its own output ran slower than the two launches: removed, perf.md 23)
        for name, (alone, unfused, fused) in cases.items():
            alone_us, unfused_us, fused_us = (_time_graph(fn)[0] for fn in (alone, unfused, fused))
            row = {**_provenance("fp8_fused_quantize", f"llama3-8b-{name}-m{m}"), "m": m, "bf16_alone_us": round(alone_us, 2),
                   "then_quantize_us": round(unfused_us, 2), "fused_us": round(fused_us, 2),
                   "saved_us": round(unfused_us - fused_us, 2)}
            print(json.dumps(row), flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("quant_gemm_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    parts = sys.argv[1:] or ["w4a16", "fp8", "fused", "block"]
    if "w4a16" in parts:
        bench_w4a16()
    if "fp8" in parts:
        bench_fp8()
    if "fused" in parts:
        bench_fused()
    if "block" in parts:
        bench_block()


if __name__ == "__main__":
    main()
