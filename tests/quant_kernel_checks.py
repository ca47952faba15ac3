"""Cases and checks of the quantized-GEMM kernels (W4A16, fp8 activation quantization, fp8 GEMM)
against their plain-torch twins, run by test_kernels_interpret.py's interpreter workers.

Random inputs of awkward shapes: K not a multiple of 8 (a partly filled last word) or of the group
(a partial last group), N not a multiple of the tile, M from 1 to past the split-K range, forced
K splits that leave splits uneven, fp16 and fp32 activations; outputs poisoned with NaN first.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


_W4A16 = [
    # (m, n, k, group, zeros, bias, forced config)
    (1, 64, 256, 128, False, False, None),
    (7, 72, 200, 64, True, True, None),  # K = 3 groups + 8: partial last group, auto split
    (64, 100, 384, 128, True, False, None),
    (130, 33, 160, 32, False, True, None),  # past the split-K range: the large-M tiles
    (5, 96, 416, -1, True, False, None),  # one group per output channel
    (3, 80, 520, 64, True, True, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1, split_k=3)),
    (33, 64, 1024, 128, False, False, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, split_k=8)),
]
for _dt in ("float32", "float16"):
    for _i, (_m, _n, _k, _g, _z, _b, _cfg) in enumerate(_W4A16):
        _case("w4a16", f"w4a16-m{_m}-n{_n}-k{_k}-g{_g}-{'asym' if _z else 'sym'}-{_dt}", dtype=_dt, m=_m, n=_n, k=_k,
              group=_g, zeros=_z, bias=_b, config=_cfg, seed=_i)
    _case("quantize_fp8", f"quantize-fp8-dynamic-{_dt}", dtype=_dt, m=5, k=300, static=False)
    _case("quantize_fp8", f"quantize-fp8-dynamic-long-rows-{_dt}", dtype=_dt, m=3, k=4100, static=False)
    _case("quantize_fp8", f"quantize-fp8-static-saturating-{_dt}", dtype=_dt, m=4, k=200, static=True)
    for _m, _n, _k in ((1, 70, 300), (20, 128, 128), (130, 72, 260)):
        _case("fp8_gemm", f"fp8-gemm-m{_m}-n{_n}-k{_k}-{_dt}", dtype=_dt, m=_m, n=_n, k=_k, bias=_m == 20)


def _check_w4a16(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import w4a16_linear_ref
    from tokenmill.kernels.triton.w4a16_gemm import w4a16_gemm

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(p["seed"])
    m, n, k, group = p["m"], p["n"], p["k"], p["group"]
    groups = 1 if group == -1 else -(-k // group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (-(-k // 8), n), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (0.02 + 0.1 * torch.rand(groups, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.uint8) if p["zeros"] else None
    bias = torch.randn(n, generator=gen).to(dtype) if p["bias"] else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    counters = torch.zeros(4096, dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    got = w4a16_gemm(x, qweight, scales, zeros, k if group == -1 else group, bias, counters, p["config"], out=out)
    expected = w4a16_linear_ref(x, qweight, scales, zeros, k if group == -1 else group, bias)
    assert got.data_ptr() == out.data_ptr()
    scale = float(expected.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * scale, rtol=tol)
    assert int(counters.abs().sum()) == 0, "split-K counters were not reset"


def _check_quantize_fp8(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import quantize_fp8_ref
    from tokenmill.kernels.testing import patch_triton_interpreter_fp8_rounding
    from tokenmill.kernels.triton.fp8_gemm import quantize_fp8

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(p["m"], p["k"], generator=gen) * 3).to(dtype)
    x[1] = 0  # an all-zero row: the smallest scale, codes 0
    static = torch.tensor([0.004]) if p["static"] else None  # 448 * 0.004 = 1.8: most values saturate
    got_q, got_s = quantize_fp8(x, static)
    want_q, want_s = quantize_fp8_ref(x, static)
    assert torch.equal(got_s, want_s), (got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "codes differ from the twin"


def _check_fp8_gemm(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import fp8_linear_ref
    from tokenmill.kernels.triton.fp8_gemm import fp8_gemm

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(2)
    m, n, k = p["m"], p["n"], p["k"]
    xq = (torch.randn(m, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    x_scale, w_scale = torch.rand(m, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.01
    bias = torch.randn(n, generator=gen).to(dtype) if p["bias"] else None
    got = fp8_gemm(xq, x_scale, wq, w_scale, bias, dtype)
    expected = fp8_linear_ref(xq, x_scale, wq, w_scale, bias, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * float(expected.float().abs().max()), rtol=tol)


CHECKS = {"w4a16": _check_w4a16, "quantize_fp8": _check_quantize_fp8, "fp8_gemm": _check_fp8_gemm}
