"""Triton kernels against their plain-torch twins, on the CPU under the Triton interpreter.

Why subprocesses: ``TRITON_INTERPRET=1`` only takes effect if it is set before triton is
imported, and the CI suite runs every test in one pytest process. Setting it in this module would
depend on import order and would leak into other tests, so the kernel checks run in fresh worker
processes (this file run as a script) that get the variable in their environment. The pytest
process itself never imports triton. The workers share the cases, the slowest first: one starts
as soon as a session's tests are collected and runs beside the other tests, which run first; a
second joins it when these tests' turn comes (``support/kernel_workers.py``). To time cases by
hand, run them in one worker:
``TRITON_INTERPRET=1 python tests/test_kernels_interpret.py --worker '["name", ...]'`` prints each
one's seconds.

Every check uses random inputs, poisons outputs (NaN) before the kernel runs and compares with
``tokenmill.kernels.reference``; the interpreter is slow, so token counts are tiny. bf16 is skipped
here (the interpreter's bf16 is not trustworthy); tests/gpu/ covers it on CUDA.

This file holds the harness and the per-token kernels' cases and checks (KV store, RMSNorm,
LayerNorm, rotary, the qkv prologue, SiLU-mul); each other kernel family brings its ``CASES`` and
``CHECKS`` from a module of its own, merged here: ``kernel_checks_paged_attention.py``,
``kernel_checks_attention_queue.py``, ``kernel_checks_varlen_attention.py``,
``kernel_checks_sampling.py``, ``quant_kernel_checks.py``, ``kernel_checks_block_fp8.py``,
``kernel_checks_deterministic.py``.

The same harness also reports the sm_90 compile checks (``kernel_compile_sm90.py``), whose
worker compiles real-hardware shapes with Triton's compiler and ptxas instead of interpreting.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

import kernel_checks_deterministic as deterministic
import kernel_checks_attention_queue
import kernel_checks_block_fp8
import kernel_checks_moe
import kernel_checks_paged_attention
import kernel_checks_sampling
import kernel_checks_varlen_attention
import kernel_compile_sm90 as sm90
import quant_kernel_checks
from support.kernel_workers import RESULT_PREFIX, KernelWorkers, claimed


# ----------------------------------------------------------------------------------------------
# The cases: plain data, so collecting this file needs neither triton nor torch.
# ----------------------------------------------------------------------------------------------
CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


for _dt in ("float32", "float16"):
    _case("kv_store", f"kvstore-bs16-{_dt}", dtype=_dt, cache_dtype=_dt, block_size=16, num_kv_heads=2, head_dim=64, tokens=9)
    _case("rms_norm", f"rmsnorm-2d-{_dt}", dtype=_dt, shape=[5, 96], residual=False, strided=False)
    _case("rms_norm", f"rmsnorm-residual-{_dt}", dtype=_dt, shape=[7, 256], residual=True, strided=False)
    _case("rms_norm", f"rmsnorm-heads-strided-{_dt}", dtype=_dt, shape=[3, 4, 64], residual=False, strided=True)
    _case("layer_norm", f"layernorm-residual-d384-{_dt}", dtype=_dt, shape=[7, 384], residual=True)
    _case("layer_norm", f"layernorm-plain-d96-{_dt}", dtype=_dt, shape=[5, 96], residual=False)
    _case("rotary", f"rope-full-{_dt}", dtype=_dt, tokens=5, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=64)
    _case("rotary", f"rope-partial-{_dt}", dtype=_dt, tokens=3, num_heads=3, num_kv_heads=1, head_dim=64, rotary_dim=48)
    # The fused qkv prologue (norm, rope, store): GQA 1/2/4, head_dim 64/128, blocks 16/32, with and
    # without qk-norm, padding slots, a strided qkv (whole layers: kernel_checks_paged_attention.py).
    _case("qkv_prologue", f"qkvpro-g1-d64-bs16-norm-{_dt}", dtype=_dt, tokens=7, num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, norm=True, strided=False)
    _case("qkv_prologue", f"qkvpro-g2-d128-bs32-nonorm-strided-{_dt}", dtype=_dt, tokens=6, num_heads=4, num_kv_heads=2, head_dim=128, block_size=32, norm=False, strided=True)
    _case("qkv_prologue", f"qkvpro-g4-d64-bs32-norm-strided-{_dt}", dtype=_dt, tokens=5, num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, norm=True, strided=True)
    _case("qkv_prologue", f"qkvpro-g4-d128-bs16-nonorm-{_dt}", dtype=_dt, tokens=4, num_heads=4, num_kv_heads=1, head_dim=128, block_size=16, norm=False, strided=False)
    _case("silu_and_mul", f"silu-2d-{_dt}", dtype=_dt, shape=[3, 192])
    _case("silu_and_mul", f"silu-3d-{_dt}", dtype=_dt, shape=[2, 3, 2600])

_case("kv_store", "kvstore-bs32-f32-into-f16", dtype="float32", cache_dtype="float16", block_size=32, num_kv_heads=3, head_dim=128, tokens=7)
_case("kv_store", "kvstore-bs16-d32-float32", dtype="float32", cache_dtype="float32", block_size=16, num_kv_heads=1, head_dim=32, tokens=4)
_case("rms_norm", "rmsnorm-residual-inplace-float32", dtype="float32", shape=[4, 64], residual=True, strided=False, inplace=True)
# Several programs per head kind (32 heads of 128: two groups each of q, k, v), an odd group (3 q
# heads a kv head) with head_dim 256, and fp32 activations stored into an fp16 cache.
_case("qkv_prologue", "qkvpro-mha32-d128-bs16-norm-float32", dtype="float32", tokens=3, num_heads=32, num_kv_heads=32, head_dim=128, block_size=16, norm=True, strided=False)
_case("qkv_prologue", "qkvpro-g3-d256-bs16-norm-float16", dtype="float16", tokens=3, num_heads=6, num_kv_heads=2, head_dim=256, block_size=16, norm=True, strided=True)
_case("qkv_prologue", "qkvpro-f32-into-f16-cache", dtype="float32", cache_dtype="float16", tokens=5, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, norm=True, strided=False)
_case("lazy_import", "import-tokenmill-does-not-import-triton")

CASES.update(kernel_checks_paged_attention.CASES)  # paged attention, its backend and layers
CASES.update(kernel_checks_attention_queue.CASES)  # the item-queue decode attention
CASES.update(kernel_checks_varlen_attention.CASES)  # varlen attention and pooling models through it
CASES.update(kernel_checks_sampling.CASES)  # the Gumbel-max draw, penalties and filters
CASES.update(quant_kernel_checks.CASES)  # the quantized GEMMs: tests/quant_kernel_checks.py
CASES.update(kernel_checks_block_fp8.CASES)  # block-wise fp8: tests/kernel_checks_block_fp8.py
CASES.update(sm90.CASES)  # compiled for sm_90, not run: tests/kernel_compile_sm90.py
CASES.update(deterministic.CASES)  # deterministic mode's kernels: tests/kernel_checks_deterministic.py
CASES.update(kernel_checks_moe.CASES)  # the fused mixture-of-experts kernels: tests/kernel_checks_moe.py

# The slowest cases under the interpreter (CPU seconds each, measured in one worker on a busy 2-core
# machine; together about half of the interpreter's time): marked slow, so `-m "not slow"` leaves
# them out (CI runs them), and taken first by the workers, so that neither is left with a long one
# at the end.
SLOW_CASES = {
    "sample-tokens-rounds-v9000-float32": 26, "sample-tokens-wide-v9000-float32": 18,
    "sample-tokens-wide-v5003-float16": 13, "attn-random3-float32": 13, "sample-tokens-wide-v5003-float32": 10,
    "attn-mixed-260seqs-bq4-float16": 10, "attn-decode-260seqs-g2-d32-float32": 7,
    "attn-p5-mixed-auto-bs16-g2-d128-float32": 7,
    "pooling-varlen-bert-and-qwen3-vs-transformers": 6, "det-attn-g2-d32-bs16-float32": 6, "moe-align-int32": 6,
    "det-attn-g1-d32-bs16-tile32-float16": 5, "det-attn-g2-d64-bs16-fp8cache-float16": 5,
    "attn-prefill-auto-bs16-g4-d128-float32": 5, "det-attn-g3-d64-bs8-float16": 5,
}
assert SLOW_CASES.keys() <= CASES.keys(), "a slow case that is not a case"


# ----------------------------------------------------------------------------------------------
# pytest side: run the selected cases in worker processes once, then report one test per case.
# ----------------------------------------------------------------------------------------------
_WORKERS = pytest.StashKey[KernelWorkers]()


def start_workers(session: pytest.Session) -> None:
    """Start the worker processes of the cases ``session`` selected, if any (conftest.py calls this
    once the tests are collected: they run while the other tests do, which run first)."""
    selected = [
        item.callspec.params["name"]
        for item in session.items
        if getattr(item, "module", None) is sys.modules[__name__] and hasattr(item, "callspec") and "name" in item.callspec.params
    ]
    if not selected or _WORKERS in session.stash:
        return
    compiled = [n for n in selected if CASES[n][0] == "compile_sm90"]
    interpreted = sorted((n for n in selected if CASES[n][0] != "compile_sm90"), key=lambda n: -SLOW_CASES.get(n, 0))
    session.stash[_WORKERS] = KernelWorkers(interpreted, compiled, Path(__file__).resolve(), Path(sm90.__file__).resolve())


def stop_workers(session: pytest.Session) -> None:
    """End what is still running of the session's workers (conftest.py, at the session's end)."""
    if _WORKERS in session.stash:
        session.stash[_WORKERS].stop()


@pytest.fixture(scope="module")
def interpreter_results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    start_workers(request.session)  # (started already, unless this file's tests run without conftest.py)
    return request.session.stash[_WORKERS].results()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_kernel_matches_reference_under_interpreter(name: str, interpreter_results: dict[str, str | None]) -> None:
    if name not in interpreter_results:
        pytest.fail(f"worker returned no result for {name}")
    error = interpreter_results[name]
    if error is not None and error.startswith("SKIP:"):
        pytest.skip(error[5:].strip())
    if error is not None:
        pytest.fail(error, pytrace=False)


def test_reference_attention_matches_torch_backend() -> None:
    """The twin the kernels are held to must itself agree with the CPU backend (decode and mixed)."""
    import torch

    from tokenmill.attention.torch_backend import TorchAttentionBackend
    from tokenmill.kernels.reference import paged_attention_ref, store_kv_ref
    from support.kernel_cases import make_paged_batch

    # Query heads per kv head 2, 3 (SmolLM2's 9 / 3), 1 and 4; a decode step in bf16 too (the CPU's
    # default dtype where it multiplies bf16 natively), held to the fp32 twin at bf16's resolution.
    cases = [(4, 2, torch.float32), (6, 2, torch.float32), (4, 4, torch.float32), (8, 2, torch.float32),
             (6, 2, torch.bfloat16)]
    for num_heads, num_kv_heads, dtype in cases:
        for query_lens, seq_lens in (([1, 1, 1], [5, 17, 40]), ([1, 7, 3, 2], [16, 7, 35, 2])):
            batch = make_paged_batch(query_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                                     block_size=16, dtype=dtype, seed=3)
            cache_a, cache_b = batch.kv_cache.clone(), batch.kv_cache.clone()
            expected = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, cache_a, batch.metadata(), 0.2)
            store_kv_ref(batch.k, batch.v, cache_b, batch.slot_mapping)
            assert torch.equal(cache_a, cache_b)
            got = paged_attention_ref(batch.q.float(), cache_b.float(), batch.query_start_loc, batch.seq_lens,
                                      batch.block_tables, 0.2)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, expected.float(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------------------------
# Worker side (runs with TRITON_INTERPRET=1 already in the environment).
# ----------------------------------------------------------------------------------------------
def _tol(dtype: Any) -> dict[str, float]:
    import torch

    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


def _check_kv_store(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import store_kv_ref
    from tokenmill.kernels.triton.kv_store import store_kv

    dtype, cache_dtype = getattr(torch, p["dtype"]), getattr(torch, p["cache_dtype"])
    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim, bs = p["tokens"], p["num_kv_heads"], p["head_dim"], p["block_size"]
    num_blocks = 4
    cache = torch.randn((2, num_blocks, bs, heads, dim), generator=gen).to(cache_dtype)
    # k and v as strided views of a fused qkv projection output (2 query heads in front).
    qkv = torch.randn((tokens, (2 + 2 * heads) * dim), generator=gen).to(dtype)
    k = qkv[:, 2 * dim : (2 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (2 + heads) * dim :].view(tokens, heads, dim)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[1::3] = -1  # padding tokens scattered through the batch
    expected = cache.clone()
    store_kv_ref(k, v, expected, slots)
    store_kv(k, v, cache, slots)
    assert torch.equal(cache, expected)


def _check_rms_norm(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels import reference
    from tokenmill.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(7)
    shape = p["shape"]
    n = shape[-1]
    weight = (1.0 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    if p["strided"]:  # per-head norm of q inside a fused qkv output: [T, heads, D] with a token stride
        t, heads, d = shape
        qkv = torch.randn((t, (heads + 3) * d), generator=gen).to(dtype) * 3
        x = qkv[:, :heads * d].view(t, heads, d)
    else:
        x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    tol = _tol(dtype)
    if not p["residual"]:
        out = torch.full(x.shape, float("nan"), dtype=dtype)
        got = rms_norm(x, weight, 1e-6, out=out)
        assert got is out
        torch.testing.assert_close(got, reference.rms_norm_ref(x, weight, 1e-6), **tol)
        return
    residual = torch.randn(shape, generator=gen).to(dtype)
    exp_out, exp_res = reference.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out = torch.full_like(x, float("nan"))
    if p.get("inplace"):
        res_out = residual  # the runner's pattern: the residual stream updated in place
    else:
        res_out = torch.full_like(x, float("nan"))
    got_out, got_res = fused_add_rms_norm(x, residual, weight, 1e-5, out=out, residual_out=res_out)
    assert got_out is out and got_res is res_out
    torch.testing.assert_close(got_res, exp_res, atol=0, rtol=0)
    torch.testing.assert_close(got_out, exp_out, **tol)


def _check_layer_norm(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import add_layer_norm_ref
    from tokenmill.kernels.triton.layernorm import add_layer_norm

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(19)
    rows, n = p["shape"]
    # x a strided view (a wider buffer's left part), values off-centre so the mean matters.
    x = (torch.randn((rows, n + 32), generator=gen) * 3 + 1.5).to(dtype)[:, :n]
    residual = torch.randn((rows, n), generator=gen).to(dtype) if p["residual"] else None
    weight = (1.0 + 0.3 * torch.randn(n, generator=gen)).to(dtype)
    bias = (0.5 * torch.randn(n, generator=gen)).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    got = add_layer_norm(x, residual, weight, bias, 1e-12, out=out)
    assert got is out
    torch.testing.assert_close(got, add_layer_norm_ref(x, residual, weight, bias, 1e-12), **_tol(dtype))


def _check_rotary(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import rotary_embedding_ref_
    from support.kernel_cases import rope_cos_sin_cache
    from tokenmill.kernels.triton.rotary import rotary_embedding_

    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(9)
    t, hq, hk, d = p["tokens"], p["num_heads"], p["num_kv_heads"], p["head_dim"]
    cache = rope_cos_sin_cache(4096, p["rotary_dim"])
    positions = torch.randint(0, 4096, (t,), generator=gen)
    qkv = torch.randn((t, (hq + 2 * hk) * d), generator=gen).to(dtype)
    expected = qkv.clone()
    for buf, fn in ((expected, rotary_embedding_ref_), (qkv, rotary_embedding_)):
        q = buf[:, : hq * d].view(t, hq, d)
        k = buf[:, hq * d : (hq + hk) * d].view(t, hk, d)
        fn(positions, q, k, cache)
    torch.testing.assert_close(qkv, expected, **_tol(dtype))
    assert torch.equal(qkv[:, (hq + hk) * d :], expected[:, (hq + hk) * d :]), "v was touched"


def _check_qkv_prologue(p: dict[str, Any]) -> None:
    import torch

    from support.kernel_cases import make_qkv_prologue_case
    from tokenmill.kernels.triton.qkv_prologue import qkv_prologue

    dtype = getattr(torch, p["dtype"])
    case = make_qkv_prologue_case(
        p["tokens"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
        block_size=p["block_size"], dtype=dtype, qk_norm=p["norm"], strided=p["strided"],
        cache_dtype=getattr(torch, p.get("cache_dtype", p["dtype"])), seed=17,
    )
    assert case.qkv.is_contiguous() != p["strided"]
    qkv_before, cache = case.qkv.clone(), case.kv_cache.clone()
    out = torch.full((p["tokens"], p["num_heads"], p["head_dim"]), float("nan"), dtype=dtype)
    got = qkv_prologue(*case.args(cache), out=out)
    assert got is out
    case.check(got, cache, qkv_before, **_tol(dtype))


def _check_silu_and_mul(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import silu_and_mul_ref
    from tokenmill.kernels.triton.activation import silu_and_mul

    dtype = getattr(torch, p["dtype"])
    x = (torch.randn(p["shape"], generator=torch.Generator().manual_seed(13)) * 2).to(dtype)
    out = torch.full((*x.shape[:-1], x.shape[-1] // 2), float("nan"), dtype=dtype)
    got = silu_and_mul(x, out=out)
    assert got is out
    torch.testing.assert_close(got, silu_and_mul_ref(x), **_tol(dtype))


def _check_lazy_import(p: dict[str, Any]) -> None:
    # Already verified at worker start, before anything imported triton (see _worker_main).
    assert p["triton_was_imported"] is False, "importing tokenmill's kernel-facing modules imported triton"


_CHECKS = {
    "kv_store": _check_kv_store,
    "rms_norm": _check_rms_norm,
    "rotary": _check_rotary,
    "layer_norm": _check_layer_norm,
    "silu_and_mul": _check_silu_and_mul,
    "qkv_prologue": _check_qkv_prologue,
    "lazy_import": _check_lazy_import,
    **kernel_checks_paged_attention.CHECKS,
    **kernel_checks_attention_queue.CHECKS,
    **kernel_checks_varlen_attention.CHECKS,
    **kernel_checks_sampling.CHECKS,
    **deterministic.CHECKS,
    **quant_kernel_checks.CHECKS,
    **kernel_checks_block_fp8.CHECKS,
    **kernel_checks_moe.CHECKS,
}


def _worker_main(names: list[str], queue: Path | None) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "worker must start with TRITON_INTERPRET=1"
    import torch

    torch.set_num_threads(1)
    import tokenmill.attention.triton_backend  # noqa: F401  (must stay triton-free at import)
    import tokenmill.kernels.reference  # noqa: F401

    try:
        import tokenmill  # noqa: F401  (the package root may still be a stub while others write it)
    except ImportError:
        pass
    triton_was_imported = "triton" in sys.modules
    from support.triton_interpreter import patch_triton_interpreter_for_numpy

    patch_triton_interpreter_for_numpy()

    results: dict[str, str | None] = {}
    for name in claimed(names, queue):
        check, params = CASES[name]
        if check == "lazy_import":
            params = {"triton_was_imported": triton_was_imported}
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            _CHECKS[check](params)
            results[name] = None
        except Exception:  # noqa: BLE001  (the report carries the traceback to pytest)
            results[name] = traceback.format_exc()
        print(f"{name}: {'ok' if results[name] is None else 'FAIL'} {time.perf_counter() - start:.2f}s "
              f"(cpu {time.process_time() - cpu_start:.2f}s)", flush=True)
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__" and len(sys.argv) in (3, 4) and sys.argv[1] == "--worker":
    _worker_main(json.loads(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) == 4 else None)
