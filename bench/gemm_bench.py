"""Decode-step GEMMs: cuBLAS (torch's F.linear) against a plain Triton tile sweep.

Question it answers: P1's decode GEMMs take ~7 µs each (112 a step, ~0.8 ms) where the weight
bytes need ~2-3 µs; is a simple Triton linear kernel with small-M tiles faster inside a CUDA
graph? Shapes: Qwen3-0.6B's and Llama-3-8B's four projections (qkv, o, gate_up, down) at M = 256
(P1's full decode batch), 128 and 32 (its tail). Each config is checked against F.linear first,
then timed by CUDA-graph replays (bench/gpu_timing.py's timer). One JSON row per (shape, M).
This is a prototype to decide whether a GEMM of our own is worth building; the engine uses cuBLAS.
    python bench/gemm_bench.py

``--decode-sweep`` asks the question again after entry 37 (docs/perf.md) gave fp8 weights a swapped,
split-K decode GEMM: at M 1-256, cuBLAS as the engine calls it (F.linear), cuBLASLt (torch's
``preferred_blas_library``), cuBLAS on the weight stored [K, N], and the swapped kernel
(``fp8_gemm._fp8_swapped_kernel`` on bf16 operands, unit scales) over its tiles, stages and splits.
    python bench/gemm_bench.py --decode-sweep
Measured (entry 47, 7cd90ec): the swapped kernel lost to cuBLAS on 30 of the 32 Qwen3-0.6B shapes, and
cuBLASLt and the [K, N] layout were within 5% of cuBLAS; the engine keeps cuBLAS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import _provenance, _time_graph  # noqa: E402

SHAPES = {  # name: (N, K) of the weight, per model
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "llama3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_M is capped by M.
CONFIGS = [
    (16, 64, 256, 4, 4), (32, 64, 128, 4, 5), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (256, 64, 64, 8, 3), (256, 128, 64, 8, 3),
]


@triton.jit
def _linear_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Programs walk N fastest, so the programs alive at once share the same rows of A.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * stride_am + rk[None, :]
    w = w_ptr + rn[None, :] * stride_wn + rk[:, None]  # the [BLOCK_K, BLOCK_N] tile of W^T
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 and N % BLOCK_N == 0 for every shape here
        acc += tl.dot(tl.load(a, mask=rm[:, None] < M, other=0.0), tl.load(w))
        a += BLOCK_K
        w += BLOCK_K
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: tuple[int, ...]) -> torch.Tensor:
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    _linear_kernel[(n // bn, triton.cdiv(m, bm))](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return out


SWEEP_M = {"qwen3-0.6b": (1, 16, 32, 64, 96, 128, 192, 256), "llama3-8b": (16, 64, 128, 256)}


def swapped_linear(x: torch.Tensor, w: torch.Tensor, ones: torch.Tensor, out: torch.Tensor, counters: torch.Tensor,
                   block_m: int, split: int, stages: int) -> torch.Tensor:
    """y = x W^T on the fp8 path's swapped split-K kernel (``fp8_gemm`` with a forced config), bf16
    operands and unit scales."""
    from tokenmill.kernels.triton.fp8_gemm import fp8_gemm

    config = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=stages, split_k=split)
    return fp8_gemm(x, ones[: x.shape[0]], w, ones[: w.shape[0]], None, out.dtype, counters, config, out=out)


def decode_sweep() -> None:
    """One row per (shape, M): cuBLAS, cuBLASLt, cuBLAS on W^T stored, and the best swapped config."""
    torch.manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            wt = w.t().contiguous()
            ones = torch.ones(max(n, 256), device="cuda", dtype=torch.float32)
            counters = torch.zeros(triton.cdiv(n, 128) * 16, device="cuda", dtype=torch.int32)
            for m in SWEEP_M[model]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = torch.nn.functional.linear(x, w)
                row = {**_provenance("decode_gemm_sweep", f"{model}-{name}-m{m}"), "n": n, "k": k, "m": m}
                row["cublas_us"] = round(_time_graph(lambda: torch.nn.functional.linear(x, w))[0], 2)
                row["cublas_wt_us"] = round(_time_graph(lambda: torch.mm(x, wt))[0], 2)
                previous = torch.backends.cuda.preferred_blas_library()
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    row["cublaslt_us"] = round(_time_graph(lambda: torch.nn.functional.linear(x, w))[0], 2)
                finally:
                    torch.backends.cuda.preferred_blas_library(previous)
                best = None
                max_split = max(1, triton.cdiv(k, 64) // 4)
                for block_m in dict.fromkeys(min(bm, max(16, triton.next_power_of_2(m))) for bm in (16, 32, 64)):
                    for stages in (4, 6):
                        for split in (s for s in (1, 2, 4, 8, 16) if s <= max_split):
                            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                            args = (x, w, ones, out, counters, block_m, split, stages)
                            try:
                                torch.testing.assert_close(swapped_linear(*args), want, atol=2e-2, rtol=2e-2)
                                us = _time_graph(lambda: swapped_linear(*args))[0]
                            except Exception as exc:  # noqa: BLE001  (out of shared memory: skip the config)
                                print(f"# {model} {name} M={m} {(block_m, stages, split)}: {repr(exc)[:120]}", file=sys.stderr)
                                continue
                            if best is None or us < best[0]:
                                best = (us, [block_m, stages, split])
                if best is not None:
                    row.update(swapped_us=round(best[0], 2), swapped_config=best[1],
                               speedup=round(row["cublas_us"] / best[0], 3))
                row["weight_floor_us"] = round(n * k * 2 / 4.3e6, 2)
                print(json.dumps(row), flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gemm_bench.py needs a CUDA GPU")
    if "--decode-sweep" in sys.argv[1:]:
        decode_sweep()
        return
    torch.manual_seed(0)
    for model, shapes in SHAPES.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            for m in (256, 128, 32):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = torch.nn.functional.linear(x, w)
                cublas_us, _ = _time_graph(lambda: torch.nn.functional.linear(x, w))
                best: tuple[float, tuple[int, ...]] | None = None
                for config in dict.fromkeys((min(bm, max(16, triton.next_power_of_2(m))), *rest) for bm, *rest in CONFIGS):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    try:
                        torch.testing.assert_close(triton_linear(x, w, out, config), want, atol=2e-2, rtol=2e-2)
                        us, _ = _time_graph(lambda: triton_linear(x, w, out, config))
                    except Exception as exc:  # noqa: BLE001  (out of shared memory etc.: skip the config)
                        print(f"# {model} {name} M={m} {config}: {repr(exc)[:120]}", file=sys.stderr)
                        continue
                    if best is None or us < best[0]:
                        best = (us, config)
                weight_bytes = n * k * 2
                row = {**_provenance("decode_gemm", f"{model}-{name}-m{m}"), "n": n, "k": k, "m": m,
                       "cublas_us": round(cublas_us, 2), "cublas_gbps": round(weight_bytes / cublas_us / 1e3, 1),
                       "cublas_tflops": round(2 * m * n * k / cublas_us / 1e6, 1)}
                if best is not None:
                    row.update(triton_us=round(best[0], 2), triton_config=list(best[1]),
                               triton_gbps=round(weight_bytes / best[0] / 1e3, 1), speedup=round(cublas_us / best[0], 3))
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
