"""A few launches of a decode GEMM (W4A16 or the swapped fp8 one) on one Llama-3-8B projection,
for a profiler to attach to (gpu_suite parts ``ncu-w4a16`` and ``ncu-fp8`` run Nsight Compute over
the fourth; docs/perf.md 35, 37, 38):
    python bench/decode_gemm_launches.py w4a16|fp8 gate_up 16 [knob=value ...]
Each ``knob=value`` overrides one of the engine's choices (``split_k=4``, ``num_stages=6``, ...)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from script_usage import check_usage  # noqa: E402
from tokenmill.kernels.triton import fp8_gemm, w4a16_gemm  # noqa: E402
from tokenmill.kernels.triton.sm_count import num_sms  # noqa: E402
from tokenmill.quantization.fp8 import quantize_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)


def main() -> None:
    check_usage(__doc__, 3)
    kind, name, m = sys.argv[1], sys.argv[2], int(sys.argv[3])
    n, k = SHAPES[name]
    sms = num_sms(torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if kind == "w4a16":
        packed = torch.randint(-(2**31), 2**31 - 1, (16 * triton.cdiv(k, w4a16_gemm.K_TILE), n), device="cuda", dtype=torch.int32)
        scales = (torch.rand(k // 128, n, device="cuda") * 0.004).to(torch.bfloat16)
        counters = torch.zeros(w4a16_gemm.counters_needed(n), dtype=torch.int32, device="cuda")
        config = w4a16_gemm.choose_config(m, n, k, 128, sms)
        launch = lambda cfg: w4a16_gemm.w4a16_gemm(x, packed, scales, None, 128, None, counters, cfg)  # noqa: E731
    elif kind == "fp8":
        wq, w_scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        xq, x_scale = fp8_gemm.quantize_fp8(x)
        counters = torch.zeros(fp8_gemm.counters_needed(n), dtype=torch.int32, device="cuda")
        config = fp8_gemm.choose_swapped_config(m, n, k, sms)
        launch = lambda cfg: fp8_gemm.fp8_gemm(xq, x_scale, wq, w_scale, None, torch.bfloat16, counters, cfg)  # noqa: E731
    else:
        raise SystemExit(f"kind {kind!r}: w4a16 or fp8")
    for knob in sys.argv[4:]:
        key, value = knob.split("=")
        if key not in config:
            raise SystemExit(f"{key!r} is not one of the {kind} config's knobs: {sorted(config)}")
        config[key] = int(value)
    print(f"{kind} {name} M={m} config {config}", flush=True)
    for _ in range(5):
        launch(dict(config))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
