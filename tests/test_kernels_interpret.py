"""Triton kernels against their plain-torch twins, on the CPU under the Triton interpreter.

Why subprocesses: ``TRITON_INTERPRET=1`` only takes effect if it is set before triton is
imported, and the CI suite runs every test in one pytest process. Setting it in this module would
depend on import order and would leak into other tests, so the kernel checks run in fresh worker
processes (this file run as a script) that get the variable in their environment. The pytest
process itself never imports triton. Two workers share the cases, one per core.

Every check uses random inputs, poisons outputs (NaN) before the kernel runs and compares with
``tokenmill.kernels.reference``; the interpreter is slow, so token counts are tiny. bf16 is skipped
here (the interpreter's bf16 is not trustworthy); tests/gpu/test_kernels_gpu.py covers it on CUDA.

The same harness also reports the sm_90 compile checks (``kernel_compile_sm90.py``), whose
worker compiles real-hardware shapes with Triton's compiler and ptxas instead of interpreting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

import kernel_checks_deterministic as deterministic
import kernel_compile_sm90 as sm90
import quant_kernel_checks

REPO = Path(__file__).resolve().parents[1]
_RESULT_PREFIX = sm90.RESULT_PREFIX

# ----------------------------------------------------------------------------------------------
# The cases: plain data, so collecting this file needs neither triton nor torch.
# ----------------------------------------------------------------------------------------------
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
    _case("kv_store", f"kvstore-bs16-{_dt}", dtype=_dt, cache_dtype=_dt, block_size=16, num_kv_heads=2, head_dim=64, tokens=9)
    _case("rms_norm", f"rmsnorm-2d-{_dt}", dtype=_dt, shape=[5, 96], residual=False, strided=False)
    _case("rms_norm", f"rmsnorm-residual-{_dt}", dtype=_dt, shape=[7, 256], residual=True, strided=False)
    _case("rms_norm", f"rmsnorm-heads-strided-{_dt}", dtype=_dt, shape=[3, 4, 64], residual=False, strided=True)
    _case("layer_norm", f"layernorm-residual-d384-{_dt}", dtype=_dt, shape=[7, 384], residual=True)
    _case("layer_norm", f"layernorm-plain-d96-{_dt}", dtype=_dt, shape=[5, 96], residual=False)
    _case("rotary", f"rope-full-{_dt}", dtype=_dt, tokens=5, num_heads=4, num_kv_heads=2, head_dim=64, rotary_dim=64)
    _case("rotary", f"rope-partial-{_dt}", dtype=_dt, tokens=3, num_heads=3, num_kv_heads=1, head_dim=64, rotary_dim=48)
    # The fused qkv prologue (norm, rope, store): GQA 1/2/4, head_dim 64/128, blocks 16/32, with and
    # without qk-norm, padding slots, a strided qkv; layers through both backends.
    _case("qkv_prologue", f"qkvpro-g1-d64-bs16-norm-{_dt}", dtype=_dt, tokens=7, num_heads=2, num_kv_heads=2, head_dim=64, block_size=16, norm=True, strided=False)
    _case("qkv_prologue", f"qkvpro-g2-d128-bs32-nonorm-strided-{_dt}", dtype=_dt, tokens=6, num_heads=4, num_kv_heads=2, head_dim=128, block_size=32, norm=False, strided=True)
    _case("qkv_prologue", f"qkvpro-g4-d64-bs32-norm-strided-{_dt}", dtype=_dt, tokens=5, num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, norm=True, strided=True)
    _case("qkv_prologue", f"qkvpro-g4-d128-bs16-nonorm-{_dt}", dtype=_dt, tokens=4, num_heads=4, num_kv_heads=1, head_dim=128, block_size=16, norm=False, strided=False)
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
    _case("silu_and_mul", f"silu-2d-{_dt}", dtype=_dt, shape=[3, 192])
    _case("silu_and_mul", f"silu-3d-{_dt}", dtype=_dt, shape=[2, 3, 2600])
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
    # The same step in one launch (decodes in the prefill tile), as before the split.
    _case(
        "attention", f"attn-p5-mixed-one-launch-bs16-g2-d128-{_dt}", dtype=_dt, block_size=16, num_heads=4,
        num_kv_heads=2, head_dim=128, query_lens=[1, 1, 1, 150, 97, 1, 33], seq_lens=[300, 45, 129, 400, 97, 70, 160],
        pad=1, split_decodes=False,
    )

    # Packed whole prompts without a cache (pooling): bidirectional (BERT) and causal (decoders),
    # GQA 1/2/3/4, head_dim 32/48 (padded to 64)/64/128, lengths 1, tile multiples and not, an empty
    # sequence, tokens past the last sequence (not written), q/k/v as strided views of one qkv.
    _case("varlen", f"varlen-bidir-g1-d32-{_dt}", dtype=_dt, num_heads=2, num_kv_heads=2, head_dim=32,
          lens=[1, 5, 17, 40, 0, 16], causal=False, pad=2)
    _case("varlen", f"varlen-causal-g2-d64-{_dt}", dtype=_dt, num_heads=4, num_kv_heads=2, head_dim=64,
          lens=[33, 1, 16, 7], causal=True, pad=0)
    _case("varlen", f"varlen-causal-g3-d48-bq4-{_dt}", dtype=_dt, num_heads=6, num_kv_heads=2, head_dim=48,
          lens=[20, 9, 1], causal=True, pad=1, config={"block_q": 4, "tile_n": 16})
    _case("varlen", f"varlen-bidir-g2-d128-bq8-t32-{_dt}", dtype=_dt, num_heads=4, num_kv_heads=2, head_dim=128,
          lens=[70, 3], causal=False, pad=0, config={"block_q": 8, "tile_n": 32})
    _case("varlen", f"varlen-bidir-g1-d8-{_dt}", dtype=_dt, num_heads=4, num_kv_heads=4, head_dim=8,
          lens=[3, 19, 1], causal=False, pad=1)  # the tiny test models' heads, padded to 16
    _case("varlen", f"varlen-causal-g4-d64-bq2-{_dt}", dtype=_dt, num_heads=4, num_kv_heads=1, head_dim=64,
          lens=[2, 31, 64, 5], causal=True, pad=3, config={"block_q": 2, "tile_n": 16})
# The automatic fp16 shape (128-row tiles, 64-key tiles) under both masks.
_case("varlen", "varlen-auto-causal-g2-d64-float16", dtype="float16", num_heads=4, num_kv_heads=2, head_dim=64,
      lens=[150, 64, 1, 65], causal=True, pad=1)
_case("varlen", "varlen-auto-bidir-g1-d32-float16", dtype="float16", num_heads=2, num_kv_heads=2, head_dim=32,
      lens=[128, 9, 129], causal=False, pad=0)

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
# Whole pooling models on the GPU path's attention (the varlen backend, and for the decoder the fused
# qkv prologue) against transformers: a BERT encoder (bidirectional) and a Qwen3 embedder (causal, GQA).
_case("pooling_varlen", "pooling-varlen-bert-and-qwen3-vs-transformers")
_case("kv_store", "kvstore-bs32-f32-into-f16", dtype="float32", cache_dtype="float16", block_size=32, num_kv_heads=3, head_dim=128, tokens=7)
_case("kv_store", "kvstore-bs16-d32-float32", dtype="float32", cache_dtype="float32", block_size=16, num_kv_heads=1, head_dim=32, tokens=4)
# Attention reading an fp8 cache. (Storing into fp8 is checked on the GPU only: the interpreter's
# float8 rounding is not exact, e.g. -125.8 becomes -64 instead of -128.)
_case(
    "attention", "attn-mixed-fp8cache-bs16-g2-d64-float16", dtype="float16", cache_dtype="float8_e4m3fn", block_size=16,
    num_heads=4, num_kv_heads=2, head_dim=64, query_lens=[1, 6, 3, 1], seq_lens=[20, 6, 35, 50], pad=1,
)
_case("rms_norm", "rmsnorm-residual-inplace-float32", dtype="float32", shape=[4, 64], residual=True, strided=False, inplace=True)
# Several programs per head kind (32 heads of 128: two groups each of q, k, v), an odd group (3 q
# heads a kv head) with head_dim 256, and fp32 activations stored into an fp16 cache.
_case("qkv_prologue", "qkvpro-mha32-d128-bs16-norm-float32", dtype="float32", tokens=3, num_heads=32, num_kv_heads=32, head_dim=128, block_size=16, norm=True, strided=False)
_case("qkv_prologue", "qkvpro-g3-d256-bs16-norm-float16", dtype="float16", tokens=3, num_heads=6, num_kv_heads=2, head_dim=256, block_size=16, norm=True, strided=True)
_case("qkv_prologue", "qkvpro-f32-into-f16-cache", dtype="float32", cache_dtype="float16", tokens=5, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, norm=True, strided=False)
_case("lazy_import", "import-tokenmill-does-not-import-triton")
# The variants compiled while LLM() starts must hold every config a step can choose.
_case("launch_configs", "attention-launch-configs-cover-every-choice")
# The precompile calls reach the kernels with valid arguments (the interpreter runs a compile-only
# launch instead of compiling it; whether nothing compiles mid-run is checked on the GPU).
_case("precompile", "precompile-calls-every-attention-variant-and-the-draw")
# The sampler's draw (temperature, Philox Gumbel noise, argmax): vocabularies under one chunk (and
# not a multiple of 4), exactly one, and over several chunks.
for _dt in ("float32", "float16"):
    for _vocab in (37, 2048, 5003):
        _case("gumbel_argmax", f"gumbel-argmax-v{_vocab}-{_dt}", dtype=_dt, vocab=_vocab)

# Penalties, logit bias, top-k / top-p / min-p and the draw (three kernels and the draw): one row of
# each kind (see _check_sample_tokens), over vocabularies that hold a wide row's bracket at once
# (5003) or need sweeps to narrow it (20000, past the 8,192-token bracket).
_case("sample_tokens", "sample-tokens-v5003-float32", dtype="float32", vocab=5003, rows=None)
_case("sample_tokens", "sample-tokens-v5003-float16", dtype="float16", vocab=5003, rows=None)
_case("sample_tokens", "sample-tokens-v20000-wide-float32", dtype="float32", vocab=20000, rows=[0, 3, 5, 11])
# Wide top-p rows through the histogram passes (several splits, a last partial tile), mixed with
# narrow, min-p-only and greedy rows; at 9,000 tokens a row of ties overflows the bracket (sweeps).
_case("sample_tokens_wide", "sample-tokens-wide-v5003-float32", dtype="float32", vocab=5003)
_case("sample_tokens_wide", "sample-tokens-wide-v5003-float16", dtype="float16", vocab=5003)
_case("sample_tokens_wide", "sample-tokens-wide-v9000-float32", dtype="float32", vocab=9000)

CASES.update(quant_kernel_checks.CASES)  # the quantized GEMMs: tests/quant_kernel_checks.py
CASES.update(sm90.CASES)  # compiled for sm_90, not run: tests/kernel_compile_sm90.py
CASES.update(deterministic.CASES)  # deterministic mode's kernels: tests/kernel_checks_deterministic.py

# The slowest cases under the interpreter (seconds each, measured one worker on a busy 2-core
# machine; together ~2/3 of the interpreter's time): marked slow, so `-m "not slow"` leaves them
# out; CI runs them.
SLOW_CASES = {
    "attn-mixed-260seqs-bq4-float16": 51, "attn-random3-float32": 46, "attn-decode-260seqs-g2-d32-float32": 37,
    "attn-prefill-auto-bs16-g4-d128-float32": 26, "attn-random6-float16": 19, "attn-random7-float32": 18,
    "attn-random2-float16": 11, "sample-tokens-v5003-float16": 15,
}
assert SLOW_CASES.keys() <= CASES.keys(), "a slow case that is not a case"


# ----------------------------------------------------------------------------------------------
# pytest side: run the selected cases in worker processes once, then report one test per case.
# ----------------------------------------------------------------------------------------------
def _spawn(names: list[str], interpret: bool) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve() if interpret else Path(sm90.__file__).resolve()), "--worker", json.dumps(names)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="module")
def interpreter_results(request: pytest.FixtureRequest) -> dict[str, str | None]:
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is sys.modules[__name__] and hasattr(item, "callspec") and "name" in item.callspec.params
    ] or list(CASES)
    compiled = [n for n in selected if CASES[n][0] == "compile_sm90"]
    interpreted = [n for n in selected if CASES[n][0] != "compile_sm90"]
    # Attention cases are the slow ones: deal them round-robin so both workers finish together.
    interpreted.sort(key=lambda n: CASES[n][0] not in ("attention", "backend", "layer", "varlen", "pooling_varlen", "det_attention"))
    interpreted.sort(key=lambda n: -SLOW_CASES.get(n, 0))  # the slowest first, split between the two
    shards = [interpreted[0::2], interpreted[1::2]]
    procs = [_spawn(shard, interpret=True) for shard in shards if shard]
    if compiled:
        procs.append(_spawn(compiled, interpret=False))
    results: dict[str, str | None] = {}
    for proc in procs:
        output, _ = proc.communicate(timeout=900)
        line = next((ln for ln in reversed(output.splitlines()) if ln.startswith(_RESULT_PREFIX)), None)
        if line is None:
            raise RuntimeError(f"interpreter worker died (rc {proc.returncode}):\n{output[-4000:]}")
        results.update(json.loads(line[len(_RESULT_PREFIX) :]))
    return results


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

    for query_lens, seq_lens in (([1, 1, 1], [5, 17, 40]), ([1, 7, 3, 2], [16, 7, 35, 2])):
        batch = make_paged_batch(
            query_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32, seed=3
        )
        cache_a, cache_b = batch.kv_cache.clone(), batch.kv_cache.clone()
        expected = TorchAttentionBackend().forward(batch.q, batch.k, batch.v, cache_a, batch.metadata(), 0.2)
        store_kv_ref(batch.k, batch.v, cache_b, batch.slot_mapping)
        assert torch.equal(cache_a, cache_b)
        got = paged_attention_ref(batch.q, cache_b, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.2)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Worker side (runs with TRITON_INTERPRET=1 already in the environment).
# ----------------------------------------------------------------------------------------------
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


def _check_varlen(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import varlen_attention_ref
    from support.kernel_cases import make_varlen_batch
    from tokenmill.kernels.triton.varlen_attention import VarlenAttentionConfig, varlen_attention

    dtype = getattr(torch, p["dtype"])
    batch = make_varlen_batch(p["lens"], num_heads=p["num_heads"], num_kv_heads=p["num_kv_heads"], head_dim=p["head_dim"],
                              dtype=dtype, num_pad_tokens=p["pad"], seed=len(p["lens"]))
    assert not batch.q.is_contiguous(), "q, k and v should be strided views of one qkv output"
    config = VarlenAttentionConfig(num_warps=4, num_stages=1, **p["config"]) if "config" in p else None
    scale = p["head_dim"] ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    got = varlen_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal=p["causal"],
                           max_seqlen=max(p["lens"]), out=out, config=config)
    assert got is out
    expected = varlen_attention_ref(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, p["causal"])
    n = sum(p["lens"])
    torch.testing.assert_close(out[:n], expected[:n], **_tol(dtype), msg=lambda m: f"{config}: {m}")
    assert torch.isnan(out[n:]).all(), "rows past the last sequence were written"
    # The other mask gives a different answer wherever a sequence has two tokens or more.
    other = varlen_attention_ref(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, not p["causal"])
    assert not torch.allclose(out[:n], other[:n], **_tol(dtype)), "causal and bidirectional agree: the test cannot tell them apart"


def _check_pooling_varlen(p: dict[str, Any]) -> None:
    """LLM.embed through the pooling runner with `VarlenAttentionBackend` (what CUDA runs) on tiny
    random models, against transformers' fp32 hidden states: CLS for BERT, last token for Qwen3."""
    import tempfile

    import torch
    import transformers

    from tokenmill import LLM, PoolingParams
    from tokenmill.attention.varlen_backend import VarlenAttentionBackend

    lens = [1, 5, 17, 40, 2, 33, 16]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lens]
    models = {
        "bert": (transformers.BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=96, max_position_embeddings=64), transformers.BertModel, 0),
        "qwen3": (transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                           rms_norm_eps=1e-5, tie_word_embeddings=True), transformers.Qwen3Model, -1),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, cls, row) in models.items():
            torch.manual_seed(5)
            hf = cls(config).eval()
            with torch.no_grad():
                for param_name, param in hf.named_parameters():  # weights far from init, norms off 1
                    noise = torch.randn(param.shape, generator=gen)
                    param.copy_(1.0 + 0.2 * noise if param_name.endswith(("norm.weight", "LayerNorm.weight")) else 0.3 * noise)
            hf.save_pretrained(f"{tmp}/{name}")
            llm = LLM(f"{tmp}/{name}", runner="pooling", device="cpu", dtype="float32", seed=0, skip_tokenizer_init=True,
                      max_num_seqs=4)
            llm.llm_engine.runner.backend = VarlenAttentionBackend()  # the CUDA choice, here interpreted
            outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], PoolingParams(normalize=False), use_tqdm=False)
            with torch.no_grad():
                for ids, out in zip(prompts, outputs):
                    expected = hf(input_ids=torch.tensor([ids])).last_hidden_state[0, row]
                    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, rtol=1e-4, atol=1e-4,
                                               msg=lambda m: f"{name}, {len(ids)} tokens: {m}")


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
    got = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, cache, meta, 0.125)
    assert got.dtype == dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got.float(), expected, **_tol(dtype))
    assert meta.backend_cache, "config not cached per step"


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


def _check_gumbel_argmax(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import gumbel_argmax_ref
    from tokenmill.kernels.triton.sampling import gumbel_argmax

    vocab, dtype = p["vocab"], getattr(torch, p["dtype"])
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen) * 4
    logits[1, ::3] = float("-inf")  # banned tokens are never drawn
    top = logits.max() + 1
    logits[0, [vocab // 2, vocab - 1]] = top  # a greedy tie (across chunks when vocab > one chunk)
    logits[4, 3] = top  # greedy
    logits[5] = 0.0  # a flat row: the draw is all noise
    logits = logits.to(dtype)
    temperature = torch.tensor([0.0, 0.3, 1.0, 0.7, 0.0, 2.0, 1e-2, 1.0])
    keys = torch.randint(0, 2**63 - 1, (8,), generator=gen)
    counters = torch.tensor([0, 1, 2**32 + 3, 2**40, 5, 6, 7, 2**31 + 1])
    got = gumbel_argmax(logits, temperature, keys, counters)
    want = gumbel_argmax_ref(logits, temperature, keys, counters)
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    assert got[0] == vocab // 2 and got[4] == 3, "greedy rows take the first argmax"
    assert got[1] % 3 != 0, "drew a banned (-inf) token"
    # The draw depends on the key and counter, and on nothing else in the batch.
    alone = gumbel_argmax(logits[5:6], temperature[5:6], keys[5:6], counters[5:6])
    assert alone.tolist() == got[5:6].tolist()
    flat = logits[5].expand(16, vocab).contiguous()
    draws = gumbel_argmax(flat, torch.ones(16), keys[5].expand(16).contiguous(), torch.arange(16))
    assert len(set(draws.tolist())) > 8, draws.tolist()


def _check_sample_tokens(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import sample_ref
    from support.kernel_cases import sampling_rows
    from tokenmill.kernels.triton.sampling import sample_tokens

    logits, temperature, keys, counters, filters, state = sampling_rows(p["vocab"], getattr(torch, p["dtype"]), p["vocab"])
    if p["rows"] is not None:  # a subset of the rows (the state tables stay whole)
        take = torch.tensor(p["rows"])
        logits, temperature, keys, counters = (t[take] for t in (logits, temperature, keys, counters))
        filters = type(filters)(*(f[take] for f in filters))
        state = state._replace(**{name: getattr(state, name)[take] for name in
                                  ("bias_slots", "penalty_slots", "repetition", "frequency", "presence")})
    got = sample_tokens(logits, temperature, keys, counters, filters, state)
    want = sample_ref(logits, temperature, keys, counters, tuple(filters), tuple(state))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    if p["rows"] is not None:
        return
    # Each row depends on its own inputs only: a row alone draws what it drew in the batch.
    for row in (1, 9):
        alone = [t[row : row + 1] for t in (logits, temperature, keys, counters)]
        one_filters = type(filters)(*(f[row : row + 1] for f in filters))
        one_state = state._replace(**{name: getattr(state, name)[row : row + 1] for name in
                                      ("bias_slots", "penalty_slots", "repetition", "frequency", "presence")})
        assert sample_tokens(*alone, one_filters, one_state).tolist() == got[row : row + 1].tolist()
    # Without filters or state, the plain draw matches its twin too.
    assert sample_tokens(logits, temperature, keys, counters).tolist() == sample_ref(logits, temperature, keys, counters).tolist()


def _check_sample_tokens_wide(p: dict[str, Any]) -> None:
    import torch

    from tokenmill.kernels.reference import filter_threshold_ref, sample_ref
    from support.kernel_cases import wide_sampling_rows
    from tokenmill.kernels.triton import sampling

    logits, temperature, keys, counters, filters, state, histogram_rows = wide_sampling_rows(
        p["vocab"], getattr(torch, p["dtype"]), seed=p["vocab"])
    got = sampling.sample_tokens(logits, temperature, keys, counters, filters, state)
    want = sample_ref(logits, temperature, keys, counters, tuple(filters), tuple(state))
    assert got.tolist() == want.tolist(), (got.tolist(), want.tolist())
    # The thresholds are the twin's, and the wide top-p rows were settled by the histogram passes.
    args = (logits, temperature, keys, counters, filters, sampling._state_args(state, logits), True, False)
    thresholds, chosen = sampling._thresholds(*args)
    for row, s in enumerate(_twin_scores(logits, temperature, state)):
        k, top_p, min_p = (float(f[row]) for f in filters)
        want_t = filter_threshold_ref(s, int(k), top_p, min_p) if float(temperature[row]) > 0 else float("-inf")
        if float(temperature[row]) > 0 and (k > 0 or top_p < 1.0 or min_p > 0.0):
            assert float(thresholds[row]) == want_t, (row, float(thresholds[row]), want_t)
    settled = [row for row in range(len(chosen)) if int(chosen[row]) == -4]
    assert settled == histogram_rows, (settled, histogram_rows)
    # Deterministic: the same call gives the same bits; and the same with one split a row.
    again, chosen_again = sampling._thresholds(*args)
    assert torch.equal(again, thresholds) and torch.equal(chosen_again, chosen)
    programs = sampling._WIDE_PROGRAMS
    try:
        sampling._WIDE_PROGRAMS = 1
        one_split, _ = sampling._thresholds(*args)
    finally:
        sampling._WIDE_PROGRAMS = programs
    assert torch.equal(one_split, thresholds), (one_split.tolist(), thresholds.tolist())
    assert sampling.sample_tokens(logits, temperature, keys, counters, filters, state).tolist() == got.tolist()
    # A caller that says no row has top-p alone gets no histogram passes; such rows still come out
    # right (by sweeps), so a wrong hint costs time, never a wrong draw.
    without, chosen_without = sampling._thresholds(*args[:-1], False, False)
    assert torch.equal(without, thresholds) and not (chosen_without == -4).any()


def _twin_scores(logits: Any, temperature: Any, state: Any) -> list:
    """Each row's tempered, biased and penalised scores, as ``reference.sample_ref`` computes them."""
    import torch

    from tokenmill.kernels.reference import penalize_ref, prompt_mask_ref

    x = logits.float().clone()
    bias_slots, bias, penalty_slots, counts, prompt_bits, rep, freq, pres = state
    rows = torch.nonzero(bias_slots >= 0).flatten()
    x[rows] += bias[bias_slots[rows].long()]
    rows = torch.nonzero(penalty_slots >= 0).flatten()
    slots = penalty_slots[rows].long()
    x[rows] = penalize_ref(x[rows], counts[slots], prompt_mask_ref(prompt_bits[slots], x.shape[1]), rep[rows],
                           freq[rows], pres[rows])
    return [x[row] / torch.tensor(t) if t > 0 else x[row] for row, t in enumerate(temperature.tolist())]


def _check_launch_configs(p: dict[str, Any]) -> None:
    import random

    import torch

    from tokenmill.kernels.triton.paged_attention import choose_config, launch_configs

    rng = random.Random(0)
    cpu = torch.device("cpu")
    # (heads, kv heads, head_dim, dtype): groups 1, 2 (Qwen3-0.6B), 3, 4 (Llama-3-8B), 8, 16.
    for heads, kv_heads, dim, dtype in [
        (16, 16, 64, torch.float16), (16, 8, 128, torch.bfloat16), (6, 2, 256, torch.bfloat16),
        (32, 8, 128, torch.bfloat16), (16, 2, 256, torch.float16), (32, 2, 128, torch.bfloat16), (4, 2, 128, torch.float32),
    ]:
        for max_model_len in (256, 4096, 40960):
            configs = launch_configs(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype, max_seq_len=max_model_len)
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
                    dtype=dtype, max_query_len=max_query_len, max_seq_len=max_seq_len, device=cpu,
                )
                assert config in configs, (config, heads, kv_heads, dim, dtype, max_model_len)
                chosen.add(config)
            # The listing is not padded with variants no step would pick.
            assert len(chosen) >= len(configs) - 2, (sorted(set(configs) - chosen, key=str), configs)
    # Qwen3-0.6B at max_model_len 4096: decode 1-16 splits (5), two prefill tiles with 1-4 splits (6).
    qwen = launch_configs(num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, max_seq_len=4096)
    assert len(qwen) == 11, qwen
    assert {(c.block_q, c.num_warps) for c in qwen if c.block_q > 1} == {(8, 4), (64, 8)}, qwen


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
        assert launched == pa.launch_configs(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, max_seq_len=1024)


def _check_lazy_import(p: dict[str, Any]) -> None:
    # Already verified at worker start, before anything imported triton (see _worker_main).
    assert p["triton_was_imported"] is False, "importing tokenmill's kernel-facing modules imported triton"


_CHECKS = {
    "attention": _check_attention,
    "backend": _check_backend,
    "varlen": _check_varlen,
    "pooling_varlen": _check_pooling_varlen,
    "kv_store": _check_kv_store,
    "rms_norm": _check_rms_norm,
    "rotary": _check_rotary,
    "layer_norm": _check_layer_norm,
    "silu_and_mul": _check_silu_and_mul,
    "gumbel_argmax": _check_gumbel_argmax,
    "sample_tokens": _check_sample_tokens,
    "sample_tokens_wide": _check_sample_tokens_wide,
    "qkv_prologue": _check_qkv_prologue,
    "layer": _check_layer,
    "micro_batches": _check_micro_batches,
    "lazy_import": _check_lazy_import,
    "launch_configs": _check_launch_configs,
    "precompile": _check_precompile,
    **deterministic.CHECKS,
    **quant_kernel_checks.CHECKS,
}


def _worker_main(names: list[str]) -> None:
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
    for name in names:
        check, params = CASES[name]
        if check == "lazy_import":
            params = {"triton_was_imported": triton_was_imported}
        start = time.perf_counter()
        try:
            _CHECKS[check](params)
            results[name] = None
        except Exception:  # noqa: BLE001  (the report carries the traceback to pytest)
            results[name] = traceback.format_exc()
        print(f"{name}: {'ok' if results[name] is None else 'FAIL'} {time.perf_counter() - start:.2f}s", flush=True)
    print(_RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker_main(json.loads(sys.argv[2]))
