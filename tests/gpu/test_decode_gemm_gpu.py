"""The 16-bit decode GEMM on a CUDA GPU (``kernels/triton/decode_gemm.py``): against an fp32 product
over Qwen3-0.6B's and Llama-3-8B's projections and odd shapes at every size class up to 256 tokens
(poisoned outputs, counters left at zero), under CUDA-graph replays, and through a linear layer,
which takes it for decode sizes and cuBLAS past them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # Qwen3-0.6B: qkv, o, gate_up, down
          (6144, 4096), (4096, 14336),  # Llama-3-8B: qkv, down
          (1000, 4000), (72, 200), (4104, 1032)]  # N not a tile multiple, K not a K-step multiple
M_VALUES = [1, 2, 3, 8, 16, 17, 32, 33, 63, 64, 65, 96, 128, 129, 200, 256]


def _want(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.float() @ w.float().t() + (bias.float() if bias is not None else 0.0)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gemm_matches_fp32_product(n, k, dtype):
    from tokenmill.kernels.triton.decode_gemm import counters_needed, decode_gemm

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if n % 2 == 0 else None
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    for m in M_VALUES:
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        got = decode_gemm(x, w, bias, counters, out=out)
        want = _want(x, w, bias)
        torch.testing.assert_close(got.float(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2, msg=f"M={m}")
        assert int(counters.abs().sum()) == 0, f"M={m}: split-K counters not reset"


def test_decode_gemm_replays_in_a_cuda_graph():
    from tokenmill.kernels.triton.decode_gemm import choose_config, counters_needed, decode_gemm

    n, k, m = 1024, 3072, 200
    assert choose_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)["split_k"] > 1
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    counters = torch.zeros(counters_needed(n), dtype=torch.int32, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    decode_gemm(x, w, None, counters)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = decode_gemm(x, w, None, counters)
    for _ in range(3):
        x.normal_()
        graph.replay()
        want = _want(x, w, None)
        torch.testing.assert_close(y.float(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2)
    assert int(counters.abs().sum()) == 0


def test_linear_layer_takes_the_decode_gemm_at_decode_sizes(monkeypatch):
    from tokenmill.kernels.triton import decode_gemm as kernels
    from tokenmill.models.layers.linear import RowParallelLinear

    with torch.device("cuda"):
        layer = RowParallelLinear(2048, 1024, bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.quant_method.takes_decode_gemm(layer)
    calls = []
    real = kernels.decode_gemm
    monkeypatch.setattr(kernels, "decode_gemm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for m in (1, 48, 256, 257, 2048):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        got = layer(x)
        want = _want(x, layer.weight, None)
        torch.testing.assert_close(got.float(), want, atol=1e-2 * float(want.abs().max()), rtol=1e-2, msg=f"M={m}")
    assert calls == [1, 48, 256], calls  # past 256 rows (and on wide weights past 64) cuBLAS
