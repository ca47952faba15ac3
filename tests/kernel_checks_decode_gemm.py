"""The 16-bit decode GEMM (``kernels/triton/decode_gemm.py``: the swapped split-K kernel on bf16/fp16
operands) against an fp64 product, run by test_kernels_interpret.py's interpreter workers.

Awkward shapes: K not a multiple of the 64-feature step, N not a multiple of the 128-row weight
tile, M from 1 past the always-swapped range, the engine's own split choices and forced uneven
ones; outputs poisoned with NaN, every call made twice (the split-K counters must be left at zero).
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}

_DECODE_GEMM = [
    # (m, n, k, bias, forced config); without a config: the engine's choice (choose_config).
    (1, 70, 300, False, None),  # partial weight tile and K step, one 16-row tile
    (20, 128, 128, True, None),  # whole tiles: the unmasked loads (EVEN_N, EVEN_K)
    (48, 256, 1024, False, None),  # K split in several runs
    (100, 72, 260, True, None),  # past ALWAYS_MAX_M on a narrow weight: two 64-row tiles, 6 stages
    (3, 80, 520, True, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2, split_k=3)),  # uneven runs
    (130, 200, 640, False, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=2, split_k=4)),
]
for _m, _n, _k, _b, _cfg in _DECODE_GEMM:
    CASES[f"decode-gemm-m{_m}-n{_n}-k{_k}{'-forced' if _cfg else ''}-float16"] = (
        "decode_gemm", dict(m=_m, n=_n, k=_k, bias=_b, config=_cfg))


def _check_decode_gemm(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.triton.decode_gemm import counters_needed, decode_gemm

    gen = torch.Generator().manual_seed(p["m"] * 1000 + p["n"])
    m, n, k = p["m"], p["n"], p["k"]
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(n, k, generator=gen) * 0.05).half()
    bias = torch.randn(n, generator=gen).half() if p["bias"] else None
    want = x.double() @ w.double().t() + (bias.double() if bias is not None else 0.0)
    counters = torch.zeros(counters_needed(n), dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    for call in range(2):
        got = decode_gemm(x, w, bias, counters, config=p["config"], out=out)
        assert got is out
        torch.testing.assert_close(got.double(), want, atol=2e-3 * float(want.abs().max()), rtol=2e-3)
        assert not bool(counters.any()), f"call {call}: split-K counters left nonzero"
        out.fill_(float("nan"))


CHECKS = {"decode_gemm": _check_decode_gemm}
