"""Paged attention's cases and checks under the interpreter, run by the workers of
``test_kernels_interpret.py`` (which merges ``CASES`` and ``CHECKS`` into its own).

The kernel against ``reference.paged_attention_ref`` on decode, prefill, prefix hits, chunks and
mixed steps (GQA 1-4 and an odd group, head_dim 32-128, blocks 8-64, forced and automatic launch
shapes and split-KV, a mixed step's decodes in a launch of their own or not, an fp8 cache, more
sequences than one vector load of the sequence search, seeded random batches); the Triton backend
and whole attention layers (also cut into micro-batches) against the Torch backend; and the
launch-shape listing and precompile calls that cover every variant a step can choose.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


for _dt in ("float32", "float16"):
    # Mixed step: decode (ctx 17 crosses a block), fresh prefill, prefix hit (6 of 37), chunk in
    # the middle of a prompt, a 1-token context, a sequence with nothing scheduled; 2 pad tokens.
    _case(
        "attention", f"attn-mixed-bs16-g1-d64-{_dt}", dtype=_dt, block_size=16, num_heads=2, num_kv_heads=2,
        head_dim=64, query_lens=[1, 5, 6, 0, 4, 1], seq_lens=[17, 5, 37, 10, 20, 1], pad=2,
    )
    _case(
        "attention", f"attn-mixed-bs32-g2-d128-{_dt}", dtype=_dt, block_size=32, num_heads=4, num_kv_heads=2,
        head_dim=128, query_lens=[3, 1, 7], seq_lens=[3, 40, 70], pad=0,
    )
    # Pure decode, GQA 4, contexts at and across block edges; padded like a CUDA-graph batch.
    _case(
        "attention", f"attn-decode-bs16-g4-d64-{_dt}", dtype=_dt, block_size=16, num_heads=8, num_kv_heads=2,
        head_dim=64, query_lens=[1, 1, 1, 1, 1], seq_lens=[1, 16, 17, 33, 48], pad=3,
    )
    # Split-KV forced: decode with 4 splits (some empty), and a mixed batch with several query
    # blocks per sequence (block_q 2) and 3 splits, where causal rows see nothing in late splits.
    _case(
        "attention", f"attn-decode-split4-bs16-g2-d128-{_dt}", dtype=_dt, block_size=16, num_heads=2,
        num_kv_heads=1, head_dim=128, query_lens=[1, 1, 1], seq_lens=[100, 5, 64], pad=1,
        config={"block_q": 1, "tile_n": 16, "num_splits": 4},
    )
    _case(
        "attention", f"attn-mixed-split3-bq2-bs32-g4-d64-{_dt}", dtype=_dt, block_size=32, num_heads=4,
        num_kv_heads=1, head_dim=64, query_lens=[4, 1, 9], seq_lens=[50, 33, 9], pad=2,
        config={"block_q": 2, "tile_n": 16, "num_splits": 3},
    )
    # The heuristic's own split choice (one long sequence cannot fill the GPU: 2 splits).
    _case(
        "attention", f"attn-decode-autosplit-bs32-g2-d64-{_dt}", dtype=_dt, block_size=32, num_heads=2,
        num_kv_heads=1, head_dim=64, query_lens=[1], seq_lens=[600], pad=0, expect_splits=2,
    )
    # A group of 3 (not a power of two): padded group rows must be masked out.
    _case(
        "attention", f"attn-mixed-g3-bs16-d64-{_dt}", dtype=_dt, block_size=16, num_heads=6, num_kv_heads=2,
        head_dim=64, query_lens=[2, 1], seq_lens=[18, 30], pad=0,
    )
    # Through the backends: TritonAttentionBackend.forward vs TorchAttentionBackend.forward.
    _case(
        "backend", f"backend-mixed-bs16-g2-d64-{_dt}", dtype=_dt, block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=64, query_lens=[1, 6, 3], seq_lens=[20, 6, 35],
    )
    _case(
        "backend", f"backend-decode-bs32-g1-d128-{_dt}", dtype=_dt, block_size=32, num_heads=2, num_kv_heads=2,
        head_dim=128, query_lens=[1, 1, 1], seq_lens=[31, 33, 64],
    )
    # Pure decode through the item queue (decode_queue), padded as a graph bucket pads.
    _case(
        "backend", f"backend-decode-queue-bs16-g2-d64-{_dt}", dtype=_dt, block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=64, query_lens=[1, 1, 1, 1], seq_lens=[70, 3, 33, 129], decode_queue=True, graph_pad=2,
    )
    # A mixed step: its leading decodes through the queue, the chunks through the prefill launch.
    _case(
        "backend", f"backend-mixed-queue-bs16-g2-d64-{_dt}", dtype=_dt, block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=64, query_lens=[1, 1, 1, 6, 3], seq_lens=[70, 3, 33, 6, 35], decode_queue=True,
    )
    _case(
        "layer", f"layer-qwen3-g2-d64-bs16-{_dt}", dtype=_dt, qk_norm=True, qkv_bias=False, num_heads=4, num_kv_heads=2,
        head_dim=64, block_size=16, query_lens=[1, 5, 3], seq_lens=[18, 5, 20],
    )
    _case(
        "layer", f"layer-llama-bias-g1-d128-bs32-{_dt}", dtype=_dt, qk_norm=False, qkv_bias=True, num_heads=2, num_kv_heads=2,
        head_dim=128, block_size=32, query_lens=[1, 1, 4], seq_lens=[40, 7, 4],
    )
    # A step as two micro-batches (worker/micro_batches.py): decodes, then chunks after context; and
    # a decode batch cut in halves as the overlapped decode graphs cut it. B's metadata is derived
    # on the device, which only the Triton backend reads (the torch backend loops on host lists).
    _case(
        "micro_batches", f"micro-mixed-g2-d64-bs16-{_dt}", dtype=_dt, num_heads=4, num_kv_heads=2, head_dim=64,
        block_size=16, query_lens=[1, 1, 1, 9, 4], seq_lens=[20, 33, 7, 9, 30], split=3,
    )
    _case(
        "micro_batches", f"micro-decode-halves-g1-d64-bs16-{_dt}", dtype=_dt, num_heads=2, num_kv_heads=2, head_dim=64,
        block_size=16, query_lens=[1] * 6, seq_lens=[5, 17, 40, 9, 16, 2], split=3,
    )
    # Long prompt with a prefix hit under the automatic prefill shape (several 128-row query
    # blocks per sequence, 64-key tiles spanning 4 blocks of 16), beside a decode.
    _case(
        "attention", f"attn-prefill-auto-bs16-g4-d128-{_dt}", dtype=_dt, block_size=16, num_heads=8, num_kv_heads=2,
        head_dim=128, query_lens=[150, 1, 40], seq_lens=[230, 77, 40], pad=1,
    )
    # Other power-of-two block sizes: 8 (a 16-key tile spans two blocks) and 64.
    _case(
        "attention", f"attn-mixed-bs8-g2-d64-{_dt}", dtype=_dt, block_size=8, num_heads=4, num_kv_heads=2,
        head_dim=64, query_lens=[1, 9, 3], seq_lens=[23, 9, 41], pad=0, config={"block_q": 4, "tile_n": 16, "num_splits": 2},
    )
    _case(
        "attention", f"attn-mixed-bs64-g1-d32-{_dt}", dtype=_dt, block_size=64, num_heads=2, num_kv_heads=2,
        head_dim=32, query_lens=[5, 1], seq_lens=[130, 65], pad=0,
    )

    # A P5-like mixed step, scaled down: decodes first, then long chunks after prefix context
    # (several wide query blocks each, unmasked tiles before the diagonal), a fresh ragged prompt, a
    # decode among the prefills (it stays in the prefill launch) and a short chunk.
    _case(
        "attention", f"attn-p5-mixed-auto-bs16-g2-d128-{_dt}", dtype=_dt, block_size=16, num_heads=4, num_kv_heads=2,
        head_dim=128, query_lens=[1, 1, 1, 150, 97, 1, 33], seq_lens=[300, 45, 129, 400, 97, 70, 160], pad=1,
    )
    # The same step in one launch (decodes in the prefill tile), as before the split: in fp16 only. In
    # fp32 that launch has the tile of the split step's prefill launch above (block_q 8, tile_n 16),
    # and a decode inside an automatic fp32 prefill tile is attn-prefill-auto-...-float32's.
    if _dt == "float16":
        _case(
            "attention", f"attn-p5-mixed-one-launch-bs16-g2-d128-{_dt}", dtype=_dt, block_size=16, num_heads=4,
            num_kv_heads=2, head_dim=128, query_lens=[1, 1, 1, 150, 97, 1, 33], seq_lens=[300, 45, 129, 400, 97, 70, 160],
            pad=1, split_decodes=False,
        )

# The prefill launch after 3 decodes needs its one spare query block (block_q 4: blocks of the
# 6-token chunk start at 3 // 4 + 3, the last sequence's at 9 // 4 + 4), and both launches split.
_case(
    "attention", "attn-split-decodes-spare-block-float16", dtype="float16", block_size=16, num_heads=4, num_kv_heads=2,
    head_dim=64, query_lens=[1, 1, 1, 6, 1], seq_lens=[40, 17, 3, 26, 9], pad=0,
    config={"block_q": 4, "tile_n": 16, "num_splits": 2}, decode_config={"block_q": 1, "tile_n": 16, "num_splits": 3},
)

# More sequences than one vector load of the sequence search covers (256): its loop must iterate.
_case(
    "attention", "attn-decode-260seqs-g2-d32-float32", dtype="float32", block_size=16, num_heads=2, num_kv_heads=1,
    head_dim=32, query_lens=[1] * 260, seq_lens=[1 + (i * 7) % 20 for i in range(260)], pad=2,
)
_case(
    "attention", "attn-mixed-260seqs-bq4-float16", dtype="float16", block_size=16, num_heads=2, num_kv_heads=1,
    head_dim=32, query_lens=[1 + (i % 3 == 0) * (i % 5) for i in range(260)], seq_lens=[5 + (i * 7) % 20 for i in range(260)],
    pad=0, config={"block_q": 4, "tile_n": 16, "num_splits": 1},
)


def _random_attention_cases(count: int) -> None:
    """Seeded random batches and random (valid) launch shapes: every knob against the twin."""
    import random

    rng = random.Random(1234)
    for i in range(count):
        group = rng.choice([1, 2, 4])
        num_kv_heads = rng.choice([1, 2])
        query_lens, seq_lens = [], []
        for _ in range(rng.randint(2, 6)):
            kind = rng.choice(["decode", "prefill", "prefix", "chunk", "idle"])
            ctx = rng.randint(1, 120)
            qlen = {"decode": 1, "prefill": ctx, "prefix": rng.randint(1, ctx), "chunk": rng.randint(1, ctx), "idle": 0}[kind]
            query_lens.append(qlen)
            seq_lens.append(ctx)
        _case(
            "attention", f"attn-random{i}-{'float32' if i % 2 else 'float16'}", dtype="float32" if i % 2 else "float16",
            block_size=rng.choice([16, 32]), num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
            head_dim=rng.choice([64, 128]), query_lens=query_lens, seq_lens=seq_lens, pad=rng.randint(0, 2),
            config={"block_q": rng.choice([1, 2, 4, 16]), "tile_n": rng.choice([16, 32, 64]), "num_splits": rng.choice([1, 2, 3, 5])},
            split_decodes=(i // 2) % 2 == 0,
        )


_random_attention_cases(8)
# Attention reading an fp8 cache. (Storing into fp8 is checked on the GPU only: the interpreter's
# float8 rounding is not exact, e.g. -125.8 becomes -64 instead of -128.)
_case(
    "attention", "attn-mixed-fp8cache-bs16-g2-d64-float16", dtype="float16", cache_dtype="float8_e4m3fn", block_size=16,
    num_heads=4, num_kv_heads=2, head_dim=64, query_lens=[1, 6, 3, 1], seq_lens=[20, 6, 35, 50], pad=1,
)
# The variants compiled while LLM() starts must hold every config a step can choose.
_case("launch_configs", "attention-launch-configs-cover-every-choice")
# The precompile calls reach the kernels with valid arguments (the interpreter runs a compile-only
# launch instead of compiling it; whether nothing compiles mid-run is checked on the GPU).
_case("precompile", "precompile-calls-every-attention-variant-and-the-draw")


def _tol(dtype: Any) -> dict[str, float]:
    import torch

    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _check_attention(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels import reference
    from support.kernel_cases import make_paged_batch
    from tokenmill.kernels.triton.kv_store import store_kv
    from tokenmill.kernels.triton.paged_attention import AttentionLaunchConfig, choose_configs, paged_attention

    dtype = getattr(torch, p["dtype"])
    batch = make_paged_batch(
        p["query_lens"], p["seq_lens"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"], block_size=p["block_size"], dtype=dtype, num_pad_tokens=p["pad"], seed=len(p["query_lens"]),
        cache_dtype=getattr(torch, p.get("cache_dtype", p["dtype"])),
    )
    scale = p["head_dim"] ** -0.5
    cache = batch.kv_cache.clone()
    cache_ref = batch.kv_cache.clone()
    reference.store_kv_ref(batch.k, batch.v, cache_ref, batch.slot_mapping)
    if cache.dtype.itemsize > 1:  # (the interpreter's float8 rounding is not exact: see the cases)
        store_kv(batch.k, batch.v, cache, batch.slot_mapping)
        assert torch.equal(cache, cache_ref), "kv store differs from reference"
        assert not torch.equal(cache, batch.kv_cache), "kv store wrote nothing"
    else:
        cache = cache_ref.clone()

    meta = batch.metadata()
    # The leading one-token sequences get their own decode launch (as the backend does), unless
    # the case runs the whole step through one launch.
    num_decode_seqs = 0
    if p.get("split_decodes", True):
        while num_decode_seqs < len(p["query_lens"]) and p["query_lens"][num_decode_seqs] == 1:
            num_decode_seqs += 1
    if "config" in p:
        config = AttentionLaunchConfig(num_warps=4, num_stages=1, **p["config"])
    else:
        _, config = choose_configs(
            num_tokens=batch.q.shape[0], num_seqs=len(p["seq_lens"]), num_decode_seqs=num_decode_seqs,
            num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"], dtype=dtype,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, device=batch.q.device,
        )
    if "expect_splits" in p:
        assert config.num_splits == p["expect_splits"], f"heuristic chose {config}"
    decode_config = AttentionLaunchConfig(num_warps=4, num_stages=1, **p["decode_config"]) if "decode_config" in p else None
    out = torch.full_like(batch.q, float("nan"))
    paged_attention(
        batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale,
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_decode_seqs=num_decode_seqs, out=out,
        config=config, decode_config=decode_config,
    )
    expected = reference.paged_attention_ref(batch.q, cache_ref, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    n = batch.num_real_tokens
    torch.testing.assert_close(out[:n], expected[:n], **_tol(dtype), msg=lambda m: f"{config}: {m}")
    assert torch.isnan(out[n:]).all(), "padding rows were written"


def _check_backend(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from support.kernel_cases import make_paged_batch

    dtype = getattr(torch, p["dtype"])
    batch = make_paged_batch(
        p["query_lens"], p["seq_lens"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"], block_size=p["block_size"], dtype=dtype, seed=11,
    )
    cache, cache_ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    # The fp32 reference backend run on fp32 copies: the fp16 kernel is held to the exact answer.
    expected = TorchAttentionBackend().forward(
        batch.q.float(), batch.k.float(), batch.v.float(), cache_ref.float(), batch.metadata(), 0.125
    )
    meta = batch.metadata()
    q, k, v = batch.q, batch.k, batch.v
    pad = p.get("graph_pad", 0)
    if pad:
        # As a decode graph's bucket pads: rows past the batch with no keys (seq_len 0), no query
        # tokens (query_start_loc stays at the end) and no slot; their output is never read.
        import dataclasses

        n = len(p["seq_lens"])
        q, k, v = (torch.cat([x, torch.full((pad, *x.shape[1:]), float("nan"), dtype=x.dtype)]) for x in (q, k, v))
        meta = dataclasses.replace(
            meta, slot_mapping=torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=meta.slot_mapping.dtype)]),
            query_start_loc=torch.cat([meta.query_start_loc, torch.full((pad,), n, dtype=torch.int32)]),
            seq_lens=torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)]),
            block_tables=torch.cat([meta.block_tables, torch.zeros((pad, meta.block_tables.shape[1]), dtype=torch.int32)]),
            query_lens_host=meta.query_lens_host + [1] * pad, seq_lens_host=meta.seq_lens_host + [meta.max_seq_len] * pad,
        )
    backend = TritonAttentionBackend(decode_queue=p.get("decode_queue"))
    for _ in range(2 if backend.decode_queue else 1):  # the queue's buffers serve the next step as well
        cache = batch.kv_cache.clone()
        got = backend.forward(q, k, v, cache, meta, 0.125)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got[: batch.q.shape[0]].float(), expected, **_tol(dtype))
    assert meta.backend_cache, "config not cached per step"
    if backend.decode_queue:
        assert "decode_queue" in meta.backend_cache, "the item queue did not run"


def _check_layer(p: dict[str, Any]) -> None:
    """One decoder attention layer (qkv GEMM -> prologue -> attention -> o_proj) with the Triton
    backend (the fused forward_qkv) against the same layer with the Torch backend (separate ops)."""
    import torch

    from tokenmill.attention.metadata import ForwardContext
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from support.kernel_cases import make_paged_batch, tiny_attention_layer

    dtype = getattr(torch, p["dtype"])
    hq, hk, d = p["num_heads"], p["num_kv_heads"], p["head_dim"]
    layer = tiny_attention_layer(
        num_heads=hq, num_kv_heads=hk, head_dim=d, qk_norm=p["qk_norm"], qkv_bias=p["qkv_bias"], dtype=dtype, seed=23
    )
    assert layer.rotary_emb.cos_sin_cache.dtype == torch.float32
    batch = make_paged_batch(
        p["query_lens"], p["seq_lens"], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=p["block_size"],
        dtype=dtype, seed=29,
    )
    hidden = torch.randn((batch.slot_mapping.shape[0], 96), generator=torch.Generator().manual_seed(31)).to(dtype)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        cache = batch.kv_cache.clone()
        with torch.no_grad():
            out = layer(batch.positions(), hidden, ForwardContext(batch.metadata(), [cache], backend))
        results.append((out, cache))
    (expected, expected_cache), (got, got_cache) = results
    assert got.dtype == dtype and got.shape == expected.shape
    # The torch path rotates in the model dtype, the kernel in fp32: fp16 differs by an ulp or two.
    torch.testing.assert_close(got, expected, **_tol(dtype))
    torch.testing.assert_close(got_cache, expected_cache, **_tol(dtype))


def _check_micro_batches(p: dict[str, Any]) -> None:
    """One attention layer over a step cut into two micro-batches, with the Triton backend, against
    the whole step through the Torch backend."""
    import torch

    from tokenmill.attention.metadata import ForwardContext
    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from support.kernel_cases import make_paged_batch, tiny_attention_layer
    from tokenmill.worker.micro_batches import forward_micro_batches

    dtype = getattr(torch, p["dtype"])
    hq, hk, d = p["num_heads"], p["num_kv_heads"], p["head_dim"]
    layer = tiny_attention_layer(num_heads=hq, num_kv_heads=hk, head_dim=d, qk_norm=True, qkv_bias=False, dtype=dtype, seed=5)
    batch = make_paged_batch(
        p["query_lens"], p["seq_lens"], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=p["block_size"],
        dtype=dtype, seed=7,
    )
    num_tokens = batch.slot_mapping.shape[0]
    rows = torch.randn((num_tokens, 96), generator=torch.Generator().manual_seed(9)).to(dtype)

    def model(input_ids: Any, positions: Any, ctx: Any) -> Any:  # the model's signature: ids pick the rows
        return layer(positions, rows[input_ids], ctx)

    ids = torch.arange(num_tokens)
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    with torch.no_grad():
        expected = model(ids, batch.positions(), ForwardContext(batch.metadata(), [ref_cache], TorchAttentionBackend()))
        out = forward_micro_batches(model, ids, batch.positions(), batch.metadata(), [cache], TritonAttentionBackend(), p["split"], None)
    torch.testing.assert_close(out, expected, **_tol(dtype))
    torch.testing.assert_close(cache, ref_cache, **_tol(dtype))


def _check_launch_configs(p: dict[str, Any]) -> None:
    import random

    import torch

    from tokenmill.kernels.triton.paged_attention import choose_config, launch_configs
    from tokenmill.kernels.triton.paged_attention_config import (
        DECODE_WARPS, FP8_CACHE_DECODE_STAGES, FP8_CACHE_DECODE_WARPS, FP8_CACHE_WIDE_ROWS)

    rng = random.Random(0)
    cpu = torch.device("cpu")
    # (heads, kv heads, head_dim, dtype, cache dtype): groups 1, 2 (Qwen3-0.6B), 3, 4 (Llama-3-8B), 8, 16; fp8 caches.
    fp8 = torch.float8_e4m3fn
    for heads, kv_heads, dim, dtype, cache_dtype in [
        (16, 16, 64, torch.float16, None), (16, 8, 128, torch.bfloat16, None), (6, 2, 256, torch.bfloat16, None),
        (32, 8, 128, torch.bfloat16, None), (16, 2, 256, torch.float16, None), (32, 2, 128, torch.bfloat16, None),
        (4, 2, 128, torch.float32, None), (16, 8, 128, torch.bfloat16, fp8), (32, 8, 128, torch.float16, fp8),
    ]:
        for max_model_len in (256, 4096, 40960):
            configs = launch_configs(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, max_seq_len=max_model_len,
                                     cache_dtype=cache_dtype)
            assert len(configs) == len(set(configs)) and len(configs) <= 3 * 7, configs
            chosen = set()
            for _ in range(3000):
                num_seqs = rng.choice([1, 2, 3, rng.randint(1, 1024)])
                decode = rng.random() < 0.4
                max_query_len = 1 if decode else rng.choice([2, 3, 8, 9, 16, 17, rng.randint(2, 16384)])
                num_tokens = num_seqs if decode else max(num_seqs, max_query_len + rng.randint(0, 16384 - max_query_len))
                max_seq_len = rng.randint(max_query_len, max_model_len) if max_query_len <= max_model_len else max_query_len
                if max_seq_len > max_model_len:
                    continue
                config = choose_config(
                    num_tokens=num_tokens, num_seqs=num_seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                    dtype=dtype, max_query_len=max_query_len, max_seq_len=max_seq_len, device=cpu, cache_dtype=cache_dtype,
                )
                assert config in configs, (config, heads, kv_heads, dim, dtype, cache_dtype, max_model_len)
                chosen.add(config)
            # The listing is not padded with variants no step would pick.
            assert len(chosen) >= len(configs) - 2, (sorted(set(configs) - chosen, key=str), configs)
    # Qwen3-0.6B at max_model_len 4096: decode 1-16 splits (5), two prefill tiles with 1-4 splits (6).
    qwen = launch_configs(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_seq_len=4096)
    assert len(qwen) == 11, qwen
    assert {(c.block_q, c.num_warps) for c in qwen if c.block_q > 1} == {(8, 4), (64, 8)}, qwen
    # Decode over a bf16 cache takes DECODE_WARPS (measured at head_dim 128); head_dim 256, fp32 and
    # deterministic mode keep 4 warps.
    assert {(c.num_warps, c.num_stages) for c in qwen if c.block_q == 1} == {(DECODE_WARPS, 3)}, qwen
    for dim, dtype, deterministic in ((256, torch.bfloat16, False), (128, torch.float32, False), (128, torch.bfloat16, True)):
        configs = launch_configs(num_heads=16, num_kv_heads=8, head_dim=dim, dtype=dtype, max_seq_len=4096, deterministic=deterministic)
        assert {c.num_warps for c in configs if c.block_q == 1 or deterministic} == {4}, (dim, dtype, deterministic, configs)
    # Over a float8 cache decode takes its own warps and stages and the wide tile its own rows; the
    # narrow tile stays.
    qwen_fp8 = launch_configs(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_seq_len=4096,
                              cache_dtype=torch.float8_e4m3fn)
    assert {(c.num_warps, c.num_stages) for c in qwen_fp8 if c.block_q == 1} == {(FP8_CACHE_DECODE_WARPS, FP8_CACHE_DECODE_STAGES)}
    assert {c.block_q for c in qwen_fp8 if c.block_q > 1} == {8, FP8_CACHE_WIDE_ROWS // 2}, qwen_fp8
    assert [c for c in qwen_fp8 if c.block_q == 8] == [c for c in qwen if c.block_q == 8]


def _check_precompile(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels.triton import paged_attention as pa
    from tokenmill.kernels.triton.precompile import parallel_compile
    from tokenmill.worker.sampler import Sampler

    launched = []
    real = pa.paged_attention

    def spy(*args: Any, **kwargs: Any) -> Any:
        assert kwargs["compile_only"] is True
        launched.append(kwargs["config"])
        return real(*args, **kwargs)

    backend = TritonAttentionBackend()
    backend._paged_attention = spy
    for cache_dtype in (torch.float16, torch.float8_e4m3fn):
        scratch = torch.zeros(2, 1, 16, 2, 64, dtype=cache_dtype)
        launched.clear()
        with parallel_compile(max_workers=2):
            backend.precompile(4, scratch, torch.float16, 1024)
            Sampler.precompile(300, torch.float16, torch.device("cpu"))
        assert launched == pa.launch_configs(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_seq_len=1024,
                                             cache_dtype=cache_dtype)


CHECKS = {
    "attention": _check_attention,
    "backend": _check_backend,
    "layer": _check_layer,
    "micro_batches": _check_micro_batches,
    "launch_configs": _check_launch_configs,
    "precompile": _check_precompile,
}
