"""The per-token kernels against their plain-torch twins on a CUDA GPU, in bf16/fp16 (and fp32), at
real sizes: the KV store (into bf16, fp16 and fp8 caches), RMSNorm (+ residual add, and per head on
a strided qkv view), rotary, SiLU-mul, add + LayerNorm. Every output is poisoned (NaN) before the
kernel runs; inputs are random, never zeros.

The attention kernels and the fused qkv prologue have their own files beside this one
(test_paged_attention_gpu.py, test_varlen_attention_gpu.py, test_qkv_prologue_gpu.py).

Skipped without CUDA (tests/gpu/conftest.py). Triton is imported inside the tests only.
``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs the same logic on the CPU interpreter with
tiny lengths and fp16 for bf16 (tests/support/gpu_kernel_cases.py), graph/sync tests skipped.
"""

from __future__ import annotations

import pytest
import torch

from support.gpu_kernel_cases import DEVICE, DRYRUN, _count, _dtype, _len, _ulp_tol


# ---------------------------------------------------------------- kv store
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "bfloat16"),
                                    ("bfloat16", "float8_e4m3fn"), ("float32", "float8_e4m3fn")], ids=lambda d: f"{d[0]}-into-{d[1]}")
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("tokens", [1, 257, 4096])
def test_kv_store(tokens: int, block_size: int, dtypes: tuple[str, str]) -> None:
    from tokenmill.kernels.reference import store_kv_ref
    from tokenmill.kernels.triton.kv_store import store_kv

    tokens = _len(tokens) if DRYRUN else tokens
    dtype, cache_dtype = _dtype(dtypes[0]), _dtype(dtypes[1])
    if DRYRUN and cache_dtype.itemsize == 1:
        pytest.skip("the interpreter's float8 rounding is not exact")
    heads, dim = 8, 128
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    num_blocks = tokens // block_size + 4
    cache = torch.randn((2, num_blocks, block_size, heads, dim), generator=gen, device=DEVICE).to(cache_dtype)
    # fp8 saturates at +-448: values up to ~1,000 make sure some keys and values go past it.
    spread = 250.0 if cache_dtype.itemsize == 1 else 1.0
    qkv = (torch.randn((tokens, 32 * dim), generator=gen, device=DEVICE) * spread).to(dtype)
    k = qkv[:, 16 * dim : 24 * dim].view(tokens, heads, dim)
    v = qkv[:, 24 * dim :].view(tokens, heads, dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=DEVICE)[:tokens]
    slots[::7] = -1
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


# ---------------------------------------------------------------- rmsnorm, rope, silu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(4096, 1024), (333, 4096), (64, 5120), (3, 128)])
def test_rms_norm(shape: tuple[int, int], dtype: str) -> None:
    from tokenmill.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref
    from tokenmill.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm

    dt = _dtype(dtype)
    shape = (_count(shape[0]), shape[1])
    gen = torch.Generator(device=DEVICE).manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen, device=DEVICE) * 4).to(dt)
    residual = torch.randn(shape, generator=gen, device=DEVICE).to(dt)
    weight = (1 + 0.2 * torch.randn(shape[1], generator=gen, device=DEVICE)).to(dt)
    out = torch.full_like(x, float("nan"))
    torch.testing.assert_close(rms_norm(x, weight, 1e-6, out=out), rms_norm_ref(x, weight, 1e-6), **_ulp_tol(dt))
    exp_out, exp_res = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    got_out, got_res = fused_add_rms_norm(x, residual, weight, 1e-6, out=torch.full_like(x, float("nan")), residual_out=residual)
    assert got_res is residual
    torch.testing.assert_close(got_res, exp_res, atol=0, rtol=0)
    torch.testing.assert_close(got_out, exp_out, **_ulp_tol(dt))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_head_rms_norm_on_qkv_view(dtype: str) -> None:
    """Qwen3's per-head q/k norm straight on the strided q view of a fused qkv output."""
    from tokenmill.kernels.reference import rms_norm_ref
    from tokenmill.kernels.triton.rmsnorm import rms_norm

    dt = _dtype(dtype)
    tokens = _count(4096)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    qkv = (torch.randn((tokens, 32 * 128), generator=gen, device=DEVICE) * 3).to(dt)
    q = qkv[:, : 16 * 128].view(tokens, 16, 128)
    weight = (1 + 0.2 * torch.randn(128, generator=gen, device=DEVICE)).to(dt)
    torch.testing.assert_close(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6), **_ulp_tol(dt))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(4096, 16, 8, 128, 128), (1000, 32, 8, 128, 128), (77, 8, 2, 128, 64), (5, 4, 4, 64, 64)],
                         ids=["qwen3", "llama3-8b", "partial-rotary", "tiny"])
def test_rotary(shape: tuple[int, int, int, int, int], dtype: str) -> None:
    from tokenmill.kernels.reference import rotary_embedding_ref_
    from support.kernel_cases import rope_cos_sin_cache
    from tokenmill.kernels.triton.rotary import rotary_embedding_

    tokens, hq, hk, dim, rot = shape
    tokens = _count(tokens)
    dt = _dtype(dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    cache = rope_cos_sin_cache(40960, rot, base=1e6, device=DEVICE)
    positions = torch.randint(0, 40960, (tokens,), generator=gen, device=DEVICE)
    qkv = torch.randn((tokens, (hq + 2 * hk) * dim), generator=gen, device=DEVICE).to(dt)
    expected = qkv.clone()
    for buf, fn in ((expected, rotary_embedding_ref_), (qkv, rotary_embedding_)):
        fn(positions, buf[:, : hq * dim].view(tokens, hq, dim), buf[:, hq * dim : (hq + hk) * dim].view(tokens, hk, dim), cache)
    torch.testing.assert_close(qkv, expected, **_ulp_tol(dt))
    assert torch.equal(qkv[:, (hq + hk) * dim :], expected[:, (hq + hk) * dim :]), "v was touched"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(4096, 2 * 3072), (7, 2 * 14336), (1, 2 * 96)])
def test_silu_and_mul(shape: tuple[int, int], dtype: str) -> None:
    from tokenmill.kernels.reference import silu_and_mul_ref
    from tokenmill.kernels.triton.activation import silu_and_mul

    dt = _dtype(dtype)
    x = (torch.randn((_count(shape[0]), shape[1]), generator=torch.Generator(device=DEVICE).manual_seed(2), device=DEVICE) * 3).to(dt)
    out = torch.full((x.shape[0], x.shape[1] // 2), float("nan"), device=DEVICE, dtype=dt)
    torch.testing.assert_close(silu_and_mul(x, out=out), silu_and_mul_ref(x), **_ulp_tol(dt))


# ---------------------------------------------------------------- add + LayerNorm (BERT's post-norm)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("shape", [(65536, 384), (333, 768), (5, 1024), (1, 96)])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_add_layer_norm(shape: tuple[int, int], dtype: str, residual: bool) -> None:
    from tokenmill.kernels.reference import add_layer_norm_ref
    from tokenmill.kernels.triton.layernorm import add_layer_norm

    dt = _dtype(dtype)
    shape = (_count(shape[0]), shape[1])
    gen = torch.Generator(device=DEVICE).manual_seed(shape[0])
    x = (torch.randn(shape, generator=gen, device=DEVICE) * 4 + 2).to(dt)
    res = torch.randn(shape, generator=gen, device=DEVICE).to(dt) if residual else None
    weight = (1 + 0.2 * torch.randn(shape[1], generator=gen, device=DEVICE)).to(dt)
    bias = (0.3 * torch.randn(shape[1], generator=gen, device=DEVICE)).to(dt)
    out = torch.full_like(x, float("nan"))
    got = add_layer_norm(x, res, weight, bias, 1e-12, out=out)
    torch.testing.assert_close(got, add_layer_norm_ref(x, res, weight, bias, 1e-12), **_ulp_tol(dt))
