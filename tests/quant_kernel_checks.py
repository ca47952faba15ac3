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
    # (m, n, k, group, zeros, bias, forced config); without a config: the engine's choice (operands
    # swapped and K split up to M = 128, in row tiles of at most 64; plain tiles past it).
    (1, 64, 256, 128, False, False, None),
    (7, 72, 200, 64, True, True, None),  # K = 3 groups + 8: partial last group and tile, slice groups
    (64, 100, 384, 128, True, False, None),
    (16, 128, 512, 128, True, True, None),  # whole tiles: the unmasked loads (EVEN_N, EVEN_K)
    (17, 256, 1024, 256, False, False, None),  # a group of two tiles
    (65, 128, 256, 128, True, True, None),  # two 64-row swapped tiles, the second with one row
    (100, 192, 4096, 128, False, True, None),  # two swapped tiles, K split in two (rows ragged)
    (130, 33, 160, 32, False, True, None),  # past the split-K range: the large-M tiles
    (5, 96, 416, -1, True, False, None),  # one group per output channel
    (3, 80, 520, 64, True, True, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1, split_k=3)),
    (33, 64, 1024, 128, False, False, dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=1, split_k=8)),
    (20, 128, 384, 128, True, True, dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=1, split_k=2, SWAP=False)),
    (200, 64, 256, 32, True, False, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, split_k=1, SWAP=True)),
    (120, 64, 1024, 128, True, False, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1, split_k=4)),
    # 256 outputs a program (what a wide weight takes from 32 tokens: choose_config), slice groups,
    # zero points, rows past M in the second tile, K split in two.
    (70, 512, 512, 32, True, True, dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=1, split_k=2)),
    # One 128-row swapped tile on two warpgroups (swept by bench/quant_gemm_bench.py, not the engine's choice).
    (128, 64, 512, 128, True, True, dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1, split_k=2)),
]
_FP8_GEMM = [
    # (m, n, k, forced config); without a config: the engine's choice (operands swapped and K split
    # where runs_swapped says so, plain tiles otherwise).
    (1, 70, 300, None),  # partial weight tile and K step
    (20, 128, 128, None),  # whole tiles: the unmasked loads (EVEN_N, EVEN_K)
    (48, 256, 4096, None),  # K split (the engine's choice: several splits)
    (130, 72, 260, None),  # past SWAPPED_MAX_M on a narrow weight: three 64-row tiles, 6 stages
    (300, 72, 260, None),  # past NARROW_SWAPPED_MAX_M: the plain tiles
    # Two 128-row swapped tiles on two warpgroups, the second with two rows (not the engine's choice;
    # the first H200 rows, 94a97d6, timed it).
    (130, 72, 260, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=1, split_k=2)),
    (3, 80, 520, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, split_k=3)),  # uneven splits
    (40, 200, 1000, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=1, split_k=4)),
]
for _dt in ("float32", "float16"):
    for _i, (_m, _n, _k, _g, _z, _b, _cfg) in enumerate(_W4A16):
        _case("w4a16", f"w4a16-m{_m}-n{_n}-k{_k}-g{_g}-{'asym' if _z else 'sym'}-{_dt}", dtype=_dt, m=_m, n=_n, k=_k,
              group=_g, zeros=_z, bias=_b, config=_cfg, seed=_i)
    _case("quantize_fp8", f"quantize-fp8-dynamic-{_dt}", dtype=_dt, m=5, k=300, static=False)
    _case("quantize_fp8", f"quantize-fp8-dynamic-long-rows-{_dt}", dtype=_dt, m=3, k=4100, static=False)
    # Past ONE_PASS_MAX_K: the row read in blocks, twice (the maximum, then the codes).
    _case("quantize_fp8", f"quantize-fp8-dynamic-two-pass-{_dt}", dtype=_dt, m=2, k=16500, static=False)
    _case("quantize_fp8", f"quantize-fp8-static-two-pass-{_dt}", dtype=_dt, m=2, k=16500, static=True)
    _case("quantize_fp8", f"quantize-fp8-static-saturating-{_dt}", dtype=_dt, m=4, k=200, static=True)
    for _m, _n, _k, _cfg in _FP8_GEMM:
        _case("fp8_gemm", f"fp8-gemm-m{_m}-n{_n}-k{_k}{'-forced' if _cfg else ''}-{_dt}", dtype=_dt, m=_m, n=_n, k=_k,
              bias=_m in (20, 130, 3), config=_cfg)

# The prefill path's dequantize pass (W4A16 weights -> w^T for cuBLAS), against the integers drawn:
# partial last word, tile, group and 128-output block; groups of 32 (several a tile), one group a
# row, symmetric and not.
_W4A16_DEQUANT = [(72, 200, 64, True), (128, 256, 128, False), (96, 416, -1, True), (200, 520, 32, True)]
for _dt in ("float32", "float16"):
    for _i, (_n, _k, _g, _z) in enumerate(_W4A16_DEQUANT):
        _case("w4a16_dequant", f"w4a16-dequant-n{_n}-k{_k}-g{_g}-{'asym' if _z else 'sym'}-{_dt}", dtype=_dt, n=_n, k=_k,
              group=_g, zeros=_z, seed=_i)

# The norms before an fp8 linear that quantize their own output (RMSNorm, add + RMSNorm): rows
# normalised a block at a time (hidden 64: 16 rows a program, 17 rows leave a partial block), odd
# widths (200, 1000); per-token scales (a static input_scale is left to the layer's own quantize_fp8).
for _dt in ("float32", "float16"):
    for _rows, _n in ((5, 96), (17, 64), (7, 200), (3, 1000)):
        for _residual in (False, True):
            _case("fp8_norm", f"fp8-norm-{_rows}x{_n}-{'add' if _residual else 'plain'}-{_dt}", dtype=_dt, rows=_rows, n=_n,
                  residual=_residual)

# The SiLU before down_proj quantizing for it (its blocks' maxima, then a program a block): one block
# (96), a partial one (1000 = 1024 - 24), several with a partial last (2600: three 1024-wide blocks).
for _dt in ("float32", "float16"):
    for _rows, _d in ((5, 96), (3, 1000), (2, 2600)):
        _case("fp8_silu", f"fp8-silu-{_rows}x{_d}-{_dt}", dtype=_dt, rows=_rows, d=_d)

# Whole layers through their linear methods: the kernel path (what runs on a GPU, forced here) against
# the same layer dequantized at load (the CPU path), merged column-parallel and row-parallel with bias.
for _dt in ("float32", "float16"):
    for _scheme in ("gptq-asym-g64", "awq-g32", "fp8-at-load", "fp8-static"):
        _case("quant_layer", f"layer-{_scheme}-{_dt}", dtype=_dt, scheme=_scheme)


# Act-order (g_idx) layers through the kernel path against the weights of the integers and groups
# drawn: gate/up stacked on one g_idx (groups of 64 over K = 256, a permuted plain order: the
# reordered groups stay whole), and each rank of a row-parallel layer split in two (its features'
# groups are uneven: runs padded to 16-feature slices); GPTQ's v1 zero points and CT's symmetric.
for _dt in ("float32", "float16"):
    for _layout in ("gptq", "compressed-tensors"):
        _case("act_order_layer", f"act-order-layer-{_layout}-{_dt}", dtype=_dt, layout=_layout)


def _check_act_order_layer(p: dict[str, Any]) -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tokenmill import quantization
    from tokenmill.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from tokenmill.quantization.config import Int4Scheme

    dtype = getattr(torch, p["dtype"])
    gptq = p["layout"] == "gptq"
    scheme = Int4Scheme(p["layout"], 64, not gptq, gptq_zeros_minus_one=True, act_order=True)
    gen = torch.Generator().manual_seed(17)
    pack = lambda codes, dim: pack_to_int32((codes - 8).to(torch.int8), 4, packed_dim=dim)  # noqa: E731

    def draw(n: int, k: int, g_idx: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        groups = -(-k // 64)
        codes = torch.randint(0, 16, (n, k), generator=gen)
        zeros = torch.randint(1, 17, (n, groups), generator=gen) if gptq else torch.full((n, groups), 8)
        scales = (0.01 + 0.02 * torch.rand(n, groups, generator=gen)).half()
        reference = (codes - zeros[:, g_idx]).float() * scales[:, g_idx].float()  # [N, K]
        if gptq:
            stored = {"qweight": pack(codes.t(), 0), "qzeros": pack(zeros.t() - 1, 1), "scales": scales.t().contiguous(),
                      "g_idx": g_idx.to(torch.int32)}
        else:
            stored = {"weight_packed": pack(codes, 1), "weight_scale": scales, "weight_g_idx": g_idx.to(torch.int32),
                      "weight_shape": torch.tensor([n, k])}
        return stored, reference

    # K = 256: a rank's 128 features (one 128-feature tile) pad to more than one tile.
    k, halves, n_row = 256, [64, 80], 48
    shared = torch.randperm(k, generator=gen) // 64
    merged_parts = [draw(h, k, shared) for h in halves]
    row_tensors, row_reference = draw(n_row, k, torch.randperm(k, generator=gen) // 64)
    quantization.runs_kernels = lambda device: True  # type: ignore[assignment]
    try:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            merged = MergedColumnParallelLinear(k, halves, quant_method=_method(scheme))
            rows = [RowParallelLinear(k, n_row, tp_rank=r, tp_size=2, reduce_results=False, quant_method=_method(scheme))
                    for r in (0, 1)]
        finally:
            torch.set_default_dtype(previous)
        params = dict(merged.named_parameters())
        for shard, (stored, _) in enumerate(merged_parts):
            for name, tensor in stored.items():
                merged.weight_loader(params[name], tensor, shard)
        for row in rows:
            row_params = dict(row.named_parameters())
            for name, tensor in row_tensors.items():
                row.weight_loader(row_params[name], tensor)
        for layer in (merged, *rows):
            layer.quant_method.process_weights_after_loading(layer)
        assert merged.input_order is not None and not merged.quant_method.pads_input
        assert all(row.quant_method.pads_input and len(row.input_order) > 128 for row in rows)  # uneven runs, padded
        tol = 1e-4 if dtype == torch.float32 else 3e-3
        for tokens in (5, 260):  # the register-dequant GEMM; past DEQUANT_MIN_M, dequantize then matmul
            x = torch.randn(tokens, k, generator=gen)
            want = x @ torch.cat([reference for _, reference in merged_parts]).t()
            got = merged(x.to(dtype)).float()
            torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)
            want = x @ row_reference.t()
            got = sum(row(x[:, r * 128 : (r + 1) * 128].to(dtype).contiguous()).float() for r, row in enumerate(rows))
            torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=tol)
    finally:
        quantization.runs_kernels = lambda device: device.type == "cuda"  # type: ignore[assignment]


def _check_quant_layer(p: dict[str, Any]) -> None:
    import torch

    from tokenmill import quantization
    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill.quantization.config import Fp8Scheme, Int4Scheme

    from tokenmill.kernels.triton.fp8_gemm import quantize_fp8
    from tokenmill.quantization.fp8 import QuantizedActivation, takes_quantized_input

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    schemes = {"gptq-asym-g64": Int4Scheme("gptq", 64, False, True), "awq-g32": Int4Scheme("awq", 32, False),
               "fp8-at-load": Fp8Scheme("channel", "dynamic", quantize_at_load=True), "fp8-static": Fp8Scheme("tensor", "static")}
    scheme = schemes[p["scheme"]]
    gen = torch.Generator().manual_seed(7)
    k, halves, n_row = 192, [64, 64], 48

    def tensors(rows: int, cols: int) -> dict[str, torch.Tensor]:
        if isinstance(scheme, Fp8Scheme):
            w = torch.randn(rows, cols, generator=gen) * 0.1
            if scheme.quantize_at_load:
                return {"weight": w}
            scale = float(torch.rand(1, generator=gen)) * 0.002 + 0.0005  # a different scale per shard
            return {"weight": (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), "weight_scale": torch.tensor([scale]),
                    "input_scale": torch.tensor([0.01])}
        g = scheme.group_size
        bits = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)  # noqa: E731
        out = {"qzeros": bits(cols // g, rows // 8), "scales": (0.01 + 0.02 * torch.rand(cols // g, rows, generator=gen)).half()}
        if scheme.layout == "gptq":
            out.update(qweight=bits(cols // 8, rows), g_idx=(torch.arange(cols) // g).to(torch.int32))
        else:
            out["qweight"] = bits(cols, rows // 8)
        return out

    merged_parts = [tensors(h, k) for h in halves]
    row_part = tensors(n_row, sum(halves) // 2)
    bias = torch.randn(n_row, generator=gen)
    outputs = []
    for kernels in (False, True):
        quantization.runs_kernels = lambda device, kernels=kernels: kernels  # type: ignore[assignment]
        merged, row = loaded_layers(k, halves, sum(halves) // 2, n_row, lambda: _method(scheme), merged_parts, row_part,
                                    bias, dtype)
        # 5 tokens: the register-dequant GEMM; 260 (W4A16 past DEQUANT_MIN_M): dequantize, then matmul.
        step = []
        for tokens in (5, 260):
            x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(8)).to(dtype)
            hidden = merged(x)
            if kernels and isinstance(scheme, Fp8Scheme) and scheme.activations == "dynamic":
                # The input quantized by the kernel before (a norm fused with the quantization) gives the same
                # bits as the layer quantizing it itself.
                assert takes_quantized_input(merged)
                assert torch.equal(merged(QuantizedActivation(*quantize_fp8(x))), hidden)
            else:  # 4-bit, fp8 dequantized at load, or a static input_scale: model-dtype input
                assert not takes_quantized_input(merged)
            step += [hidden, row(hidden[:, : sum(halves) // 2].contiguous())]
        outputs.append(step)
    quantization.runs_kernels = lambda device: device.type == "cuda"  # type: ignore[assignment]
    tol = 1e-4 if dtype == torch.float32 else 3e-3
    for got, want in zip(outputs[1], outputs[0]):
        if isinstance(scheme, Fp8Scheme):  # the kernel path also rounds activations to fp8 (3 mantissa bits)
            torch.testing.assert_close(got.float(), want.float(), atol=0.1 * float(want.abs().max()), rtol=0.1)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=tol * float(want.abs().max()), rtol=tol)


def loaded_layers(k: int, shards: list[int], row_in: int, n_row: int, method: Any, merged_parts: list[dict],
                  row_part: dict, bias: Any, dtype: Any) -> tuple[Any, Any]:
    """A merged column-parallel layer (``shards`` outputs of ``k`` features) and a row-parallel one
    (``row_in`` -> ``n_row``, with ``bias``), each with its own ``method()`` and made in ``dtype``, loaded
    from checkpoint tensors (``merged_parts``: one dict a shard; ``row_part``) and processed."""
    import torch

    from tokenmill.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        merged = MergedColumnParallelLinear(k, shards, quant_method=method())
        row = RowParallelLinear(row_in, n_row, bias=True, quant_method=method())
    finally:
        torch.set_default_dtype(previous)
    params = dict(merged.named_parameters())
    for shard, part in enumerate(merged_parts):
        for name, tensor in part.items():
            merged.weight_loader(params[name], tensor, shard)
    row_params = dict(row.named_parameters())
    for name, tensor in row_part.items():
        row.weight_loader(row_params[name], tensor)
    row.bias.data.copy_(bias)
    for layer in (merged, row):
        layer.quant_method.process_weights_after_loading(layer)
    return merged, row


def _method(scheme: Any) -> Any:
    from tokenmill.quantization.config import Fp8Scheme, Int4Scheme, QuantizationConfig
    from tokenmill.quantization import linear_method

    assert isinstance(scheme, (Fp8Scheme, Int4Scheme))
    return linear_method(QuantizationConfig("test", ((("Linear",), scheme),)), ["layer"])


def _check_w4a16(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import w4a16_linear_ref
    from tokenmill.kernels.triton.w4a16_gemm import pack_for_kernel, w4a16_gemm

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
    packed = pack_for_kernel(qweight, k)
    got = w4a16_gemm(x, packed, scales, zeros, k if group == -1 else group, bias, counters, p["config"], out=out)
    expected = w4a16_linear_ref(x, qweight, scales, zeros, k if group == -1 else group, bias)
    assert got.data_ptr() == out.data_ptr()
    scale = float(expected.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), expected.float(), atol=tol * scale, rtol=tol)
    assert int(counters.abs().sum()) == 0, "split-K counters were not reset"


def _check_w4a16_dequant(p: dict[str, Any]) -> None:
    """Codes, zero points and scales drawn as integers and floats; the reference weight is
    ``(code - zero) * scale`` of those in fp32, rounded once; the codes are packed along K by
    compressed-tensors' ``pack_to_int32`` (GPTQ's orientation, our ``Int4Weights.qweight``)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from tokenmill.kernels.triton.w4a16_gemm import dequantize_weight, pack_for_kernel

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(p["seed"])
    n, k = p["n"], p["k"]
    group = k if p["group"] == -1 else p["group"]
    groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (groups, n), generator=gen).to(torch.uint8) if p["zeros"] else None
    scales = (0.02 + 0.1 * torch.rand(groups, n, generator=gen)).to(dtype)
    feature_group = torch.arange(k) // group
    z = 8 if zeros is None else zeros.t()[:, feature_group].to(torch.int64)
    expected = ((codes - z).float() * scales.t()[:, feature_group].float()).to(dtype).t()  # w^T [K, N]
    qweight = pack_to_int32((codes - 8).to(torch.int8), 4, packed_dim=1).t()  # [ceil(K / 8), N]
    out = torch.full((k, n), float("nan"), dtype=dtype)
    got = dequantize_weight(pack_for_kernel(qweight, k), scales, zeros, group, k, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, expected), f"{int((got != expected).sum())} of {got.numel()} weights differ"


def _check_quantize_fp8(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import quantize_fp8_ref
    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
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
    from tokenmill.kernels.triton.fp8_gemm import counters_needed, fp8_gemm

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(2)
    m, n, k = p["m"], p["n"], p["k"]
    xq = (torch.randn(m, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    wq = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    x_scale, w_scale = torch.rand(m, generator=gen) * 0.01, torch.rand(n, generator=gen) * 0.01
    bias = torch.randn(n, generator=gen).to(dtype) if p["bias"] else None
    counters = torch.zeros(counters_needed(n), dtype=torch.int32)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    expected = fp8_linear_ref(xq, x_scale, wq, w_scale, bias, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for call in range(2):  # twice: the split-K counters must be left at zero for the next launch
        got = fp8_gemm(xq, x_scale, wq, w_scale, bias, dtype, counters, config=p["config"], out=out)
        assert got is out
        torch.testing.assert_close(got.float(), expected.float(), atol=tol * float(expected.float().abs().max()), rtol=tol)
        assert not bool(counters.any()), f"call {call}: split-K counters left nonzero"
        out.fill_(float("nan"))


def _poisoned_fp8(rows: int, cols: int) -> tuple[Any, Any]:
    import torch

    codes = torch.full((rows, cols), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # e4m3fn NaN
    return codes, torch.full((rows,), float("nan"))


def _assert_fp8_matches(got: tuple[Any, Any], unfused: tuple[Any, Any], twin: tuple[Any, Any]) -> None:
    """Bit for bit what the unfused kernels give (the model-dtype value stored, then quantize_fp8), and
    within fp8 rounding of the plain-torch twin: same scales to fp32 rounding, and each code at most
    one e4m3 step from the twin's (the interpreter's rsqrt and the twin's may differ by an ulp, which
    can move a value across a rounding boundary)."""
    import torch

    (codes, scales), (unfused_codes, unfused_scales), (twin_codes, twin_scales) = got, unfused, twin
    assert torch.equal(scales, unfused_scales), (scales, unfused_scales)
    assert torch.equal(codes.view(torch.uint8), unfused_codes.view(torch.uint8)), "codes differ from the unfused kernels'"
    torch.testing.assert_close(scales, twin_scales, atol=0, rtol=2e-6)
    step = (codes.float() - twin_codes.float()).abs()
    ulp = torch.maximum(twin_codes.float().abs(), codes.float().abs()).clamp(min=2.0**-6) * 2.0**-3  # e4m3: 3 mantissa bits
    assert bool((step <= ulp).all()), f"codes more than one step from the twin's: {float(step.max())}"
    assert float((step > 0).float().mean()) < 0.02, "too many codes differ from the twin's"


def _check_fp8_norm(p: dict[str, Any]) -> None:
    import torch

    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill.kernels import reference
    from tokenmill.kernels.triton.fp8_gemm import quantize_fp8
    from tokenmill.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(p["rows"] * p["n"])
    rows, n = p["rows"], p["n"]
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    x[1] = 0  # a zero row (without a residual): the smallest scale, codes 0
    weight = (1.0 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    residual = torch.randn(rows, n, generator=gen).to(dtype) if p["residual"] else None
    out = _poisoned_fp8(rows, n)
    res_out = torch.full_like(x, float("nan")) if residual is not None else None
    codes, scales, summed = rms_norm_fp8(x, weight, 1e-5, residual=residual, residual_out=res_out, out=out)
    assert codes is out[0] and scales is out[1] and summed is res_out
    if residual is None:
        normed, twin_normed = rms_norm(x, weight, 1e-5), reference.rms_norm_ref(x, weight, 1e-5)
    else:
        normed, unfused_sum = fused_add_rms_norm(x, residual, weight, 1e-5)
        twin_normed, twin_sum = reference.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
        assert torch.equal(summed, unfused_sum) and torch.equal(summed, twin_sum), "the residual sum changed"
    _assert_fp8_matches((codes, scales), quantize_fp8(normed), reference.quantize_fp8_ref(twin_normed))


def _check_fp8_silu(p: dict[str, Any]) -> None:
    """silu_and_mul_fp8 against silu_and_mul then quantize_fp8, bit for bit (a row's maximum is the
    maximum of its blocks'), and within fp8 rounding of the twins; quantize_fp8_blocks alone into
    poisoned outputs, from maxima taken by torch."""
    import torch

    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill.kernels import reference
    from tokenmill.kernels.triton.activation import silu_and_mul, silu_and_mul_fp8
    from tokenmill.kernels.triton.fp8_gemm import quantize_fp8, quantize_fp8_blocks

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    rows, d = p["rows"], p["d"]
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(rows * d)) * 3).to(dtype)
    x[1] = 0  # a zero row: the smallest scale, codes 0
    got = silu_and_mul_fp8(x)
    activated = silu_and_mul(x)
    _assert_fp8_matches(got, quantize_fp8(activated), reference.quantize_fp8_ref(reference.silu_and_mul_ref(x)))
    block = 256
    amax = torch.stack([activated[:, i:i + block].float().abs().amax(dim=1) for i in range(0, d, block)], dim=1)
    out = _poisoned_fp8(rows, d)
    codes, scales = quantize_fp8_blocks(activated, amax.contiguous(), block, out=out)
    assert codes is out[0] and scales is out[1]
    _assert_fp8_matches((codes, scales), quantize_fp8(activated), reference.quantize_fp8_ref(activated))


CHECKS = {"fp8_norm": _check_fp8_norm, "fp8_silu": _check_fp8_silu, "w4a16": _check_w4a16, "w4a16_dequant": _check_w4a16_dequant,
          "quantize_fp8": _check_quantize_fp8, "fp8_gemm": _check_fp8_gemm,
          "quant_layer": _check_quant_layer, "act_order_layer": _check_act_order_layer}
