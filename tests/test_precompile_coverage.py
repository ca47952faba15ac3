"""``LLM()``'s ahead-of-time compilation covers what the steps launch, checked on the CPU.

Triton picks a compiled kernel by a key of its argument types, constexprs and specialisations (an
int equal to 1 becomes a constant, ints and pointers divisible by 16 get a hint), so a launch
whose key was not precompiled compiles in the middle of a run. Here Triton's own binder computes
the keys, as on the GPU, under a stand-in driver that reports an sm_90 device and a
``jit_cache_hook`` that records each key instead of compiling: ``Sampler.precompile``, the
attention backend's ``precompile`` and the MoE layers' ``precompile_experts`` (and their routers'
``route_top_k``) against the launches
of steps at many batch sizes, both vocabularies of P1-P4, every sampler path and MoE shape. Also that ``parallel_compile`` leaves each kernel
loaded, its launcher built (a first launch would otherwise build it: ~0.4 s of C compiler each on
a cold Triton cache).

Like ``kernel_compile_sm90.py`` the checks run in a worker process (this file with ``--worker``)
WITHOUT ``TRITON_INTERPRET``: the pytest process never imports triton.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "PRECOMPILE-RESULTS:"
CHECKS = ("sampler", "attention", "attention_queue", "moe", "load")


@pytest.fixture(scope="module")
def worker_results() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, __file__, "--worker"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert lines, f"the worker reported nothing (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


@pytest.mark.parametrize("check", CHECKS)
def test_precompile_covers_the_steps(worker_results: dict[str, Any], check: str) -> None:
    result = worker_results[check]
    if isinstance(result, str) and result.startswith("SKIP"):
        pytest.skip(result)
    assert result is None, result


# ---- the worker -------------------------------------------------------------------------------

class _Sm90Driver:
    """Enough of Triton's CUDA driver for keys, compiles and loads on a machine without a GPU."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.launchers_built: list[str] = []
        self.loaded: list[str] = []
        driver = self

        class Launcher:
            def __init__(self, src: Any, metadata: Any) -> None:
                driver.launchers_built.append(metadata.name)

        def load_binary(name: str, *_: Any) -> tuple[int, int, int, int, int]:
            driver.loaded.append(name)
            return 1, 1, 32, 0, 1024  # module, function, registers, spills, max threads

        self.launcher_cls = Launcher
        self.utils = SimpleNamespace(load_binary=load_binary,
                                     get_device_properties=lambda device: {"max_shared_mem": 232448})

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class _KeyRecorder:
    """Records (kernel, key) of every launch that would compile, and compiles nothing."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, str]] = []

    def __call__(self, *, key: str, fn: Any, **_: Any) -> bool:
        self.keys.append((fn.name, key))
        return True  # tells Triton to skip the compilation

    def of(self, call: Any) -> list[tuple[str, str]]:
        self.keys = []
        call()
        return self.keys


def _missing(precompiled: list[tuple[str, str]], runs: dict[Any, list[tuple[str, str]]]) -> str | None:
    known = set(precompiled)
    missing = {(name, key): case for case, keys in runs.items() for name, key in keys if (name, key) not in known}
    assert precompiled and all(runs.values()), "a call launched nothing"
    if not missing:
        return None
    return "launched but not precompiled:\n" + "\n".join(f"  {name} at {case}: {key}" for (name, key), case in missing.items())


def _check_sampler(recorder: _KeyRecorder) -> str | None:
    """Every sampling path (and the sampled tokens' logprobs) at batch sizes from 1 to 3,000 rows, with
    the step tensors built by the runner's own helpers (16-byte aligned columns), against
    ``Sampler.precompile``."""
    import torch

    from tokenmill.kernels.sampling_args import Filters, RowState, counts_width
    from tokenmill.kernels.triton.sampling import sample_tokens
    from tokenmill.kernels.triton.token_logprobs import token_logprobs
    from tokenmill.worker.model_runner import ModelRunner
    from tokenmill.worker.sampler import Sampler

    class HostRunner:  # the runner's step-tensor helpers, without a device
        _pin = False
        _to_device, _tensor, _columns = ModelRunner._to_device, ModelRunner._tensor, ModelRunner._columns

    runner = HostRunner()

    def step(rows: int, vocab: int, filtered: bool, top_p_alone: bool, has_state: bool) -> None:
        floats = [[0.7] * rows] + ([[0.95] * rows, [0.0] * rows] if filtered else [])
        floats = runner._columns(floats, torch.float32)
        keys, counters = runner._columns([[7] * rows, [3] * rows], torch.int64)
        filters = Filters(runner._tensor([100] * rows, torch.int64), floats[1], floats[2]) if filtered else None
        state = None
        if has_state:
            slots = rows + 5
            bias_slots, penalty_slots = runner._columns([[-1] * rows, list(range(rows))], torch.int32)
            # torch.empty: the tables' memory is never touched (3,005 x 151,936 would be 1.8 GB each).
            state = RowState(bias_slots, torch.empty(slots, vocab), penalty_slots,
                             torch.empty(slots, counts_width(vocab), dtype=torch.int16),
                             torch.empty(slots, -(-vocab // 32), dtype=torch.int32),
                             *(torch.ones(slots) for _ in range(3)))  # the penalty factors, per slot (PenaltyState)
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16)
        sample_tokens(logits, floats[0], keys, counters, filters, state, top_p_alone=top_p_alone)
        for top in (False, True):  # a step with logprobs 0 or 1: the sampled tokens' logprobs
            token_logprobs(logits, torch.zeros(rows, dtype=torch.int64), top)

    problems = []
    for vocab in (151936, 128256):
        precompiled = recorder.of(lambda: Sampler.precompile(vocab, torch.bfloat16, torch.device("cpu")))
        runs = {
            (rows, vocab, filtered, alone, has_state): recorder.of(lambda: step(rows, vocab, filtered, alone, has_state))
            for rows, (filtered, alone), has_state in itertools.product(
                (1, 2, 17, 256, 768, 3000), ((False, True), (True, True), (True, False)), (False, True))
        }
        problems.append(_missing(precompiled, runs))
    return "\n".join(p for p in problems if p) or None


def _check_attention(recorder: _KeyRecorder) -> str | None:
    """Decode, prefill and mixed steps (Qwen3-0.6B's heads) at contexts up to max_model_len
    against ``TritonAttentionBackend.precompile``."""
    import torch

    from tokenmill.attention.triton_backend import TritonAttentionBackend
    from tokenmill.kernels.triton.paged_attention import paged_attention

    heads, kv_heads, dim, block, max_model_len = 16, 8, 128, 16, 4096
    cache = torch.empty((2, 64, block, kv_heads, dim), dtype=torch.bfloat16)
    precompiled = recorder.of(lambda: TritonAttentionBackend().precompile(
        heads, torch.empty((2, 1, block, kv_heads, dim), dtype=torch.bfloat16), torch.bfloat16, max_model_len))

    def step(seqs: int, query_len: int, decodes: int, max_seq_len: int) -> None:
        lens = [1] * decodes + [query_len] * (seqs - decodes)
        q = torch.empty((sum(lens), heads, dim), dtype=torch.bfloat16)  # the qkv prologue's output
        paged_attention(q, cache, torch.zeros(seqs + 1, dtype=torch.int32), torch.zeros(seqs, dtype=torch.int32),
                        torch.zeros((seqs, max_model_len // block), dtype=torch.int32), dim**-0.5,
                        max_query_len=max(lens), max_seq_len=max_seq_len, num_decode_seqs=decodes)

    runs = {}
    for seqs, query_len, mixed, max_seq_len in itertools.product((1, 2, 17, 256, 768), (1, 7, 300), (False, True),
                                                                  (1, 100, 1000, max_model_len)):
        if not (mixed and (query_len == 1 or seqs == 1)):
            case = (seqs, query_len, seqs // 2 if mixed else 0, max_seq_len)
            runs[case] = recorder.of(lambda: step(*case))
    return _missing(precompiled, runs)


def _check_attention_queue(recorder: _KeyRecorder) -> str | None:
    """Decode steps through the item-queue kernel (pure ones at batch sizes 1-1,024 and block tables
    of three widths, and a mixed step's leading decodes) over a bf16 and an fp8 cache, on a backend
    that takes the queue for every step's decodes, against its precompile."""
    import torch

    from tokenmill.attention.metadata import AttentionMetadata
    from tokenmill.attention.triton_backend import TritonAttentionBackend

    heads, kv_heads, dim, block = 16, 8, 128, 16
    backend = TritonAttentionBackend(decode_queue=True)
    precompiled, runs = [], {}
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.empty((2, 64, block, kv_heads, dim), dtype=cache_dtype)
        precompiled += recorder.of(lambda: backend.precompile(
            heads, torch.empty((2, 1, block, kv_heads, dim), dtype=cache_dtype), torch.bfloat16, 4096))

        def step(seqs: int, max_blocks: int, chunk: int) -> None:
            lens = [1] * seqs + [chunk] * (chunk > 0)
            starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            meta = AttentionMetadata(
                slot_mapping=torch.zeros(starts[-1].item(), dtype=torch.int64), query_start_loc=starts,
                seq_lens=torch.ones(len(lens), dtype=torch.int32),
                block_tables=torch.zeros((len(lens), max_blocks), dtype=torch.int32), block_size=block,
                query_lens_host=lens, seq_lens_host=[4096] * len(lens), max_query_len=max(lens), max_seq_len=4096,
            )
            backend.attend(torch.empty((sum(lens), heads, dim), dtype=torch.bfloat16), cache, meta, dim**-0.5)

        for case in itertools.product((1, 2, 17, 256, 1024), (1, 256, 300), (0, 7)):
            runs[(str(cache_dtype), *case)] = recorder.of(lambda: step(*case))
    return _missing(precompiled, runs)


def _check_moe(recorder: _KeyRecorder) -> str | None:
    """The MoE layers' grouped GEMMs and alignment at every token count up to the step budget (both
    tile classes, both ways of aligning) against ``precompile_experts``, as the layers call both:
    Qwen3-30B-A3B's and Mixtral-8x7B's experts in bf16, on fp8 codes, and in deterministic mode."""
    import torch

    from tokenmill.kernels.triton.fused_moe import fused_experts, precompile_experts

    problems = []
    for (experts, top_k, hidden, inter), budget in (((128, 8, 2048, 768), 8192), ((8, 2, 4096, 14336), 16384),
                                                    ((128, 8, 2048, 768), 512)):
        for fp8, batch_invariant in ((False, False), (True, False), (False, True)):
            stored = torch.float8_e4m3fn if fp8 else torch.bfloat16
            # torch.empty: untouched memory (Mixtral's w13 would be 1.9 GB).
            w13, w2 = torch.empty((experts, 2 * inter, hidden), dtype=stored), torch.empty((experts, hidden, inter), dtype=stored)
            scales = dict(w13_scale=torch.ones(experts, 2 * inter), w2_scale=torch.ones(experts, hidden)) if fp8 else {}
            precompiled = recorder.of(lambda: precompile_experts(w13, w2, top_k, budget, torch.bfloat16, batch_invariant, **scales))

            def step(tokens: int) -> None:
                ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)  # valid, spread
                fused_experts(torch.zeros((tokens, hidden), dtype=torch.bfloat16), w13, w2, torch.ones((tokens, top_k)), ids,
                              batch_invariant=batch_invariant, **scales)

            sizes = sorted({t for t in (1, 2, 7, 16, 17, 64, 200, 256, 257, 300, 1024, 1025, 2048, 4096, 8192, budget)
                            if t <= budget})
            runs = {(experts, fp8, batch_invariant, t): recorder.of(lambda t=t: step(t)) for t in sizes}
            problems.append(_missing(precompiled, runs))
    # The router's one variant (moe_routing.route_top_k, compiled by Router.compile_variants from a
    # one-token call) against its launches at every step size.
    for experts, top_k, renormalize in ((128, 8, True), (8, 2, True), (60, 4, False)):
        precompiled = recorder.of(lambda: _route(1, experts, top_k, renormalize, compile_only=True))
        runs = {(experts, t): recorder.of(lambda t=t: _route(t, experts, top_k, renormalize)) for t in (1, 2, 16, 17, 300, 8192)}
        problems.append(_missing(precompiled, runs))
    return "\n".join(p for p in problems if p) or None


def _route(tokens: int, experts: int, top_k: int, renormalize: bool, compile_only: bool = False) -> None:
    """``route_top_k`` over bf16 router logits, as ``Router.forward`` and ``Router.compile_variants`` call it."""
    import torch

    from tokenmill.kernels.triton.moe_routing import route_top_k

    route_top_k(torch.empty((tokens, experts), dtype=torch.bfloat16), top_k, renormalize, compile_only=compile_only)


def _check_load(driver: Any) -> str | None:
    """A compile-only launch inside ``parallel_compile`` leaves the kernel loaded and its launcher
    built, so its first real launch does neither."""
    import torch
    import triton
    import triton.language as tl

    from tokenmill.kernels.triton.precompile import launcher, parallel_compile

    @triton.jit
    def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n), mask=offsets < n)

    x = torch.empty(1000)
    with parallel_compile(max_workers=2):
        launcher(_copy_kernel, (8,), compile_only=True)(x, x, 1000, BLOCK=128)
    # Built on the pool, then found again (in Triton's disk cache) by the load.
    assert set(driver.launchers_built) == {"_copy_kernel"}, f"launchers built: {driver.launchers_built}"
    assert driver.loaded == ["_copy_kernel"], f"binaries loaded: {driver.loaded}"
    built = len(driver.launchers_built)
    compiled = _copy_kernel.warmup(x, x, 1000, BLOCK=128, grid=(8,))  # the same key: the cached kernel
    assert compiled.module is not None, "the kernel's binary is not loaded"
    compiled.run  # what a launch reaches for first: builds and loads nothing more
    assert len(driver.launchers_built) == built and driver.loaded == ["_copy_kernel"]
    return None


def _worker_main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the worker must not interpret"
    import traceback

    results: dict[str, str | None] = {}
    try:
        from triton import knobs
        from triton.runtime.driver import driver as active

        driver = _Sm90Driver()
        active.set_active(driver)
    except Exception:  # noqa: BLE001  (a triton without these internals)
        reason = "SKIP: cannot stand in for Triton's driver here: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
        print(RESULT_PREFIX + json.dumps({name: reason for name in CHECKS}), flush=True)
        return
    recorder = _KeyRecorder()
    checks = {"sampler": lambda: _check_sampler(recorder), "attention": lambda: _check_attention(recorder),
              "attention_queue": lambda: _check_attention_queue(recorder), "moe": lambda: _check_moe(recorder),
              "load": lambda: _check_load(driver)}
    for name in CHECKS:
        start = time.perf_counter()
        knobs.runtime.jit_cache_hook = None if name == "load" else recorder  # "load" compiles for real
        try:
            results[name] = checks[name]()
        except Exception:  # noqa: BLE001
            results[name] = traceback.format_exc()
        print(f"{name}: {'ok' if results[name] is None else 'FAIL'} {time.perf_counter() - start:.2f}s", flush=True)
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
