"""Decode-step GEMMs: cuBLAS (torch's F.linear) against a plain Triton tile sweep.

Question it answers: P1's decode GEMMs take ~7 µs each (112 a step, ~0.8 ms) where the weight
bytes need ~2-3 µs; is a simple Triton linear kernel with small-M tiles faster inside a CUDA
graph? Shapes: Qwen3-0.6B's and Llama-3-8B's four projections (qkv, o, gate_up, down) at M = 256
(P1's full decode batch), 128 and 32 (its tail). Each config is checked against F.linear first,
then timed by CUDA-graph replays (bench/gpu_timing.py's timer). One JSON row per (shape, M).
This is a prototype to decide whether a GEMM of our own is worth building; the engine uses cuBLAS.
    python bench/gemm_bench.py
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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gemm_bench.py needs a CUDA GPU")
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
