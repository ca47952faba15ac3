"""The fused mixture-of-experts kernels on a CUDA GPU against their plain-torch twin
(``reference.fused_moe_ref``): bf16 and fp16 over T from 1 to 4096 on Qwen3-30B-A3B's experts
(E 128, K 8, H 2048, I 768), the same experts 8 to a layer with K 2, and H / I that fill no tile;
both tile classes at sizes where the engine picks the other; ``moe_align`` at prefill sizes (the
chunked launches against the torch twin, exactly); and
``fused_experts`` captured in a CUDA graph for a fixed T, replayed with new tokens and routings
(spread, all on the same K experts) copied into the captured inputs; the router's top-k kernel
(``moe_routing.route_top_k``) against plain torch, and in a graph. The engine through the MoE
models: test_moe_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (experts, top_k, hidden, intermediate)
SHAPES = [(128, 8, 2048, 768), (8, 2, 2048, 768), (8, 2, 1000, 360), (16, 4, 72, 40)]
T_VALUES = [1, 2, 3, 8, 16, 17, 33, 64, 100, 256, 1024, 4096]


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5).to(dtype)
    return w13, w2


def _route(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's output: distinct top-k experts a token and their softmax weights, renormalised."""
    logits = torch.randn(tokens, experts, generator=gen, device="cuda")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def _assert_matches(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    scale = float(want.float().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2, msg=msg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_experts_matches_twin(shape, dtype):
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import fused_experts

    experts, top_k, hidden, inter = shape
    w13, w2 = _experts(experts, hidden, inter, dtype, seed=experts + hidden)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in T_VALUES:
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
        weights, ids = _route(tokens, experts, top_k, gen)
        out = torch.full((tokens, hidden), float("nan"), device="cuda", dtype=dtype)
        got = fused_experts(x, w13, w2, weights, ids, out=out)
        assert got is out
        _assert_matches(got, fused_moe_ref(x, w13, w2, weights, ids), f"T={tokens}")


@pytest.mark.parametrize("tile", ["SMALL_TILES", "MEDIUM_TILES", "LARGE_TILES"])
def test_every_tile_class_at_every_size(tile):
    """Each of choose_config's tile classes at decode and prefill sizes alike (the engine switches by
    the mean pairs an expert; the tile sweep times every class at every size, so all must be right)."""
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton import fused_moe

    config = getattr(fused_moe, tile)
    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for tokens in (1, 5, 64, 300, 2048):
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        weights, ids = _route(tokens, experts, top_k, gen)
        got = fused_moe.fused_experts(x, w13, w2, weights, ids, config=config)
        _assert_matches(got, fused_moe_ref(x, w13, w2, weights, ids), f"T={tokens}")


def test_int32_ids_skewed_routing_and_empty_batch():
    """int32 ids; every token on the same two experts (one long run of blocks each, the rest
    empty); a token whose two slots pick the same expert; T = 0."""
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import fused_experts

    experts, top_k, hidden, inter = 8, 2, 2048, 768
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for tokens in (1, 37, 1000):
        x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        ids = torch.tensor([5, 2], device="cuda", dtype=torch.int32).expand(tokens, 2).contiguous()
        ids[0] = 6  # the same expert twice in one token
        weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
        _assert_matches(fused_experts(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids), f"T={tokens}")
    empty = fused_experts(torch.empty(0, hidden, device="cuda", dtype=torch.bfloat16), w13, w2,
                          torch.empty(0, top_k, device="cuda"), torch.empty(0, top_k, device="cuda", dtype=torch.int64))
    assert empty.shape == (0, hidden)


# Past 8,192 pairs the chunked launches (stable: the torch twin's lists exactly), at and below it the one launch.
@pytest.mark.parametrize("tokens, experts, top_k, block_m", [(4096, 128, 8, 64), (8192, 8, 2, 64), (16384, 128, 8, 128),
                                                              (2000, 60, 8, 16), (300, 256, 8, 16), (1024, 128, 8, 64),
                                                              (1, 128, 8, 16)])
def test_moe_align_on_the_gpu(tokens, experts, top_k, block_m):
    from kernel_checks_moe import assert_align_lists

    from tokenmill.kernels.triton.moe_align import ONE_LAUNCH_MAX_PAIRS, _moe_align_torch, moe_align

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    _, ids = _route(tokens, experts, top_k, gen)
    assert_align_lists(ids, experts, block_m)
    assert_align_lists(ids.to(torch.int32), experts, block_m)
    if ids.numel() > ONE_LAUNCH_MAX_PAIRS:
        for got, want in zip(moe_align(ids, experts, block_m), _moe_align_torch(ids, experts, block_m)):
            assert torch.equal(got, want)


# 1-64 tokens: the small tiles and the one-launch alignment on 16-row blocks; 512 (4,096 pairs): the
# large tiles and the one-launch alignment on 64-row blocks; 2,048 (16,384 pairs): the large tiles
# and the chunked alignment (three launches) inside the graph.
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 2048])
def test_fused_experts_replays_in_a_cuda_graph(tokens):
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import fused_experts

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = _route(tokens, experts, top_k, gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_experts(x, w13, w2, weights, ids)  # compile, and the allocator's first blocks, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused_experts(x, w13, w2, weights, ids)
    routings = ["spread", "same-experts", "spread", "last-experts"]
    for kind in routings:
        new_weights, new_ids = _route(tokens, experts, top_k, gen)
        if kind == "same-experts":  # every token on experts 0..K-1: K runs of T pairs, the most padding-free blocks
            new_ids = torch.arange(top_k, device="cuda").expand(tokens, top_k).contiguous()
        elif kind == "last-experts":  # every token on the last K experts: the highest expert ids
            new_ids = torch.arange(experts - top_k, experts, device="cuda").flip(0).expand(tokens, top_k).contiguous()
        x.copy_(torch.randn(tokens, hidden, generator=gen, device="cuda"))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(y, fused_moe_ref(x, w13, w2, weights, ids), f"replay with {kind} routing")


# (experts, top_k, renormalize): Qwen3-30B-A3B's router, Mixtral's, Qwen1.5-MoE-A2.7B's (60: padded, not
# renormalised), a 512-expert router (4 tokens a program).
ROUTERS = [(128, 8, True), (8, 2, True), (60, 4, False), (512, 10, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("router", ROUTERS)
def test_route_top_k_matches_torch(router, dtype):
    """The router kernel against plain torch at decode and prefill sizes, bf16 logits tying often."""
    from kernel_checks_moe import expected_route

    from tokenmill.kernels.triton.moe_routing import route_top_k

    experts, top_k, renormalize = router
    gen = torch.Generator(device="cuda").manual_seed(experts)
    for tokens in [1, 3, 16, 17, 100, 1024, 16384]:
        logits = (torch.randn(tokens, experts, generator=gen, device="cuda") * 2).to(dtype)
        weights, ids = route_top_k(logits, top_k, renormalize)
        want_weights, want_ids = expected_route(logits, top_k, renormalize)
        assert torch.equal(ids, want_ids), f"T={tokens}"
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6, msg=f"T={tokens}")  # exp rounded apart
    # Garbage rows (padding tokens'): NaN ranks lowest, every id a valid expert (an id past E made the
    # grouped GEMMs read past the weights: an illegal address on the first engine run, lease BE).
    bad = logits.clone()
    bad[0] = float("nan")
    bad[1, :experts // 2] = float("nan")
    bad[2, 0] = float("inf")
    _, bad_ids = route_top_k(bad, top_k, renormalize)
    assert bool(((bad_ids >= 0) & (bad_ids < experts)).all())
    assert all(len(set(row)) == top_k for row in bad_ids.tolist())


def test_route_top_k_replays_in_a_cuda_graph():
    from kernel_checks_moe import expected_route

    from tokenmill.kernels.triton.moe_routing import route_top_k

    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = torch.randn(64, 128, generator=gen, device="cuda").to(torch.bfloat16)
    route_top_k(logits, 8, True)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = route_top_k(logits, 8, True)
    for _ in range(3):
        logits.copy_(torch.randn(64, 128, generator=gen, device="cuda"))
        weights.fill_(float("nan"))
        ids.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        want_weights, want_ids = expected_route(logits, 8, True)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    """Deterministic mode's ``batch_invariant=True`` in bf16 on the real MMAs: each token's row bit for
    bit the same alone and in batches on both sides of the default path's tile switch (E 128, K 8)."""
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import choose_config, fused_experts, tile_classes

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13, w2 = _experts(experts, hidden, inter, torch.bfloat16, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(2048, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = _route(2048, experts, top_k, gen)
    classes = tile_classes(hidden, inter, False)
    assert choose_config(2048 * top_k, experts, torch.bfloat16, classes) != choose_config(top_k, experts, torch.bfloat16, classes)
    whole = fused_experts(x, w13, w2, weights, ids, batch_invariant=True)
    _assert_matches(whole, fused_moe_ref(x, w13, w2, weights, ids), "batch_invariant values")
    for rows in ([5], [5, 1000, 77], list(range(2047, 0, -3))):
        index = torch.tensor(rows, device="cuda")
        part = fused_experts(x[index], w13, w2, weights[index], ids[index], batch_invariant=True)
        assert torch.equal(part, whole[index]), f"{len(rows)} rows"


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 2048])
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (8, 2, 1000, 360)])
def test_fp8_weights_match_the_dequantized_twin(shape, tokens):
    """quantization="fp8"'s experts: float8 e4m3 codes with a scale per output channel, widened in
    registers, bf16 activations; against the twin on the dequantized weights, every tile class."""
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import fused_experts
    from tokenmill.quantization.fp8 import quantize_rows

    experts, top_k, hidden, inter = shape
    w13, w2 = _experts(experts, hidden, inter, torch.float32, seed=21)
    (w13, s13), (w2, s2) = quantize_rows(w13), quantize_rows(w2)
    gen = torch.Generator(device="cuda").manual_seed(22)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = _route(tokens, experts, top_k, gen)
    got = fused_experts(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)
    _assert_matches(got, fused_moe_ref(x, w13, w2, weights, ids, s13, s2), f"fp8 T={tokens} {shape}")
