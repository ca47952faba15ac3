"""The fused qkv prologue (q/k norm + rotary + KV store) against its twin and against the unfused
kernels it replaces, on a CUDA GPU: model head layouts, strided qkv views, an fp32-into-bf16 cache,
whole attention layers, and the backend path without host syncs, captured in a CUDA graph.

Skipped without CUDA (tests/gpu/conftest.py). Triton is imported inside the tests only.
``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs the same logic on the CPU interpreter with
tiny lengths and fp16 for bf16 (tests/support/gpu_kernel_cases.py), graph/sync tests skipped.
"""

from __future__ import annotations

import pytest
import torch

from support.gpu_kernel_cases import DEVICE, DRYRUN, HEADS, _attn_tol, _batch, _count, _dtype, _ulp_tol

# ---------------------------------------------------------------- qkv prologue (norm + rope + store)
QKV_SHAPES = {  # name: (tokens, heads, block_size, strided qkv)
    "qwen3-decode256": (256, "qwen3-0.6b", 16, False),
    "qwen3-prefill16k": (16384, "qwen3-0.6b", 16, False),
    "llama3-8b-4096-strided": (4096, "llama3-8b", 32, True),
    "mha-d64-333-strided": (333, "mha-d64", 16, True),
    "g4-d256-77": (77, "g4-d256", 16, False),
    "g3-d128-5-strided": (5, "g3-d128", 32, True),
    "g2-d32-64": (64, "g2-d32", 16, False),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("shape", list(QKV_SHAPES))
def test_qkv_prologue(shape: str, qk_norm: bool, dtype: str) -> None:
    from support.kernel_cases import make_qkv_prologue_case
    from tokenmill.kernels.triton.qkv_prologue import qkv_prologue

    tokens, heads, block_size, strided = QKV_SHAPES[shape]
    num_heads, num_kv_heads, head_dim = HEADS[heads]
    dt = _dtype(dtype)
    case = make_qkv_prologue_case(
        _count(tokens), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=dt, qk_norm=qk_norm, strided=strided, max_position=40960, device=DEVICE, seed=tokens,
    )
    qkv_before, cache = case.qkv.clone(), case.kv_cache.clone()
    out = torch.full((case.qkv.shape[0], num_heads, head_dim), float("nan"), device=DEVICE, dtype=dt)
    case.check(qkv_prologue(*case.args(cache), out=out), cache, qkv_before, **_ulp_tol(dt))


def test_qkv_prologue_fp32_into_bf16_cache() -> None:
    from support.kernel_cases import make_qkv_prologue_case
    from tokenmill.kernels.triton.qkv_prologue import qkv_prologue

    case = make_qkv_prologue_case(
        _count(300), num_heads=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32, qk_norm=True,
        cache_dtype=_dtype("bfloat16"), device=DEVICE, seed=3,
    )
    qkv_before, cache = case.qkv.clone(), case.kv_cache.clone()
    case.check(qkv_prologue(*case.args(cache)), cache, qkv_before, **_ulp_tol(_dtype("bfloat16")))


class _UnfusedTriton:
    """The Triton backend without ``forward_qkv``: layers fall back to separate norm/rope/store kernels."""

    def __init__(self) -> None:
        from tokenmill.attention.triton_backend import TritonAttentionBackend

        self.forward = TritonAttentionBackend().forward


@pytest.mark.parametrize("arch", ["qwen3", "qwen2-bias", "llama"])
@pytest.mark.parametrize("scenario", ["decode256", "mixed"])
def test_layer_fused_matches_unfused(scenario: str, arch: str) -> None:
    """A whole attention layer: the fused prologue against the unfused kernels it replaces (same
    rounding contract, so only fp32 summation order may differ), with the Triton attention after both."""
    from tokenmill.attention.metadata import ForwardContext
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from support.kernel_cases import assert_close_per_head, tiny_attention_layer

    dt = _dtype("bfloat16")
    num_heads, num_kv_heads, head_dim = HEADS["qwen3-0.6b"]
    layer = tiny_attention_layer(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qk_norm=arch == "qwen3",
        qkv_bias=arch == "qwen2-bias", dtype=dt, hidden_size=1024, max_position=40960, device=DEVICE, seed=5,
    )
    batch = _batch(scenario, "qwen3-0.6b", 16, dt, seed=9)
    hidden = torch.randn((batch.slot_mapping.shape[0], 1024), generator=torch.Generator(device=DEVICE).manual_seed(1), device=DEVICE).to(dt)
    results = []
    for backend in (_UnfusedTriton(), TritonAttentionBackend()):
        cache = batch.kv_cache.clone()
        with torch.no_grad():
            out = layer(batch.positions(), hidden, ForwardContext(batch.metadata(), [cache], backend))  # type: ignore[arg-type]
        results.append((out, cache))
    (expected, expected_cache), (got, got_cache) = results
    torch.testing.assert_close(got, expected, **_attn_tol(dt))
    assert_close_per_head(got_cache, expected_cache, "cache", **_ulp_tol(dt))


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
def test_forward_qkv_never_syncs_and_replays_in_a_graph() -> None:
    """The fused backend path under sync-debug 'error', then captured once and replayed on new
    qkv values and positions, with CUDA-graph padding rows (slot -1)."""
    from tokenmill.attention.metadata import QKVPrologue
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels import reference
    from support.kernel_cases import assert_close_per_head, rope_cos_sin_cache

    dt = torch.bfloat16
    batch = _batch("decode256", "qwen3-0.6b", 16, dt, seed=8, num_pad_tokens=5)
    tokens, num_heads, head_dim = batch.q.shape
    num_kv_heads = batch.k.shape[1]
    qkv = torch.cat([batch.q.flatten(1), batch.k.flatten(1), batch.v.flatten(1)], dim=1)
    positions = batch.positions()
    gen = torch.Generator(device="cuda").manual_seed(2)
    weights = [(1 + 0.2 * torch.randn(head_dim, generator=gen, device="cuda")).to(dt) for _ in range(2)]
    prologue = QKVPrologue(num_heads, num_kv_heads, head_dim, rope_cos_sin_cache(40960, head_dim, 1e6, "cuda"), *weights, 1e-6)
    meta, scale, backend = batch.metadata(), head_dim**-0.5, TritonAttentionBackend()
    cache = batch.kv_cache
    backend.forward_qkv(qkv, positions, prologue, cache, meta, scale)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward_qkv(qkv, positions, prologue, cache, meta, scale)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward_qkv(qkv, positions, prologue, cache, meta, scale)
    for trial in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=gen, device="cuda") * 2)
        positions.copy_(torch.randint(0, 40960, positions.shape, generator=gen, device="cuda"))
        expected_cache = cache.clone()
        q_ref = reference.qkv_prologue_ref(qkv, positions, prologue.cos_sin_cache, expected_cache, batch.slot_mapping, num_heads, *weights, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_per_head(cache, expected_cache, f"trial {trial}: cache", **_ulp_tol(dt))
        expected = reference.paged_attention_ref(q_ref, expected_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
        n = batch.num_real_tokens
        torch.testing.assert_close(out[:n].float(), expected[:n].float(), **_attn_tol(dt), msg=lambda m: f"trial {trial}: {m}")
