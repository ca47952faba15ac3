"""Cases and checks of the block-wise fp8 kernels (activations quantized per token and 128-group,
the block-scaled W8A8 GEMM) and their linear method, against the plain-torch twins, run by
test_kernels_interpret.py's interpreter workers.

Random inputs: M = 1, odd M, M past the swapped range (plain tiles); K and N not multiples of 128
(partial last blocks, which HF's format allows: its block grid is cdiv); forced configs with K
split unevenly, BLOCK_K of half a group and narrow weight tiles; fp16 and fp32 outputs; outputs
poisoned with NaN first.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


_GEMM = [
    # (m, n, k, bias, forced config); without a config: the engine's choice
    (1, 70, 300, True, None),  # swapped, partial weight tile, block row and K group
    (7, 200, 384, False, None),  # odd M, N across a partial second block row
    (48, 256, 2048, True, None),  # K split by the engine's choice
    (130, 72, 260, False, None),  # past SWAPPED_MAX_M on a narrow weight: three 64-row swapped tiles
    (300, 200, 260, True, None),  # past NARROW_SWAPPED_MAX_M: the plain tiles, rows, columns and K partial
    (3, 80, 520, True, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1, split_k=3)),  # uneven splits
    (33, 256, 640, False, dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, split_k=2)),
]
for _dt in ("float32", "float16"):
    for _m, _k in ((5, 300), (1, 128), (4, 1000)):
        _case("quantize_fp8_groups", f"block-fp8-quantize-m{_m}-k{_k}-{_dt}", dtype=_dt, m=_m, k=_k)
    for _i, (_m, _n, _k, _bias, _cfg) in enumerate(_GEMM):
        _case("block_fp8_gemm", f"block-fp8-gemm-m{_m}-n{_n}-k{_k}{'-forced' if _cfg else ''}-{_dt}", dtype=_dt, m=_m,
              n=_n, k=_k, bias=_bias, config=_cfg, seed=_i)
    _case("block_fp8_layer", f"block-fp8-layer-{_dt}", dtype=_dt)


def _check_quantize_fp8_groups(p: dict[str, Any]) -> None:
    import torch

    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill.kernels.reference import quantize_fp8_groups_ref
    from tokenmill.kernels.triton.block_fp8_gemm import quantize_fp8_groups

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    x = (torch.randn(p["m"], p["k"], generator=torch.Generator().manual_seed(p["k"])) * 3).to(dtype)
    x[0, :128] = 0  # an all-zero group: the smallest scale, codes 0
    if p["m"] > 1:
        x[1, -1] = 2000.0  # one large value in the last (partial) group: its scale alone grows
    got_q, got_s = quantize_fp8_groups(x)
    want_q, want_s = quantize_fp8_groups_ref(x)
    assert got_s.shape == (p["m"], -(-p["k"] // 128))
    assert torch.equal(got_s, want_s), (got_s, want_s)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "codes differ from the twin"


def _check_block_fp8_gemm(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import block_fp8_linear_ref
    from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm
    from tokenmill.kernels.triton.fp8_gemm import counters_needed

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(p["seed"])
    m, n, k = p["m"], p["n"], p["k"]
    groups = -(-k // 128)
    xq = (torch.randn(m, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    # Scales that differ by orders of magnitude between blocks: a scale applied to the wrong block shows.
    x_scale = torch.rand(m, groups, generator=gen) * 10.0 ** torch.randint(-4, -1, (m, groups), generator=gen)
    w_scale = torch.rand(-(-n // 128), groups, generator=gen) * 10.0 ** torch.randint(-4, -1, (-(-n // 128), groups), generator=gen)
    bias = torch.randn(n, generator=gen).to(dtype) if p["bias"] else None
    counters = torch.zeros(counters_needed(n), dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    expected = block_fp8_linear_ref(xq, x_scale, wq, w_scale, bias, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for call in range(2):  # twice: the split-K counters must be left at zero for the next launch
        got = block_fp8_gemm(xq, x_scale, wq, w_scale, bias, dtype, counters, config=p["config"], out=out)
        assert got is out
        torch.testing.assert_close(got.float(), expected.float(), atol=tol * float(expected.float().abs().max()), rtol=tol)
        assert not bool(counters.any()), f"call {call}: split-K counters left nonzero"
        out.fill_(float("nan"))


def _check_block_fp8_layer(p: dict[str, Any]) -> None:
    """A merged column-parallel layer (two shards of 128 and 200 rows: the second's block row
    partial; K 300) and a row-parallel one with bias, through BlockFp8LinearMethod: the kernel path
    (forced on the CPU) against the twins on the loaded codes and scales, and against the same layer
    dequantized at load (the CPU path) within fp8 activation rounding."""
    import torch

    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill import quantization
    from tokenmill.kernels.reference import block_fp8_linear_ref, quantize_fp8_groups_ref
    from quant_kernel_checks import loaded_layers
    from tokenmill.quantization.config import Fp8Scheme, QuantizationConfig

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(11)
    scheme = Fp8Scheme("block", "dynamic", block_scale_name="weight_scale_inv")
    config = QuantizationConfig("fp8", ((("Linear",), scheme),))
    k, shards, n_row = 300, [128, 200], 72

    def tensors(rows: int, cols: int) -> dict[str, torch.Tensor]:
        codes = (torch.randn(rows, cols, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = 1e-4 + 1e-3 * torch.rand(-(-rows // 128), -(-cols // 128), generator=gen)
        return {"weight": codes, "weight_scale_inv": scales}

    merged_parts, row_part = [tensors(s, k) for s in shards], tensors(n_row, sum(shards))
    bias = torch.randn(n_row, generator=gen)
    x = torch.randn(5, k, generator=gen).to(dtype)
    outputs = []
    for kernels in (False, True):
        quantization.runs_kernels = lambda device, kernels=kernels: kernels  # type: ignore[assignment]
        merged, row = loaded_layers(k, shards, sum(shards), n_row, lambda: quantization.linear_method(config, ["layer"]),
                                    merged_parts, row_part, bias, dtype)
        hidden = merged(x)
        y = row(hidden)
        if kernels:  # the twins on the checkpoint's codes, the scales stacked as the layer must stack them
            w = torch.cat([part["weight"] for part in merged_parts])
            w_scale = torch.cat([part["weight_scale_inv"] for part in merged_parts])
            want_hidden = block_fp8_linear_ref(*quantize_fp8_groups_ref(x), w, w_scale, None, dtype)
            torch.testing.assert_close(hidden, want_hidden, atol=1e-3 * float(want_hidden.abs().max()), rtol=1e-3)
            want_y = block_fp8_linear_ref(*quantize_fp8_groups_ref(hidden), row_part["weight"], row_part["weight_scale_inv"],
                                          bias.to(dtype), dtype)
            torch.testing.assert_close(y, want_y, atol=1e-3 * float(want_y.abs().max()), rtol=1e-3)
        outputs.append((hidden, y))
    quantization.runs_kernels = lambda device: device.type == "cuda"  # type: ignore[assignment]
    for got, want in zip(outputs[1], outputs[0]):  # the kernel path also rounds activations to fp8
        torch.testing.assert_close(got.float(), want.float(), atol=0.1 * float(want.abs().max()), rtol=0.1)


CHECKS = {"quantize_fp8_groups": _check_quantize_fp8_groups, "block_fp8_gemm": _check_block_fp8_gemm,
          "block_fp8_layer": _check_block_fp8_layer}
