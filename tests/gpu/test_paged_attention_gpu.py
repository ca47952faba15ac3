"""The paged attention kernel against its plain-torch twin on a CUDA GPU, bf16/fp16 (and fp32), at real sizes.

The same checks as tests/kernel_checks_paged_attention.py with far more shapes: 64-1024
sequences, contexts to 32K, Qwen3-0.6B / Llama-3-8B head layouts and odd ones, forced and
automatic split-KV, every launch-shape knob, >2**31-element caches (64-bit offsets), an fp8 cache;
through the backend: CUDA-graph capture and replay of decode with changing lengths and padding,
and a no-host-sync check. Every output is poisoned (NaN) before the kernel runs; inputs are
random, never zeros.

Skipped without CUDA (tests/gpu/conftest.py). Triton is imported inside the tests only.
``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs the same logic on the CPU interpreter with
tiny lengths and fp16 for bf16 (tests/support/gpu_kernel_cases.py), graph/sync tests skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.gpu_kernel_cases import DRYRUN, HEADS, _attn_tol, _batch, _dtype

SCENARIOS = ("decode64", "decode256", "decode1024", "mixed", "prefill_long", "few_long_decode")


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
@pytest.mark.parametrize("heads", ["qwen3-0.6b", "llama3-8b", "g8-d64", "g4-d256", "g2-d32"])
@pytest.mark.parametrize("scenario", ["decode256", "mixed", "prefill_long", "few_long_decode"])
def test_attention_over_an_fp8_cache(scenario: str, heads: str) -> None:
    """kv_cache_dtype="fp8": bf16 keys/values stored as float8 e4m3 (== torch's cast) and read back
    (the kernel's dots then run in fp16, its values converted by inline PTX)."""
    _check_attention(_batch(scenario, heads, 16, torch.bfloat16, seed=6, cache_dtype=torch.float8_e4m3fn))


@pytest.mark.skipif(DRYRUN, reason="the interpreter's float8 rounding is not exact")
@pytest.mark.parametrize("cfg", [(1, 128, 1, 4, 3), (1, 256, 1, 4, 3), (1, 128, 4, 8, 3), (16, 64, 2, 4, 3), (128, 32, 1, 8, 3),
                                 (1, 16, 1, 8, 2), (16, 16, 1, 8, 2)],
                         ids=lambda c: "bq{}-n{}-s{}-w{}".format(*c[:4]))
@pytest.mark.parametrize("heads", ["llama3-8b", "g2-d32"])
def test_attention_over_an_fp8_cache_forced_configs(heads: str, cfg: tuple[int, int, int, int, int]) -> None:
    """Tile shapes the heuristic does not pick, down to values tiles smaller than a thread's four-value
    conversion (16 keys x 32 dims on 8 warps: two values a thread)."""
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig

    config = AttentionLaunchConfig(block_q=cfg[0], tile_n=cfg[1], num_splits=cfg[2], num_warps=cfg[3], num_stages=cfg[4])
    _check_attention(_batch("mixed", heads, 16, torch.bfloat16, seed=13, cache_dtype=torch.float8_e4m3fn), config)


@pytest.mark.skipif(DRYRUN, reason="the interpreter's float8 rounding is not exact")
def test_attention_over_an_fp8_cache_with_queries_past_fp16_range() -> None:
    """Over an fp8 cache q enters fp16 dots. A query feature of 2e5 (past fp16's 65504) whose keys
    are all 0 changes no score, but an fp16 q holding inf there would make every score NaN: the
    kernel scales q into log2 units before converting it, which keeps it finite."""
    batch = _batch("mixed", "qwen3-0.6b", 16, torch.bfloat16, seed=14, cache_dtype=torch.float8_e4m3fn)
    batch.q[..., 0] = 2e5
    batch.k[..., 0] = 0.0
    batch.kv_cache[0, ..., 0] = 0.0
    _check_attention(batch)


@pytest.mark.skipif(DRYRUN, reason="needs ~9 GB of device memory")
def test_attention_64bit_cache_offsets() -> None:
    """Blocks at the top of a cache of > 2**31 elements per K/V half: offsets must be 64-bit."""
    batch = _batch("decode64", "mha-d64", 16, torch.bfloat16, seed=2, high_block_ids=True)
    assert batch.kv_cache[0].numel() > 2**31
    _check_attention(batch)


# ---------------------------------------------------------------- the backend
@pytest.mark.parametrize("scenario", ["mixed", "decode64", "decode256", "p5_mixed", "prefill_long"])
def test_backend_matches_torch_backend(scenario: str) -> None:
    """The backend's own choices: the default launches, and the item queue for decode256's step
    and for p5_mixed's 256 leading decodes (the prefill launch takes the rest)."""
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    batch = _batch(scenario, "qwen3-0.6b", 16, _dtype("bfloat16"), seed=1)
    cache_ref = batch.kv_cache.float()
    expected = TorchAttentionBackend().forward(
        batch.q.float(), batch.k.float(), batch.v.float(), cache_ref, batch.metadata(), 0.1
    )
    meta = batch.metadata()
    got = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, 0.1)
    torch.testing.assert_close(got.float(), expected, **_attn_tol(batch.q.dtype))
    torch.testing.assert_close(batch.kv_cache.float(), cache_ref, atol=0, rtol=0)
    if not DRYRUN:
        assert ("decode_queue" in meta.backend_cache) == (scenario in ("decode256", "p5_mixed")), "wrong decode launch"


@pytest.mark.skipif(DRYRUN, reason="the interpreter's float8 rounding is not exact")
@pytest.mark.parametrize("heads", ["qwen3-0.6b", "llama3-8b"])
@pytest.mark.parametrize("scenario", ["decode256", "p5_mixed"])
def test_backend_over_an_fp8_cache_takes_the_queue(scenario: str, heads: str) -> None:
    """kv_cache_dtype="fp8": 256 decodes (alone, or in front of P5's chunks) go to the item queue on
    the fp8 launch's 1-warp tile; the result against the twin reading the same fp8 cache."""
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels import reference

    batch = _batch(scenario, heads, 16, torch.bfloat16, seed=7, cache_dtype=torch.float8_e4m3fn)
    meta, scale = batch.metadata(), batch.q.shape[-1] ** -0.5
    got = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, scale)
    assert "decode_queue" in meta.backend_cache, "the decodes did not take the queue"
    expected = reference.paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                             batch.block_tables, scale)
    n = batch.num_real_tokens
    torch.testing.assert_close(got[:n].float(), expected[:n].float(), **_attn_tol(batch.q.dtype))


@pytest.mark.skipif(DRYRUN, reason="CUDA only: the side stream")
@pytest.mark.parametrize("side_decodes", [1, 2])
def test_backend_side_decodes_equal_in_sequence(side_decodes: int) -> None:
    """A mixed step's queued decodes on a side stream beside the prefill launch (few programs an
    SM) give the bits of the queue and the prefill launch one after the other, layer after layer."""
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    batch = _batch("p5_mixed", "qwen3-0.6b", 16, _dtype("bfloat16"), seed=3)
    plain, beside = TritonAttentionBackend(), TritonAttentionBackend(side_decodes=side_decodes)
    meta_plain, meta_beside = batch.metadata(), batch.metadata()
    for _ in range(3):  # several layers of one step reuse its order and counters
        expected = plain.attend(batch.q, batch.kv_cache, meta_plain, 0.1)
        got = beside.attend(batch.q, batch.kv_cache, meta_beside, 0.1)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert "decode_queue" in meta_beside.backend_cache, "the decodes did not take the queue"


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
def test_backend_forward_never_syncs() -> None:
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    batches = [_batch(s, "qwen3-0.6b", 16, torch.bfloat16, seed=6) for s in ("decode64", "decode256", "mixed", "few_long_decode")]
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
@pytest.mark.parametrize("graph_batch,decode_queue", [(32, None), (256, None), (256, False)],
                         ids=["32-default-launch", "256-queue", "256-default-launch"])
def test_cuda_graph_decode_replay(graph_batch: int, decode_queue: bool | None) -> None:
    """Capture one decode step at static bounds, then replay it for other lengths, block tables and
    padding (unused sequences either empty, or 1-token dummies with slot -1). At 256 sequences
    the backend's rule takes the item queue (its ranking captured with it); told not to, the
    default launch."""
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

    backend = TritonAttentionBackend(decode_queue=decode_queue)
    fill(graph_batch, "empty", 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile and autoload outside the capture
        backend.forward(q, k, v, cache, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, scale)
    assert ("decode_queue" in meta.backend_cache) == (graph_batch == 256 and decode_queue is None), "wrong decode launch"

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
