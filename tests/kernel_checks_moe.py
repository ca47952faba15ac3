"""The fused mixture-of-experts kernels' cases and checks under the interpreter, run by the workers
of ``test_kernels_interpret.py`` (which merges ``CASES`` and ``CHECKS`` into its own): ``moe_align``
on its own (every pair listed once, one expert a block, sentinel padding, the padded count), each
grouped GEMM on its own into a NaN-poisoned buffer, ``fused_experts`` end to end against
``reference.fused_moe_ref``, and the router's top-k (``moe_routing.route_top_k``) against plain torch.

Shapes are tiny (the interpreter is slow) but awkward: H and I that fill no tile (40, 24: masked K
steps, columns past N), one token, K = 1 (down written straight into the output), skewed routing
(experts that get most pairs, experts that get none, the same expert twice in one token), int32
and int64 expert ids, both tile classes of ``choose_config`` and forced tiles.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


# moe_align's lists: the one-launch counting sort (up to ONE_LAUNCH_MAX_PAIRS) and the chunked launches,
# each way over int64 and over int32 ids. (tokens, experts, top_k, block_m, routing) of each call.
_ALIGN_ONE_LAUNCH = [(1, 128, 8, 16, "topk"), (5, 8, 2, 16, "random"), (37, 8, 2, 16, "skewed"), (37, 4, 1, 64, "random"),
                     (100, 256, 8, 16, "topk"), (300, 8, 2, 64, "topk"), (16, 4, 4, 16, "skewed"), (7, 8, 2, 1, "random"),
                     (0, 8, 2, 16, "random")]
# Past the one-launch limit: several chunks, a ragged last one; experts that fill no power of two (60),
# skewed routing; few experts over many chunks; a wide router (E_PAD 512: 9 chunks over the rows
# kernel's passes of 8, so its second pass too). The interpreter takes ~0.6 s a chunk at E_PAD 512
# (the scatter ranks 8 pairs at a time), so each routing runs over one ids dtype only.
_ALIGN_CHUNKED = [(1100, 128, 8, 64, "topk"), (1100, 60, 8, 16, "skewed"), (4200, 8, 2, 128, "random"),
                  (520, 512, 16, 16, "topk")]
_case("moe_align", "moe-align-int64", ids_dtype="int64", routings=_ALIGN_ONE_LAUNCH[0::2] + _ALIGN_CHUNKED[0::2])
_case("moe_align", "moe-align-int32", ids_dtype="int32", routings=_ALIGN_ONE_LAUNCH[1::2] + _ALIGN_CHUNKED[1::2])

# (tokens, experts, top_k, hidden, intermediate, routing, forced tiles or None). Routing: "random"
# (each id drawn independently: some tokens pick an expert twice), "topk" (distinct experts a token,
# as a router gives), "skewed" (most pairs on one expert, a few on two others, the rest empty).
_FUSED = [
    (1, 4, 2, 40, 24, "topk", None),
    (5, 8, 1, 40, 24, "random", None),  # K = 1; most experts empty
    (5, 8, 2, 64, 32, "random", None),  # whole K steps (EVEN_K) at fp32's 32-deep tiles
    (37, 8, 2, 40, 24, "skewed", None),  # one expert over several blocks, five experts with none
    (37, 4, 2, 40, 24, "topk", None),  # 74 pairs on 4 experts: H and I fill no K step, so still the small tiles
    (20, 4, 2, 128, 128, "topk", None),  # 40 pairs on 4 (10 an expert): the medium tiles (32-row blocks)
    (100, 4, 2, 128, 128, "topk", None),  # 200 on 4: the large tiles (64-row blocks in fp32, 128 in fp16)
    (37, 8, 2, 40, 24, "random", dict(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=1, group_m=2)),
]
for _dt in ("float32", "float16"):
    for _t, _e, _k, _h, _i, _routing, _cfg in _FUSED:
        _name = f"moe-t{_t}-e{_e}-k{_k}-h{_h}-i{_i}-{_routing}{'-forced' if _cfg else ''}-{_dt}"
        _case("fused_moe", _name, dtype=_dt, tokens=_t, experts=_e, top_k=_k, hidden=_h, inter=_i, routing=_routing,
              config=_cfg, ids_dtype="int32" if _t == 37 else "int64")
# fp8 weights (codes and a scale per output channel): H / I that fill no tile, and whole K steps.
for _dt in ("float32", "float16"):
    _case("moe_fp8_weights", f"moe-fp8-weights-h40-i24-{_dt}", dtype=_dt, tokens=9, hidden=40, inter=24)
    _case("moe_fp8_weights", f"moe-fp8-weights-h64-i32-{_dt}", dtype=_dt, tokens=37, hidden=64, inter=32)
for _dt in ("float32", "float16"):
    _case("moe_batch_invariant", f"moe-batch-invariant-{_dt}", dtype=_dt)
_case("fused_moe", "moe-t0-e4-k2-float32", dtype="float32", tokens=0, experts=4, top_k=2, hidden=40, inter=24,
      routing="random", config=None, ids_dtype="int64")
# The router's top-k (moe_routing.route_top_k): (tokens, experts, top_k, renormalize, logits' spread).
# "ties": logits on a coarse grid, so a row holds equal logits, some at the k-th place.
_ROUTES = [(1, 128, 8, True, "normal"), (37, 8, 2, True, "normal"), (5, 60, 4, False, "normal"),  # 60: padded experts
           (21, 128, 8, False, "ties"), (9, 512, 8, True, "ties"), (3, 4, 4, True, "normal"), (0, 8, 2, True, "normal")]
for _dt in ("float32", "float16"):
    for _t, _e, _k, _norm, _spread in _ROUTES:
        _case("moe_route", f"moe-route-t{_t}-e{_e}-k{_k}-{'norm' if _norm else 'raw'}-{_spread}-{_dt}", dtype=_dt,
              tokens=_t, experts=_e, top_k=_k, renormalize=_norm, spread=_spread)


def routing(tokens: int, experts: int, top_k: int, kind: str, gen: Any) -> Any:
    """[tokens, top_k] int64 expert ids on the CPU: "topk" (distinct experts a token, as a router
    picks them), "random" (drawn independently: repeats within a token), "skewed" (most pairs on
    expert 0, some on 3 and E - 1, none on the others)."""
    import torch

    if kind == "topk":
        return torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    if kind == "skewed":
        ids = torch.zeros(tokens, top_k, dtype=torch.int64)
        ids.view(-1)[::5] = 3
        ids.view(-1)[1::7] = experts - 1
        return ids
    return torch.randint(0, experts, (tokens, top_k), generator=gen)


def assert_align_lists(ids: Any, experts: int, block_m: int, stable: bool | None = None, lists: Any = None) -> None:
    """The invariants of ``moe_align``'s output for ``ids`` [T, K] (on any device; checked on the CPU;
    tests/gpu/test_moe_gpu.py runs it on CUDA). ``stable``: each expert's pairs must come in
    increasing order (the chunked launches' promise, and the torch twin's; the one-launch way's
    atomics give any order, except under the interpreter, which runs a vector's lanes in turn);
    default: when the chunked launches run. ``lists``: that output, where the caller has it already
    (default: ``moe_align`` is called here)."""
    import torch

    from tokenmill.kernels.triton.moe_align import ONE_LAUNCH_MAX_PAIRS, max_padded_rows, moe_align

    pairs = ids.numel()
    if stable is None:
        stable = pairs > ONE_LAUNCH_MAX_PAIRS
    sorted_pairs, block_experts, num_padded = (t.cpu() for t in (lists if lists is not None else moe_align(ids, experts, block_m)))
    ids = ids.cpu()
    assert sorted_pairs.dtype == block_experts.dtype == num_padded.dtype == torch.int32
    rows = max_padded_rows(pairs, experts, block_m)
    assert sorted_pairs.shape == (rows,) and block_experts.shape == (rows // block_m,) and num_padded.shape == (1,)
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=experts)
    used = int(num_padded)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum()), (used, counts.tolist())
    assert bool((sorted_pairs[used:] == pairs).all()), "rows past num_padded must hold the sentinel"
    listed = sorted_pairs[:used]
    real = listed[listed < pairs].long()
    assert real.sort().values.tolist() == list(range(pairs)), "every pair exactly once"
    used_experts = block_experts[:used // block_m]  # unused blocks' entries are never read
    assert bool(((used_experts >= 0) & (used_experts < experts)).all())
    for b in range(used // block_m):
        block = sorted_pairs[b * block_m:(b + 1) * block_m].long()
        inside = block[block < pairs]
        assert inside.numel() > 0, f"block {b} holds only padding"
        assert bool((flat[inside] == int(block_experts[b])).all()), f"block {b} mixes experts"
        # Padding only after an expert's pairs.
        assert bool((block[:inside.numel()] < pairs).all()), f"block {b}: {block.tolist()}"
    for e in range(experts):  # each expert's run: its pairs (in order when stable), then padding to a block
        mine = (block_experts.long() == e).nonzero().flatten().tolist()
        run = torch.cat([sorted_pairs[b * block_m:(b + 1) * block_m] for b in mine if b < used // block_m] or [sorted_pairs[:0]])
        want = (flat == e).nonzero().flatten().tolist()
        real_rows = int((run < pairs).sum())
        got = run[:real_rows].tolist()
        assert (got if stable else sorted(got)) == want, f"expert {e}: its pairs, padding only at the end of its run"


def _check_moe_align(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.triton.moe_align import _moe_align_torch, moe_align

    gen = torch.Generator().manual_seed(3)
    ids_dtype = getattr(torch, p["ids_dtype"])
    for tokens, experts, top_k, block_m, kind in p["routings"]:
        ids = routing(tokens, experts, top_k, kind, gen).to(ids_dtype)
        lists = moe_align(ids, experts, block_m)
        assert_align_lists(ids, experts, block_m, lists=lists)
        # The chunked launches are stable (an expert's pairs in increasing order), and the
        # interpreter runs the one launch's atomics lane by lane, chunk by chunk: either way the lists
        # are the stable torch twin's exactly, a check of the arithmetic row by row.
        if ids.numel():
            for got, want in zip(lists, _moe_align_torch(ids, experts, block_m)):
                assert torch.equal(got, want), (tokens, experts, top_k, block_m, kind)


def expected_route(logits: Any, top_k: int, renormalize: bool) -> tuple[Any, Any]:
    """Plain torch for ``route_top_k`` (here and tests/gpu/test_moe_gpu.py): the weights of
    ``reference.moe_route_ref``; the ids the first top_k of a stable descending sort of the logits
    (among equal logits the lower index first, the kernel's rule)."""
    import torch

    from tokenmill.kernels.reference import moe_route_ref

    weights, _ = moe_route_ref(logits, top_k, renormalize)
    return weights, torch.sort(-logits.float(), dim=-1, stable=True).indices[:, :top_k]


def _check_moe_route(p: dict[str, Any]) -> None:
    """``route_top_k`` against plain torch: the weights of ``reference.moe_route_ref`` and, as ids, the
    first top_k of a stable descending sort of the logits (the lower index first among equal ones)."""
    import torch

    from tokenmill.kernels.triton.moe_routing import route_top_k

    tokens, experts, top_k = p["tokens"], p["experts"], p["top_k"]
    gen = torch.Generator().manual_seed(tokens * 13 + experts + top_k)
    logits = torch.randn(tokens, experts, generator=gen) * 3
    if p["spread"] == "ties":
        logits = (logits * 2).round() / 2  # ~25 distinct values a row
    logits = logits.to(getattr(torch, p["dtype"]))
    weights, ids = route_top_k(logits, top_k, p["renormalize"])
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (tokens, top_k)
    want_weights, want_ids = expected_route(logits, top_k, p["renormalize"])
    assert torch.equal(ids, want_ids), (ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    if tokens >= 3:  # garbage rows (a padding token's): a NaN ranks lowest, and every id names an expert
        bad = logits.clone()
        bad[0] = float("nan")
        bad[1, int(want_ids[1, 0])] = float("nan")
        bad[2, 1] = float("inf")
        _, bad_ids = route_top_k(bad, top_k, p["renormalize"])
        assert bool(((bad_ids >= 0) & (bad_ids < experts)).all()), bad_ids
        assert all(len(set(row)) == top_k for row in bad_ids.tolist()), bad_ids
        ranked = torch.sort(-bad.float().nan_to_num(nan=float("-inf")), dim=-1, stable=True).indices[:, :top_k]
        assert torch.equal(bad_ids[1:3], ranked[1:3]), (bad_ids, ranked)
    if p["spread"] == "ties":
        assert any(len(set(row.tolist())) < top_k + 1 for row in logits.float().sort(dim=-1, descending=True).values[:, :top_k + 1]), \
            "the case must hold a tie at or above the k-th place"


def _check_fused_moe(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import fused_moe_ref, silu_and_mul_ref
    from tokenmill.kernels.triton.fused_moe import MoeConfig, choose_config, fused_experts, moe_align, moe_gemm, tile_classes

    dtype = getattr(torch, p["dtype"])
    tokens, experts, top_k, hidden, inter = p["tokens"], p["experts"], p["top_k"], p["hidden"], p["inter"]
    gen = torch.Generator().manual_seed(tokens * 31 + experts * 7 + top_k + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    ids = routing(tokens, experts, top_k, p["routing"], gen).to(getattr(torch, p["ids_dtype"]))
    weights = torch.rand(tokens, top_k, generator=gen) + 0.5  # away from 1: a dropped multiply shows
    config = MoeConfig(**p["config"]) if p["config"] else None
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}

    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    got = fused_experts(x, w13, w2, weights, ids, config=config, out=out)
    assert got is out
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), **tol)
    if tokens == 0:
        return

    # Each GEMM alone, into a poisoned buffer: every pair's row written, from its own expert.
    cfg = config or choose_config(tokens * top_k, experts, dtype, tile_classes(hidden, inter, False))
    lists = (*moe_align(ids, experts, cfg.block_m), cfg)
    flat = ids.reshape(-1).long()
    rows_x = x.repeat_interleave(top_k, dim=0).float()  # pair p's token row
    gate_up = moe_gemm(x, w13, torch.full((tokens * top_k, 2 * inter), float("nan"), dtype=dtype), *lists, top_k=top_k)
    want = torch.einsum("ph,pnh->pn", rows_x, w13[flat].float()).to(dtype)
    torch.testing.assert_close(gate_up, want, **tol)
    act = silu_and_mul_ref(gate_up)
    route = weights.reshape(-1)
    down = moe_gemm(act, w2, torch.full((tokens * top_k, hidden), float("nan"), dtype=dtype), *lists, top_k=1, topk_weights=route)
    want = (torch.einsum("pi,phi->ph", act.float(), w2[flat].float()) * route[:, None]).to(dtype)
    torch.testing.assert_close(down, want, **tol)


def _check_moe_batch_invariant(p: dict[str, Any]) -> None:
    """``batch_invariant=True`` (deterministic mode): the reference's values, and each token's row bit
    for bit the same alone, in a small batch and in one large enough that the default path switches
    tiles. Run with the interpreter's dot made row-independent, as an MMA is
    (``interpreter_dot_in_fixed_order``): then only the tile's K depth moves a row's bits, and in
    fp16 the default path's small and large tile classes walk K=256 and 128 in other depths (128
    against 64), which the control shows; fp32's classes share their depth, so there the control is skipped."""
    import torch

    from support.triton_interpreter import interpreter_dot_in_fixed_order
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import choose_config, fused_experts, tile_classes

    dtype = getattr(torch, p["dtype"])
    experts, top_k, hidden, inter, tokens = 4, 2, 256, 128, 112
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    ids = routing(tokens, experts, top_k, "topk", gen)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.5
    classes = tile_classes(hidden, inter, False)
    assert choose_config(tokens * top_k, experts, dtype, classes) != choose_config(3 * top_k, experts, dtype, classes)  # the default switches
    subsets = ([7], [7, 0, 31], list(range(111, 0, -2)))
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}
    with interpreter_dot_in_fixed_order():
        whole = fused_experts(x, w13, w2, weights, ids, batch_invariant=True)
        torch.testing.assert_close(whole, fused_moe_ref(x, w13, w2, weights, ids), **tol)
        for rows in subsets:
            part = fused_experts(x[rows], w13, w2, weights[rows], ids[rows], batch_invariant=True)
            assert torch.equal(part, whole[rows]), rows
        if dtype == torch.float16:  # the control: without the flag, the same subsets do move
            default = fused_experts(x, w13, w2, weights, ids)
            moved = [not torch.equal(fused_experts(x[r], w13, w2, weights[r], ids[r]), default[r]) for r in subsets]
            assert any(moved), "the default path's tile switch moved no bits: this check could not fail"


def _check_moe_fp8_weights(p: dict[str, Any]) -> None:
    """float8 e4m3 weights with per-output-channel scales (quantization="fp8"'s experts): the reference
    on the dequantized weights, into a poisoned output; a scale dropped on either GEMM would be off by
    its factor (the scales are far from 1)."""
    import torch

    from support.triton_interpreter import patch_triton_interpreter_fp8_rounding
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.kernels.triton.fused_moe import fused_experts
    from tokenmill.quantization.fp8 import quantize_rows

    patch_triton_interpreter_fp8_rounding()
    dtype = getattr(torch, p["dtype"])
    tokens, experts, top_k, hidden, inter = p["tokens"], 8, 2, p["hidden"], p["inter"]
    gen = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, w13_scale = quantize_rows(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    w2, w2_scale = quantize_rows(torch.randn(experts, hidden, inter, generator=gen) / inter**0.5)
    assert w13_scale.max() < 0.05  # far from 1
    ids = routing(tokens, experts, top_k, "topk", gen)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.5
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    got = fused_experts(x, w13, w2, weights, ids, out=out, w13_scale=w13_scale, w2_scale=w2_scale)
    want = fused_moe_ref(x, w13, w2, weights, ids, w13_scale, w2_scale)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}
    torch.testing.assert_close(got, want, **tol)
    assert want.abs().mean() > 0.05


CHECKS = {"moe_align": _check_moe_align, "moe_route": _check_moe_route, "fused_moe": _check_fused_moe,
          "moe_batch_invariant": _check_moe_batch_invariant, "moe_fp8_weights": _check_moe_fp8_weights}
