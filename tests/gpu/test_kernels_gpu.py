"""Triton kernels against their plain-torch twins on a CUDA GPU, in bf16/fp16 (and fp32), at real sizes.

The same checks as tests/test_kernels_interpret.py with far more shapes: 64-256 sequences,
contexts to 32K, Qwen3-0.6B / Llama-3-8B head layouts and odd ones, forced and automatic
split-KV, every launch-shape knob, >2**31-element caches (64-bit offsets), CUDA-graph capture
and replay of decode with changing lengths and padding, and a no-host-sync check of the backend.
Every output is poisoned (NaN) before the kernel runs; inputs are random, never zeros.

Skipped without CUDA (tests/gpu/conftest.py). Triton is imported inside the tests only.
``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs the same logic on the CPU interpreter with
tiny lengths and fp16 for bf16, to check this file itself without a GPU (graph/sync tests skip).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

DRYRUN = os.environ.get("TOKENMILL_KERNEL_DRYRUN") == "1"
DEVICE = "cpu" if DRYRUN else "cuda"

HEADS = {  # name: (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "llama3-8b": (32, 8, 128),
    "mha-d64": (8, 8, 64),
    "g8-d64": (32, 4, 64),
    "g4-d256": (16, 4, 256),
    "g3-d128": (12, 4, 128),
    "g2-d32": (8, 4, 32),
}
SCENARIOS = ("decode64", "decode256", "decode1024", "mixed", "prefill_long", "few_long_decode")


def _dtype(name: str) -> torch.dtype:
    if DRYRUN and name == "bfloat16":
        return torch.float16  # the interpreter's bf16 is not trustworthy
    return getattr(torch, name)


def _len(n: int) -> int:
    """A context/query length, shrunk ~50x in a dry run."""
    return max(1, n // 50) if DRYRUN else n


def _count(n: int) -> int:
    return min(n, 3) if DRYRUN else n


def _attn_tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16 P and V in the second dot (8-bit mantissa) and a bf16 output: ~1e-2 against fp32 math.
    return {
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
        torch.float16: {"atol": 4e-3, "rtol": 4e-3},
        torch.float32: {"atol": 2e-4, "rtol": 2e-4},
    }[dtype]


def _ulp_tol(dtype: torch.dtype) -> dict[str, float]:
    # Elementwise kernels round like their twins; allow two ulps for fp32 rounding-order flips.
    return {
        torch.bfloat16: {"atol": 1e-2, "rtol": 1.6e-2},
        torch.float16: {"atol": 1e-3, "rtol": 2e-3},
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    }[dtype]


def _scenario(name: str, seed: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens) of one step."""
    rng = random.Random(seed)
    q: list[int] = []
    s: list[int] = []

    def add(query_len: int, seq_len: int) -> None:
        q.append(min(query_len, seq_len))
        s.append(seq_len)

    if name == "decode64":
        for _ in range(_count(64)):
            add(1, rng.randint(1, _len(4096)))
    elif name == "decode256":  # P1-like
        for _ in range(_count(256)):
            add(1, rng.randint(_len(100), _len(2048)))
    elif name == "decode1024":  # P2-like width: the sequence search loops over 4 chunks of 256
        for _ in range(_count(1024) if not DRYRUN else 300):
            add(1, rng.randint(1, _len(800)))
    elif name == "mixed":  # what a token-budget scheduler hands over mid-run
        for _ in range(_count(32)):
            add(1, rng.randint(1, _len(3000)))
        for _ in range(_count(4)):  # fresh prompts
            n = rng.randint(1, _len(700))
            add(n, n)
        for _ in range(_count(4)):  # prefix-cache hits: only the tail is new
            ctx = rng.randint(_len(200), _len(3000))
            add(rng.randint(1, _len(300)), ctx)
        for _ in range(_count(2)):  # a later chunk of a long prompt
            add(_len(256), rng.randint(_len(512), _len(2048)))
        add(0, rng.randint(1, _len(500)))  # scheduled nothing this step
    elif name == "prefill_long":
        add(_len(2048), _len(2048))
        add(_len(1024), _len(4096))
        add(1, _len(5000))
    elif name == "p5_mixed":  # a P5 step: running decodes first, then chunks under a 16,384-token budget
        for _ in range(_count(256)):
            add(1, rng.randint(_len(1000), _len(3000)))
        done = rng.randint(_len(100), _len(2000))  # a prompt cut by the previous step continues
        rest = rng.randint(1, _len(1000))
        add(rest, done + rest)
        left = _len(16384) - _count(256) - rest
        while left > 0:  # fresh prompts, the last one cut
            n = min(left, rng.randint(_len(1000), _len(3000)))
            add(n, n)
            left -= n
    elif name == "few_long_decode":  # split-KV territory: few programs, long contexts
        for _ in range(_count(4)):
            add(1, rng.randint(_len(16384), _len(32768)))
    else:
        raise ValueError(name)
    return q, s


def _batch(scenario: str, heads: str, block_size: int, dtype: torch.dtype, seed: int = 0, **kw: Any) -> Any:
    from support.kernel_cases import make_paged_batch

    num_heads, num_kv_heads, head_dim = HEADS[heads]
    query_lens, seq_lens = _scenario(scenario, seed)
    return make_paged_batch(
        query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=dtype, device=DEVICE, seed=seed, **kw,
    )


def _check_attention(batch: Any, config: Any = None, split_decodes: bool = True) -> None:
    """Store with the kernel (== reference store), attend with poisoned output, compare. The leading
    one-token sequences get their own decode launch, as the backend runs them, unless
    ``split_decodes`` is off (the whole step in one launch)."""
    from tokenmill.kernels import reference
    from tokenmill.kernels.triton.kv_store import store_kv
    from tokenmill.kernels.triton.paged_attention import paged_attention

    scale = batch.q.shape[-1] ** -0.5
    cache = batch.kv_cache
    expected_cache = cache.clone()
    reference.store_kv_ref(batch.k, batch.v, expected_cache, batch.slot_mapping)
    store_kv(batch.k, batch.v, cache, batch.slot_mapping)
    assert torch.equal(cache, expected_cache), "kv store differs from reference"
    del expected_cache
    meta = batch.metadata()
    num_decode_seqs = 0
    while split_decodes and num_decode_seqs < len(batch.query_lens_host) and batch.query_lens_host[num_decode_seqs] == 1:
        num_decode_seqs += 1
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_decode_seqs=num_decode_seqs, out=out,
        config=config,
    )
    expected = reference.paged_attention_ref(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    n = batch.num_real_tokens
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), **_attn_tol(batch.q.dtype), msg=lambda m: f"{config}: {m}")
    assert torch.isnan(out[n:]).all(), "rows past the last real token were written"


# ---------------------------------------------------------------- attention: shapes x layouts
@pytest.mark.parametrize("layout", [(16, "bfloat16"), (32, "float16")], ids=["bs16-bf16", "bs32-fp16"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_attention_matches_reference(scenario: str, heads: str, layout: tuple[int, str]) -> None:
    block_size, dtype = layout
    _check_attention(_batch(scenario, heads, block_size, _dtype(dtype), seed=7, num_pad_tokens=3))


FORCED_CONFIGS = [  # (block_q, tile_n, num_splits, num_warps, num_stages)
    (1, 16, 1, 4, 2),
    (1, 32, 1, 4, 3),
    (1, 128, 1, 4, 3),
    (1, 64, 1, 8, 4),
    (1, 64, 2, 4, 3),
    (1, 64, 3, 4, 3),
    (1, 32, 8, 4, 3),
    (1, 64, 64, 4, 3),
    (2, 64, 1, 4, 3),
    (16, 64, 1, 4, 3),
    (16, 32, 5, 4, 3),
    (64, 32, 1, 4, 2),
    (64, 64, 1, 8, 3),
    (128, 64, 2, 8, 3),
]


@pytest.mark.parametrize("cfg", FORCED_CONFIGS, ids=lambda c: "bq{}-n{}-s{}-w{}-st{}".format(*c))
@pytest.mark.parametrize("scenario", ["mixed", "decode64", "few_long_decode"])
def test_attention_forced_configs(scenario: str, cfg: tuple[int, int, int, int, int]) -> None:
    """Every launch-shape knob gives the same answer (including many and empty splits)."""
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    if DRYRUN and cfg[2] > 8:
        pytest.skip("too slow for the interpreter")
    config = AttentionLaunchConfig(block_q=cfg[0], tile_n=cfg[1], num_splits=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
    _check_attention(_batch(scenario, "qwen3-0.6b", 16, _dtype("bfloat16"), seed=3, num_pad_tokens=1), config)


@pytest.mark.parametrize("heads", ["qwen3-0.6b", "llama3-8b", "g4-d256"])
@pytest.mark.parametrize("split_decodes", [True, False], ids=["split", "one-launch"])
def test_attention_p5_mixed_step(split_decodes: bool, heads: str) -> None:
    """A long-prompt step: 256 decodes in front of prefill chunks (a continued prompt, fresh ones),
    the decodes in a launch of their own or in the prefill launch with everything else."""
    _check_attention(_batch("p5_mixed", heads, 16, _dtype("bfloat16"), seed=8, num_pad_tokens=2), split_decodes=split_decodes)


@pytest.mark.parametrize("cfg", [(1, 64, 1, 4, 3), (16, 64, 2, 4, 3), (64, 64, 4, 8, 3)], ids=lambda c: "bq{}-n{}-s{}".format(*c[:3]))
def test_attention_mixed_one_launch(cfg: tuple[int, int, int, int, int]) -> None:
    """The mixed scenario without the decode launch: forced shapes over every sequence."""
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    config = AttentionLaunchConfig(block_q=cfg[0], tile_n=cfg[1], num_splits=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
    _check_attention(_batch("mixed", "qwen3-0.6b", 16, _dtype("bfloat16"), seed=12, num_pad_tokens=1), config, split_decodes=False)


@pytest.mark.parametrize("scenario", ["mixed", "few_long_decode", "prefill_long"])
def test_attention_fp32(scenario: str) -> None:
    _check_attention(_batch(scenario, "g3-d128", 16, torch.float32, seed=5))


@pytest.mark.parametrize("block_size", [8, 64])
def test_attention_other_block_sizes(block_size: int) -> None:
    _check_attention(_batch("mixed", "qwen3-0.6b", block_size, _dtype("bfloat16"), seed=9))


def test_attention_kv_cache_in_other_dtype() -> None:
    """fp16 queries over a bf16 cache: keys/values are cast to q's dtype in the kernel."""
    _check_attention(_batch("mixed", "llama3-8b", 16, torch.float16, seed=4, cache_dtype=_dtype("bfloat16")))


@pytest.mark.skipif(DRYRUN, reason="the interpreter's float8 rounding is not exact")
@pytest.mark.parametrize("scenario", ["decode256", "mixed", "prefill_long"])
def test_attention_over_an_fp8_cache(scenario: str) -> None:
    """kv_cache_dtype="fp8": bf16 keys/values stored as float8 e4m3 (== torch's cast) and read back."""
    _check_attention(_batch(scenario, "qwen3-0.6b", 16, torch.bfloat16, seed=6, cache_dtype=torch.float8_e4m3fn))


@pytest.mark.skipif(DRYRUN, reason="needs ~9 GB of device memory")
def test_attention_64bit_cache_offsets() -> None:
    """Blocks at the top of a cache of > 2**31 elements per K/V half: offsets must be 64-bit."""
    batch = _batch("decode64", "mha-d64", 16, torch.bfloat16, seed=2, high_block_ids=True)
    assert batch.kv_cache[0].numel() > 2**31
    _check_attention(batch)


# ---------------------------------------------------------------- the backend
@pytest.mark.parametrize("scenario", ["mixed", "decode256", "prefill_long"])
def test_backend_matches_torch_backend(scenario: str) -> None:
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    batch = _batch(scenario, "qwen3-0.6b", 16, _dtype("bfloat16"), seed=1)
    cache_ref = batch.kv_cache.float()
    expected = TorchAttentionBackend().forward(
        batch.q.float(), batch.k.float(), batch.v.float(), cache_ref, batch.metadata(), 0.1
    )
    got = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, batch.metadata(), 0.1)
    torch.testing.assert_close(got.float(), expected, **_attn_tol(batch.q.dtype))
    torch.testing.assert_close(batch.kv_cache.float(), cache_ref, atol=0, rtol=0)


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
def test_backend_forward_never_syncs() -> None:
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    batches = [_batch(s, "qwen3-0.6b", 16, torch.bfloat16, seed=6) for s in ("decode64", "mixed", "few_long_decode")]
    for b in batches:  # compile first: the first launch of a new specialisation may sync
        backend.forward(b.q, b.k, b.v, b.kv_cache, b.metadata(), 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for b in batches:
            backend.forward(b.q, b.k, b.v, b.kv_cache, b.metadata(), 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
@pytest.mark.parametrize("graph_batch", [32, 256])
def test_cuda_graph_decode_replay(graph_batch: int) -> None:
    """Capture one decode step at static bounds, then replay it for other lengths, block tables and
    padding (unused sequences either empty, or 1-token dummies with slot -1)."""
    from tokenmill.attention.metadata import AttentionMetadata
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels import reference

    num_heads, num_kv_heads, head_dim = HEADS["qwen3-0.6b"]
    block_size, max_seq = 16, 4096
    max_blocks = max_seq // block_size
    num_blocks = graph_batch * max_blocks + 8
    dev, dtype, scale = "cuda", torch.bfloat16, head_dim**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen, device=dev).to(dtype)
    q = torch.empty((graph_batch, num_heads, head_dim), device=dev, dtype=dtype)
    k = torch.empty((graph_batch, num_kv_heads, head_dim), device=dev, dtype=dtype)
    v = torch.empty_like(k)
    slots = torch.empty(graph_batch, device=dev, dtype=torch.int64)
    starts = torch.empty(graph_batch + 1, device=dev, dtype=torch.int32)
    lens = torch.empty(graph_batch, device=dev, dtype=torch.int32)
    tables = torch.empty((graph_batch, max_blocks), device=dev, dtype=torch.int32)
    # Host fields carry the static bounds the graph is captured for, as the runner must pass them.
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=starts, seq_lens=lens, block_tables=tables, block_size=block_size,
        query_lens_host=[1] * graph_batch, seq_lens_host=[max_seq] * graph_batch, max_query_len=1, max_seq_len=max_seq,
    )

    def fill(real: int, padding: str, seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        tables.copy_(torch.randperm(num_blocks, generator=g, device=dev)[: graph_batch * max_blocks].view(graph_batch, max_blocks))
        new_lens = torch.randint(1, max_seq + 1, (graph_batch,), generator=g, device=dev, dtype=torch.int32)
        idx = torch.arange(graph_batch, device=dev)
        pos = (new_lens - 1).to(torch.int64)
        new_slots = tables[idx, pos // block_size].to(torch.int64) * block_size + pos % block_size
        new_starts = torch.arange(graph_batch + 1, device=dev, dtype=torch.int32)
        if padding == "empty":
            new_starts[real + 1 :] = real
            new_lens[real:] = 0
        else:  # dummy 1-token sequences that write nothing
            new_lens[real:] = 1
        new_slots[real:] = -1
        lens.copy_(new_lens)
        slots.copy_(new_slots)
        starts.copy_(new_starts)
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g, device=dev))

    backend = TritonAttentionBackend()
    fill(graph_batch, "empty", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and autoload outside the capture
        backend.forward(q, k, v, cache, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, scale)

    for trial, (real, padding) in enumerate([(graph_batch, "empty"), (graph_batch // 2, "empty"), (graph_batch - 3, "dummy"), (1, "empty")]):
        fill(real, padding, trial + 1)
        expected_cache = cache.clone()
        reference.store_kv_ref(k, v, expected_cache, slots)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, expected_cache), f"trial {trial}: cache"
        expected = reference.paged_attention_ref(q, expected_cache, starts, lens, tables, scale)
        torch.testing.assert_close(out[:real].float(), expected[:real].float(), **_attn_tol(dtype), msg=lambda m: f"trial {trial}: {m}")
        if padding == "empty":
            assert torch.isnan(out[real:]).all(), f"trial {trial}: padding rows written"
        else:
            assert torch.isfinite(out[real:]).all(), f"trial {trial}: dummy rows not finite"
        del expected_cache


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


# ---------------------------------------------------------------- varlen attention (pooling: whole prompts, no cache)
VARLEN_HEADS = {  # name: (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "minilm": (12, 12, 32),
    "bert-base": (12, 12, 64),
    "llama3-8b": (32, 8, 128),
    "g4-d256": (16, 4, 256),
    "g3-d80": (12, 4, 80),  # head_dim padded to 128 in the kernel
}
VARLEN_SCENARIOS = {  # name: lengths of one step's packed prompts
    "p6-qwen3": lambda rng: [rng.randint(8, 384) for _ in range(_count(96))],
    "p6-minilm": lambda rng: [rng.randint(8, 128) for _ in range(_count(512))],
    # Lengths around the 64-key and 64/128-token tiles (a dry run keeps only the short ones).
    "edges": lambda rng: [1, 2, 17, 0, 3] if DRYRUN else [1, 2, 63, 64, 65, 127, 128, 129, 1, 0, 3],
    "long": lambda rng: [_len(4096), _len(1500), 1, _len(777)],
}


def _check_varlen(heads: str, lens: list[int], dtype: torch.dtype, causal: bool, config: Any = None, pad: int = 3) -> None:
    from tokenmill.kernels.reference import varlen_attention_ref
    from support.kernel_cases import make_varlen_batch
    from tokenmill.kernels.triton.varlen_attention import varlen_attention

    num_heads, num_kv_heads, head_dim = VARLEN_HEADS[heads]
    batch = make_varlen_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                              device=DEVICE, num_pad_tokens=pad, seed=len(lens))
    scale = head_dim**-0.5
    out = torch.full_like(batch.q, float("nan"))
    varlen_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal=causal, max_seqlen=max(lens), out=out, config=config)
    expected = varlen_attention_ref(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal)
    n = sum(lens)
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), **_attn_tol(dtype), msg=lambda m: f"{config}: {m}")
    assert torch.isnan(out[n:]).all(), "rows past the last sequence were written"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("heads", list(VARLEN_HEADS))
@pytest.mark.parametrize("scenario", list(VARLEN_SCENARIOS))
def test_varlen_attention_matches_reference(scenario: str, heads: str, causal: bool, dtype: str) -> None:
    lens = VARLEN_SCENARIOS[scenario](random.Random(11))
    _check_varlen(heads, lens, _dtype(dtype), causal)


VARLEN_CONFIGS = [  # (block_q, tile_n, num_warps, num_stages)
    (16, 16, 4, 2), (32, 32, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 3), (32, 64, 8, 4),
]


@pytest.mark.parametrize("cfg", VARLEN_CONFIGS, ids=lambda c: "bq{}-n{}-w{}-st{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_varlen_attention_forced_configs(cfg: tuple[int, int, int, int], causal: bool) -> None:
    """Every launch-shape knob gives the same answer (the benchmark's sweep must be correct)."""
    from tokenmill.kernels.triton.varlen_attention import VarlenAttentionConfig

    config = VarlenAttentionConfig(block_q=cfg[0], tile_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    _check_varlen("qwen3-0.6b", VARLEN_SCENARIOS["edges"](None), _dtype("bfloat16"), causal, config)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_varlen_attention_fp32(causal: bool) -> None:
    _check_varlen("g3-d80", VARLEN_SCENARIOS["edges"](None), torch.float32, causal)


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
def test_varlen_backend_never_syncs() -> None:
    """A pooling step's attention, both entry points, launches without a host sync."""
    from tokenmill.attention.metadata import AttentionMetadata, QKVPrologue
    from tokenmill.attention.varlen_backend import VarlenAttentionBackend
    from support.kernel_cases import make_varlen_batch, rope_cos_sin_cache

    lens = VARLEN_SCENARIOS["p6-qwen3"](random.Random(2))
    batch = make_varlen_batch(lens, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=DEVICE)
    tokens = batch.qkv.shape[0]
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(empty, batch.cu_seqlens, batch.cu_seqlens.diff(), torch.empty(len(lens), 0, dtype=torch.int32, device=DEVICE),
                             0, lens, lens, max(lens), max(lens))
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    weight = torch.ones(128, dtype=torch.bfloat16, device=DEVICE)
    prologue = QKVPrologue(16, 8, 128, rope_cos_sin_cache(512, 128, device=DEVICE), weight, weight, 1e-6)
    backend = VarlenAttentionBackend()

    def step() -> None:
        backend.attend(batch.q, batch.k, batch.v, meta, 0.1, causal=False)
        backend.forward_qkv(batch.qkv.contiguous(), positions, prologue, None, meta, 0.1)

    step()  # compile first: the first launch of a new specialisation may sync
    torch.cuda.synchronize()
    contiguous = batch.qkv.contiguous()  # made before the check: the step itself copies nothing
    assert contiguous.shape[0] == tokens
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.attend(batch.q, batch.k, batch.v, meta, 0.1, causal=False)
        backend.forward_qkv(contiguous, positions, prologue, None, meta, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


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
