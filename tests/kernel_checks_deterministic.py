"""Deterministic mode's Triton kernels under the interpreter: cases and checks run by the workers of
``test_kernels_interpret.py`` (which merges ``CASES`` and ``CHECKS`` into its own).

Two kinds of check:
- twins: the batch-invariant matmul and the fixed-split attention against ``kernels/reference.py``
  (random inputs, NaN-poisoned outputs, tails in every dimension);
- invariance: a row's output bits are the same whatever the batch around it: for the matmul any M
  and any place of the row; for attention a token decoded alone, decoded beside other sequences,
  prefilled with its whole prompt or inside a later chunk, with any number of split programs.
  These run under ``interpreter_dot_in_fixed_order``: the interpreter's own dot is a BLAS matmul
  whose rounding depends on a row's place in the tile, which a tensor-core MMA's does not; the
  checks are about the kernels' tiling and reduction order. tests/gpu checks the real hardware.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


for _dt in ("float32", "float16"):
    # (M, N, K, bias): tails in M, N and K; one shape with several tiles each way.
    _case("det_matmul", f"det-matmul-{_dt}", dtype=_dt, shapes=[(37, 96, 64, True), (5, 70, 40, False)])
    _case("det_matmul_invariance", f"det-matmul-invariance-{_dt}", dtype=_dt, n=100, k=80, rows=[1, 7, 65, 130])
# GQA 2 and 3 (padded group rows), head_dim 32/64, blocks 16/8, parts of two 16-key tiles, and of
# four 32-key tiles for the MHA case.
_case("det_attention", "det-attn-g2-d32-bs16-float32", dtype="float32", num_heads=4, num_kv_heads=2, head_dim=32,
      block_size=16, prompt_lens=[45, 20], part_keys=32)
_case("det_attention", "det-attn-g3-d64-bs8-float16", dtype="float16", num_heads=6, num_kv_heads=2, head_dim=64,
      block_size=8, prompt_lens=[33, 18], part_keys=32)
_case("det_attention", "det-attn-g1-d32-bs16-tile32-float16", dtype="float16", num_heads=2, num_kv_heads=2, head_dim=32,
      block_size=16, prompt_lens=[70], part_keys=64, tile_n=32)
# Over a float8 cache (fp16 dots, q pre-scaled): the same invariance.
_case("det_attention", "det-attn-g2-d64-bs16-fp8cache-float16", dtype="float16", num_heads=4, num_kv_heads=2, head_dim=64,
      block_size=16, prompt_lens=[40, 19], part_keys=32, cache_dtype="float8_e4m3fn")
_case("det_launch_configs", "det-attention-launch-configs")
_case("det_precompile", "det-precompile-compiles-the-merge-kernel")


def _tol(dtype: Any) -> dict[str, float]:
    import torch

    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _check_matmul(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import matmul_ref
    from tokenmill.kernels.triton.matmul import MatmulConfig, matmul, matmul_config

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(21)
    for m, n, k, with_bias in p["shapes"]:
        weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
        wide = torch.randn(m, k + 24, generator=gen).to(dtype)
        x = wide[:, 8 : 8 + k]  # rows strided by k + 24
        for config in (matmul_config(m, n, k, dtype), MatmulConfig(16, 32, 16, 4, 1, group_m=2)):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            got = matmul(x, weight, bias, out=out, config=config)
            assert got is out
            torch.testing.assert_close(got, matmul_ref(x, weight, bias), **_tol(dtype), msg=lambda s: f"{config}: {s}")


def _check_matmul_invariance(p: dict[str, Any]) -> None:
    import torch

    from support.triton_interpreter import interpreter_dot_in_fixed_order
    from tokenmill.kernels.triton import matmul as module
    from tokenmill.kernels.triton.matmul import matmul

    dtype = getattr(torch, p["dtype"])
    # The engine's tile follows M (64 x 64 for few programs, 128 x 128 for many); the rows here are
    # too few to reach the switch, so both tiles also run explicitly: a row's bits must not depend
    # on which of them computed it either.
    tiles = [None] if dtype == torch.float32 else [None, module._SMALL_TILE, module._LARGE_TILE]
    gen = torch.Generator().manual_seed(22)
    n, k = p["n"], p["k"]
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    row = torch.randn(1, k, generator=gen).to(dtype)
    with interpreter_dot_in_fixed_order():
        expected = matmul(row, weight, bias)
        for m in p["rows"]:
            for place in sorted({0, m // 2, m - 1}):
                x = torch.randn(m, k, generator=gen).to(dtype)
                x[place] = row[0]
                for tile in tiles:
                    got = matmul(x, weight, bias, config=tile)[place]
                    assert torch.equal(got, expected[0]), f"row at {place} of {m}, {tile}: max diff {(got - expected[0]).abs().max()}"


def _check_attention(p: dict[str, Any]) -> None:
    """Every prompt prefilled whole; then its tokens again as decodes, chunks and mixed batches."""
    import dataclasses

    import torch

    from tokenmill.kernels import reference
    from support.kernel_cases import make_paged_batch
    from support.triton_interpreter import interpreter_dot_in_fixed_order
    from tokenmill.kernels.triton.paged_attention import choose_config, paged_attention

    dtype = getattr(torch, p["dtype"])
    lens = p["prompt_lens"]
    batch = make_paged_batch(
        lens, lens, num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
        block_size=p["block_size"], dtype=dtype, seed=sum(lens), cache_dtype=getattr(torch, p.get("cache_dtype", p["dtype"])),
    )
    cache = batch.kv_cache.clone()
    reference.store_kv_ref(batch.k, batch.v, cache, batch.slot_mapping)
    scale = p["head_dim"] ** -0.5
    config = choose_config(
        num_tokens=sum(lens), num_seqs=len(lens), num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"], dtype=dtype, max_query_len=max(lens), max_seq_len=max(lens), device=torch.device("cpu"),
        deterministic=True,
    )
    config = dataclasses.replace(config, part_keys=p["part_keys"], tile_n=p.get("tile_n", 16))
    first = [sum(lens[:i]) for i in range(len(lens))]  # row of each prompt's position 0 in the whole batch

    def launch(items: list[tuple[int, int, int]], splits: int, pad: int = 0) -> torch.Tensor:
        """items: (prompt, first position, count) -> those tokens' outputs (pad extra unwritten rows)."""
        rows = [first[s] + pos for s, start, count in items for pos in range(start, start + count)]
        q = torch.cat([batch.q[rows], batch.q[:pad]])
        starts = [0]
        for _, _, count in items:
            starts.append(starts[-1] + count)
        seq_lens = [start + count for _, start, count in items]
        out = torch.full_like(q, float("nan"))
        # As the backend passes it: the leading one-token sequences (the default mode's decode launch).
        num_decode_seqs = next((i for i, (_, _, count) in enumerate(items) if count != 1), len(items))
        paged_attention(
            q, cache, torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
            batch.block_tables[[s for s, _, _ in items]], scale, max_query_len=max(c for _, _, c in items),
            max_seq_len=max(lens), num_decode_seqs=num_decode_seqs, out=out,
            config=dataclasses.replace(config, num_splits=splits),
        )
        assert torch.isnan(out[len(rows):]).all(), "padding rows were written"
        return out[: len(rows)], rows

    whole = [(s, 0, n) for s, n in enumerate(lens)]
    expected = reference.paged_attention_ref(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    with interpreter_dot_in_fixed_order():
        full, rows = launch(whole, 1)
        assert rows == list(range(sum(lens)))
        torch.testing.assert_close(full, expected, **_tol(dtype))
        runs = [
            (whole, 2),  # the same prefill with two programs sharing the parts
            ([(s, pos, 1) for s, n in enumerate(lens) for pos in (0, n // 3, n - 1)], 1),  # decodes side by side
            ([(0, lens[0] - 1, 1)], 3),  # one decode alone, its parts over three programs
            ([(0, 5, lens[0] - 5), *((s, n - 1, 1) for s, n in enumerate(lens) if s)], 1),  # a chunk beside decodes
            ([*((s, n - 1, 1) for s, n in enumerate(lens) if s), (0, 5, lens[0] - 5)], 2),  # decodes first, one launch
            ([(s, 1, n // 2) for s, n in enumerate(lens)] + [(0, 0, 1)], 2),  # first halves after a 1-token prefix
        ]
        for items, splits in runs:
            got, rows = launch(items, splits, pad=2)
            want = full[rows]  # the whole-prompt launch holds every prompt's tokens in order
            assert torch.equal(got, want), f"{items} with {splits} split programs: max diff {(got - want).abs().max()}"


def _check_launch_configs(p: dict[str, Any]) -> None:
    import dataclasses
    import random

    import torch

    from tokenmill.kernels.triton.paged_attention import choose_config, choose_configs, launch_configs

    rng = random.Random(1)
    cpu = torch.device("cpu")
    for heads, kv_heads, dim, dtype in [(16, 8, 128, torch.bfloat16), (6, 2, 256, torch.bfloat16), (32, 2, 128, torch.float32)]:
        for max_model_len in (256, 4096):
            (listed,) = {dataclasses.replace(c, num_splits=1) for c in launch_configs(
                num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, max_seq_len=max_model_len, deterministic=True)}
            splits = set()
            for _ in range(500):
                num_seqs = rng.choice([1, 2, rng.randint(1, 1024)])
                max_query_len = rng.choice([1, 1, 7, rng.randint(1, max_model_len)])
                config = choose_config(
                    num_tokens=num_seqs * max_query_len, num_seqs=num_seqs, num_heads=heads, num_kv_heads=kv_heads,
                    head_dim=dim, dtype=dtype, max_query_len=max_query_len, max_seq_len=rng.randint(max_query_len, max_model_len),
                    device=cpu, deterministic=True,
                )
                # One compiled variant for every step: only the (run-time) number of split programs varies.
                assert dataclasses.replace(config, num_splits=1) == listed, (config, listed)
                # A mixed step stays one launch: no decode tile of its own for its leading decodes.
                assert choose_configs(
                    num_tokens=num_seqs * max_query_len, num_seqs=num_seqs + 1, num_decode_seqs=1, num_heads=heads,
                    num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, max_query_len=max_query_len,
                    max_seq_len=max_model_len, device=cpu, deterministic=True,
                )[0] is None
                splits.add(config.num_splits)
            assert (max(splits) > 1) == (max_model_len > listed.part_keys), splits


def _check_precompile(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels.triton import paged_attention as pa

    launched = []
    real = pa.launcher

    def spy(kernel: Any, grid: Any, compile_only: bool) -> Any:
        assert compile_only
        launched.append(kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__)
        return real(kernel, grid, compile_only)

    pa.launcher = spy
    try:
        TritonAttentionBackend(deterministic=True).precompile(4, torch.zeros(2, 1, 16, 2, 64, dtype=torch.float16), torch.float16, 1024)
    finally:
        pa.launcher = real
    # The one-program variant, then the several-program one with its merge.
    assert launched == ["_paged_attention_fixed_split_kernel"] * 2 + ["_merge_parts_kernel"], launched


CHECKS = {
    "det_matmul": _check_matmul,
    "det_matmul_invariance": _check_matmul_invariance,
    "det_attention": _check_attention,
    "det_launch_configs": _check_launch_configs,
    "det_precompile": _check_precompile,
}
