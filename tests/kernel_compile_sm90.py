"""Kernels compiled for sm_90 on the CPU, not run: a worker of ``test_kernels_interpret.py``.

Real-hardware shapes go through the real wrappers and launch heuristics, and Triton's own
compiler and ptxas build them for the H100/H200. That catches what the interpreter accepts but
the GPU compiler refuses (dot shapes, layouts), shared memory over Hopper's 227 KB, register
spills, and a dot that silently lost its tensor cores. The cases are plain data (collecting the
tests needs neither torch nor triton); the checks run in a worker process started with
``--worker`` and WITHOUT ``TRITON_INTERPRET``, which reports results the way the interpreter
workers do.
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

from support.kernel_workers import RESULT_PREFIX

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


_COMPILE_ATTENTION = {
    # name: (dtype, num_seqs, query_len, heads, kv_heads, head_dim, block_size, max_seq_len)
    "p1-decode-bf16-d128-g2": ("bfloat16", 256, 1, 16, 8, 128, 16, 1024),
    "longctx-decode-split-bf16-d128-g4": ("bfloat16", 4, 1, 32, 8, 128, 16, 32768),
    "prefill-bf16-d128-g2": ("bfloat16", 4, 512, 16, 8, 128, 16, 2048),
    "prefill-fp16-d64-g1-bs32": ("float16", 4, 512, 8, 8, 64, 32, 2048),
    "prefill-bf16-d256-g4": ("bfloat16", 4, 512, 16, 4, 256, 16, 2048),
    "decode-bf16-d256-g8-split": ("bfloat16", 2, 1, 16, 2, 256, 16, 16384),
    "prefill-fp32-d128-g2": ("float32", 4, 512, 4, 2, 128, 16, 2048),
    "decode-fp32-d128-g2-split": ("float32", 2, 1, 4, 2, 128, 16, 8192),
}
for _name in _COMPILE_ATTENTION:
    _case("compile_sm90", f"sm90-attn-{_name}", kernel="attention", shape=_name)
# Attention launches whose occupancy is two programs an SM (checked below: registers x threads).
_TWO_PROGRAMS_AN_SM = ("prefill-bf16-d128-g2", "prefill-fp16-d64-g1-bs32")
_COMPILE_VARLEN = {
    # name: (dtype, heads, kv_heads, head_dim, causal); q, k, v strided views of one qkv output
    "qwen3-embed-causal-bf16-d128-g2": ("bfloat16", 16, 8, 128, True),
    "minilm-bidir-bf16-d32": ("bfloat16", 12, 12, 32, False),
    "bert-base-bidir-fp16-d64": ("float16", 12, 12, 64, False),
    "causal-bf16-d256-g4": ("bfloat16", 16, 4, 256, True),
    "bidir-bf16-d80-padded": ("bfloat16", 8, 8, 80, False),
    "causal-fp32-d128-g2": ("float32", 4, 2, 128, True),
}
for _name in _COMPILE_VARLEN:
    _case("compile_sm90", f"sm90-varlen-{_name}", kernel="varlen_attention", shape=_name)
for _kernel in ("kv_store", "rms_norm", "fused_add_rms_norm", "head_rms_norm", "rotary", "silu_and_mul", "gumbel_argmax",
                "add_layer_norm", "sample_tokens"):
    _case("compile_sm90", f"sm90-{_kernel}-bf16", kernel=_kernel)
_COMPILE_QKV_PROLOGUE = {
    # name: (dtype, tokens, heads, kv_heads, head_dim, block_size, qk_norm)
    "qwen3-0.6b-decode-bf16": ("bfloat16", 256, 16, 8, 128, 16, True),
    "llama3-8b-prefill-bf16": ("bfloat16", 16384, 32, 8, 128, 16, False),
    "d64-fp16-bs32": ("float16", 64, 8, 8, 64, 32, True),
    "d256-bf16": ("bfloat16", 64, 16, 4, 256, 16, True),
}
for _name in _COMPILE_QKV_PROLOGUE:
    _case("compile_sm90", f"sm90-qkv_prologue-{_name}", kernel="qkv_prologue", shape=_name)
# The item-queue decode kernel: the default decode launch's tile over bf16 (P1's and P3's heads),
# and its ranking kernel; over fp8 the fp8 launch's 1-warp tile (no spill in the whole-context form).
_case("compile_sm90", "sm90-queue-decode-bf16-g2", kernel="queue_decode", heads=16, tile_n=64, num_warps=2, num_stages=3)
_case("compile_sm90", "sm90-queue-decode-bf16-g4", kernel="queue_decode", heads=32, tile_n=64, num_warps=2, num_stages=3)
_case("compile_sm90", "sm90-queue-decode-fp8cache-g2", kernel="queue_decode", heads=16, tile_n=32, num_warps=1, num_stages=6,
      cache_dtype="float8_e4m3fn")
for _cache in ("bfloat16", "float8_e4m3fn"):  # head_dim 256: the default decode tile, 32 keys on 4 warps
    _case("compile_sm90", f"sm90-queue-decode-d256-{_cache}", kernel="queue_decode", heads=32, head_dim=256, tile_n=32,
          num_warps=4, num_stages=3, cache_dtype=_cache)
# kv_cache_dtype="fp8": bf16 keys and values stored as float8 e4m3 and read back by attention.
_case("compile_sm90", "sm90-attn-p1-decode-fp8cache", kernel="attention", shape="p1-decode-bf16-d128-g2", cache_dtype="float8_e4m3fn")
_case("compile_sm90", "sm90-attn-prefill-fp8cache", kernel="attention", shape="prefill-bf16-d128-g2", cache_dtype="float8_e4m3fn")
# head_dim 256 over fp8: decode on fp16 dots, the wide tile on bf16 ones (fp16 ones spill there).
_case("compile_sm90", "sm90-attn-prefill-d256-fp8cache", kernel="attention", shape="prefill-bf16-d256-g4", cache_dtype="float8_e4m3fn")
_case("compile_sm90", "sm90-attn-decode-d256-fp8cache", kernel="attention", shape="decode-bf16-d256-g8-split", cache_dtype="float8_e4m3fn")
_case("compile_sm90", "sm90-attn-decode-fp32-fp8cache", kernel="attention", shape="decode-fp32-d128-g2-split", cache_dtype="float8_e4m3fn")
_case("compile_sm90", "sm90-qkv_prologue-decode-fp8cache", kernel="qkv_prologue", shape="qwen3-0.6b-decode-bf16", cache_dtype="float8_e4m3fn")
_case("compile_sm90", "sm90-kv_store-fp8cache", kernel="kv_store", cache_dtype="float8_e4m3fn")
# Deterministic mode: the batch-invariant matmul on the four projections and the lm_head of both
# P1-P3 models (both tiles: wgmma, no spills), and the fixed-split attention variant.
_COMPILE_MATMUL = {
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)],
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
    "bias-fp16-tails": [(200, 72)],
    "fp32": [(512, 256)],
}
for _name in _COMPILE_MATMUL:
    _case("compile_sm90", f"sm90-det-matmul-{_name}", kernel="matmul", shape=_name)
for _name in ("p1-decode-bf16-d128-g2", "longctx-decode-split-bf16-d128-g4", "prefill-bf16-d128-g2", "decode-bf16-d256-g8-split",
              "prefill-fp32-d128-g2"):
    _case("compile_sm90", f"sm90-det-attn-{_name}", kernel="attention", shape=_name, deterministic=True)
# Quantized GEMMs on Llama-3-8B's shapes: W4A16 decode (split-K) and prefill tiles, fp8 activation
# quantization and the Triton fp8 GEMM.
for _m in (1, 32, 64, 128, 256):
    _case("compile_sm90", f"sm90-w4a16-m{_m}-bf16", kernel="w4a16", m=_m)
_case("compile_sm90", "sm90-w4a16-m16-asym-bias-bf16", kernel="w4a16", m=16, zeros=True, bias=True)
# Not the engine's choice: 128 rows in one swapped tile on two warpgroups (bench/quant_gemm_bench.py
# sweeps it past 64 rows; it won only down_proj at M 96 and 112, docs/perf.md entry 25).
_case("compile_sm90", "sm90-w4a16-m128-one-tile-bf16", kernel="w4a16", m=128,
      config=dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, split_k=2))
_case("compile_sm90", "sm90-w4a16-m8-asym-fp16-gate_up", kernel="w4a16", m=8, zeros=True, dtype="float16", n=28672)
# A wide weight from 32 tokens: 256 outputs a program on two warpgroups (choose_config).
for _m in (32, 96):
    _case("compile_sm90", f"sm90-w4a16-m{_m}-gate_up-wide", kernel="w4a16", m=_m, n=28672)
_case("compile_sm90", "sm90-w4a16-m4-down-g64", kernel="w4a16", m=4, n=4096, k=14336, group=64)
# The prefill path's dequantize pass (then cuBLAS): gate_up's shape, symmetric and asymmetric.
_case("compile_sm90", "sm90-w4a16_dequant-bf16", kernel="w4a16_dequant")
_case("compile_sm90", "sm90-w4a16_dequant-asym-fp16", kernel="w4a16_dequant", zeros=True, dtype="float16")
_case("compile_sm90", "sm90-quantize_fp8-bf16", kernel="quantize_fp8")
for _top in (False, True):  # the sampled tokens' logprobs over Qwen's vocabulary, logprobs 0 and 1
    _case("compile_sm90", f"sm90-token_logprobs-top{int(_top)}-bf16", kernel="token_logprobs", top=_top)
_case("compile_sm90", "sm90-silu_and_mul_fp8-bf16", kernel="silu_and_mul_fp8")
# The norms that quantize their output for the next fp8 linear (Llama-3-8B's hidden 4096; per-token scales).
for _kernel in ("rms_norm_fp8", "fused_add_rms_norm_fp8"):
    _case("compile_sm90", f"sm90-{_kernel}-bf16", kernel=_kernel)
# The fp8 GEMM on Llama-3-8B's projections: swapped and K split at decode sizes (each row-tile class,
# qkv and down; several 64-row tiles on 6 stages past 64 rows), the plain tiles where it does not run.
for _m in (1, 32, 64, 256, 1024):
    _case("compile_sm90", f"sm90-fp8_gemm-m{_m}-qkv-bf16", kernel="fp8_gemm", m=_m)
for _m in (16, 128, 256):
    _case("compile_sm90", f"sm90-fp8_gemm-m{_m}-down-bf16", kernel="fp8_gemm", m=_m, n=4096, k=14336)
# Block-wise fp8 on Qwen3-8B's qkv and down: the per-group activation quantization and the block GEMM
# (swapped and K split at decode sizes, each row-tile class; plain tiles past them).
_case("compile_sm90", "sm90-quantize_fp8_groups-bf16", kernel="quantize_fp8_groups")
for _m in (1, 32, 64, 256, 1024):
    _case("compile_sm90", f"sm90-block_fp8_gemm-m{_m}-qkv-bf16", kernel="block_fp8_gemm", m=_m)
for _m in (16, 128):
    _case("compile_sm90", f"sm90-block_fp8_gemm-m{_m}-down-bf16", kernel="block_fp8_gemm", m=_m, n=4096, k=12288)

# The fused MoE's two grouped GEMMs (and the SiLU between them): Qwen3-30B-A3B's experts (E 128, K 8)
# at a decode step, at 256 tokens and past that (choose_config's three classes), Mixtral-8x7B's
# (E 8, K 2), and fp16 with H and I that fill no tile.
_COMPILE_MOE = {
    # name: (dtype, tokens, experts, top_k, hidden, intermediate)
    "qwen3-30b-a3b-t1-bf16": ("bfloat16", 1, 128, 8, 2048, 768),
    "qwen3-30b-a3b-t256-bf16": ("bfloat16", 256, 128, 8, 2048, 768),
    "qwen3-30b-a3b-t1024-bf16": ("bfloat16", 1024, 128, 8, 2048, 768),
    "qwen3-30b-a3b-t2048-bf16": ("bfloat16", 2048, 128, 8, 2048, 768),  # 16,384 pairs: the chunked alignment
    "mixtral-8x7b-t8192-bf16": ("bfloat16", 8192, 8, 2, 4096, 14336),
    "router-512-t2048-bf16": ("bfloat16", 2048, 512, 8, 256, 128),  # a 512-expert router: E_PAD 512
    "mixtral-8x7b-t8-bf16": ("bfloat16", 8, 8, 2, 4096, 14336),
    "mixtral-8x7b-t512-bf16": ("bfloat16", 512, 8, 2, 4096, 14336),
    "odd-fp16": ("float16", 64, 8, 2, 1000, 360),
    "odd-fp16-t200": ("float16", 200, 8, 2, 1000, 360),
    # quantization="fp8"'s experts: fp8 codes widened in registers, per-channel scales after the K loop.
    "qwen3-30b-a3b-t1-fp8w": ("bfloat16", 1, 128, 8, 2048, 768),
    "qwen3-30b-a3b-t256-fp8w": ("bfloat16", 256, 128, 8, 2048, 768),
    "qwen3-30b-a3b-t1024-fp8w": ("bfloat16", 1024, 128, 8, 2048, 768),
}
for _name in _COMPILE_MOE:
    _case("compile_sm90", f"sm90-moe-{_name}", kernel="fused_moe", shape=_name)
# The router's top-k: Qwen3-30B-A3B's (16 tokens of 128 experts a program) and a 512-expert router's.
for _experts, _top_k in ((128, 8), (512, 10)):
    _case("compile_sm90", f"sm90-moe-route-e{_experts}-k{_top_k}-bf16", kernel="moe_route", experts=_experts, top_k=_top_k)

_SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on H100/H200 (227 KB)
_TRITON_DTYPES = {"torch.float8_e4m3fn": "fp8e4nv", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8"}


def _install_compile_only_launcher(report: list[dict[str, Any]]) -> None:
    """Make ``kernel[grid](...)`` compile for sm_90 instead of launching, recording what ptxas says.

    The signature and the 16-divisibility hints are derived from the actual arguments the way
    Triton's launcher specialises them, so what is compiled is what the wrapper would launch."""
    import re
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
        bound = self.signature.bind(*args, **kwargs)
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for param in self.params:
            value = bound.arguments[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
                continue
            if isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _TRITON_DTYPES[str(value.dtype)]
                aligned = value.data_ptr() % 16 == 0
            elif isinstance(value, bool):
                signature[param.name], aligned = "i1", False
            elif isinstance(value, int):
                signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
                # As Triton's launcher: a do_not_specialize int gets no divisibility hint (issue 21:
                # hinting it here hid the matmul's unaligned, unpipelined row loads).
                aligned = value % 16 == 0 and not param.do_not_specialize
            else:
                signature[param.name], aligned = "fp32", False
            if aligned:
                attrs[(param.num,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)
        ptx = kernel.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(ptx)
            info = subprocess.run(
                [str(ptxas), "-v", "--gpu-name=sm_90a", str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k.o")],
                capture_output=True, text=True, check=True,
            ).stderr
        registers = re.search(r"Used (\d+) registers", info)
        spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", info))
        report.append({
            "kernel": self.__name__, "shared": kernel.metadata.shared, "registers": int(registers.group(1)) if registers else -1,
            "spill_bytes": spills, "wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx, "options": options,
            "sync_loads": len(re.findall(r"\bld\.global", ptx)), "st_shared": len(re.findall(r"\bst\.shared", ptx)),
            "float_inputs": any(v in ("*bf16", "*fp16") for v in signature.values()),
        })

    JITFunction.run = run  # type: ignore[method-assign]


def _check_compile_sm90(p: dict[str, Any], report: list[dict[str, Any]]) -> None:
    import torch

    from support.kernel_cases import rope_cos_sin_cache
    from tokenmill.kernels.triton import (
        activation,
        kv_store,
        layernorm,
        paged_attention,
        qkv_prologue,
        rmsnorm,
        rotary,
        sampling,
        varlen_attention,
    )

    start = len(report)
    bf16 = torch.bfloat16
    kernel = p["kernel"]
    # Tensors only carry dtype, shape, strides and alignment here: nothing is launched.
    if kernel == "attention":
        dtype_name, seqs, qlen, heads, kv_heads, dim, bs, max_seq = _COMPILE_ATTENTION[p["shape"]]
        dtype = getattr(torch, dtype_name)
        tokens = seqs * qlen
        qkv = torch.empty((tokens, (heads + 2 * kv_heads) * dim), dtype=dtype)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)  # the model's strided view
        cache = torch.empty((2, 8, bs, kv_heads, dim), dtype=getattr(torch, p.get("cache_dtype", dtype_name)))
        config = paged_attention.choose_config(
            num_tokens=tokens, num_seqs=seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype,
            max_query_len=qlen, max_seq_len=max_seq, device=torch.device("cpu"), deterministic=p.get("deterministic", False),
            cache_dtype=cache.dtype,
        )
        paged_attention.paged_attention(
            q, cache, torch.zeros(seqs + 1, dtype=torch.int32), torch.zeros(seqs, dtype=torch.int32),
            torch.zeros((seqs, max_seq // bs), dtype=torch.int32), dim**-0.5, max_query_len=qlen, max_seq_len=max_seq,
            config=config,
        )
    elif kernel == "queue_decode":
        from tokenmill.kernels.triton.paged_attention_queue import decode_order, new_queue, queued_decode_attention

        seqs, heads, kv_heads, dim = 256, p["heads"], 8, p.get("head_dim", 128)
        qkv = torch.empty((seqs, (heads + 2 * kv_heads) * dim), dtype=bf16)
        q = qkv[:, : heads * dim].view(seqs, heads, dim)
        seq_lens = torch.zeros(seqs, dtype=torch.int32)
        queued_decode_attention(
            q, torch.empty((2, 8, 16, kv_heads, dim), dtype=getattr(torch, p.get("cache_dtype", "bfloat16"))), seq_lens,
            torch.zeros((seqs, 256), dtype=torch.int32), dim**-0.5, decode_order(seq_lens), new_queue("cpu"),
            out=torch.empty_like(q), tile_n=p["tile_n"],
            num_warps=p["num_warps"], num_stages=p["num_stages"], programs_per_sm=8 // p["num_warps"],
        )
    elif kernel == "matmul":
        from tokenmill.kernels.triton.matmul import matmul

        dtype = {"fp32": torch.float32, "bias-fp16-tails": torch.float16}.get(p["shape"], bf16)
        for n, k in _COMPILE_MATMUL[p["shape"]]:
            bias = torch.empty(n, dtype=dtype) if dtype == torch.float16 else None
            for m in (256, 4096):  # both tiles matmul_config picks: 64 x 64 (few programs), 128 x 128 (many)
                matmul(torch.empty((m, k), dtype=dtype), torch.empty((n, k), dtype=dtype), bias)
    elif kernel == "varlen_attention":
        dtype_name, heads, kv_heads, dim, causal = _COMPILE_VARLEN[p["shape"]]
        tokens = 1024
        qkv = torch.empty((tokens, (heads + 2 * kv_heads) * dim), dtype=getattr(torch, dtype_name))
        q, k, v = (x.view(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        varlen_attention.varlen_attention(
            q, k, v, torch.zeros(9, dtype=torch.int32), dim**-0.5, causal=causal, max_seqlen=512,
        )
    elif kernel == "kv_store":
        qkv = torch.empty((64, 32 * 128), dtype=bf16)
        k = qkv[:, 16 * 128 : 24 * 128].view(64, 8, 128)
        cache_dtype = getattr(torch, p.get("cache_dtype", "bfloat16"))
        kv_store.store_kv(k, k, torch.empty((2, 8, 16, 8, 128), dtype=cache_dtype), torch.zeros(64, dtype=torch.int64))
    elif kernel == "rms_norm":
        rmsnorm.rms_norm(torch.empty((64, 4096), dtype=bf16), torch.empty(4096, dtype=bf16), 1e-6)
    elif kernel == "add_layer_norm":
        x = torch.empty((64, 384), dtype=bf16)
        layernorm.add_layer_norm(x, torch.empty_like(x), torch.empty(384, dtype=bf16), torch.empty(384, dtype=bf16), 1e-12)
    elif kernel == "fused_add_rms_norm":
        x = torch.empty((64, 1024), dtype=bf16)
        rmsnorm.fused_add_rms_norm(x, torch.empty_like(x), torch.empty(1024, dtype=bf16), 1e-6)
    elif kernel == "head_rms_norm":
        qkv = torch.empty((64, 32 * 128), dtype=bf16)
        rmsnorm.rms_norm(qkv[:, : 16 * 128].view(64, 16, 128), torch.empty(128, dtype=bf16), 1e-6)
    elif kernel == "rotary":
        qkv = torch.empty((64, 32 * 128), dtype=bf16)
        q, k = qkv[:, : 16 * 128].view(64, 16, 128), qkv[:, 16 * 128 : 24 * 128].view(64, 8, 128)
        rotary.rotary_embedding_(torch.zeros(64, dtype=torch.int64), q, k, rope_cos_sin_cache(64, 128))
    elif kernel == "silu_and_mul":
        activation.silu_and_mul(torch.empty((64, 2 * 3072), dtype=bf16))
    elif kernel == "gumbel_argmax":
        rows = 256
        sampling.gumbel_argmax(torch.empty((rows, 151936), dtype=bf16), torch.ones(rows),
                               torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))
    elif kernel == "sample_tokens":  # every kernel of the filtered, penalised draw (wide top-p: rounds, passes)
        rows, vocab = 256, 151936
        ids = torch.zeros(rows, dtype=torch.int64)
        slots = torch.zeros(rows, dtype=torch.int32)
        floats = torch.ones(rows)
        factors = torch.ones(4)
        state = sampling.RowState(slots, torch.empty((4, vocab)), slots, torch.empty((4, vocab), dtype=torch.int16),
                                  torch.empty((4, vocab // 32), dtype=torch.int32), factors, factors, factors)
        for top_p_alone in (True, False):  # with and without the wide top-p histogram passes
            sampling.sample_tokens(torch.empty((rows, vocab), dtype=bf16), floats, ids, ids,
                                   sampling.Filters(ids, floats, floats), state, top_p_alone=top_p_alone)
    elif kernel == "qkv_prologue":
        dtype_name, tokens, heads, kv_heads, dim, bs, qk_norm = _COMPILE_QKV_PROLOGUE[p["shape"]]
        dtype = getattr(torch, dtype_name)
        weight = torch.empty(dim, dtype=dtype) if qk_norm else None
        qkv_prologue.qkv_prologue(
            torch.empty((tokens, (heads + 2 * kv_heads) * dim), dtype=dtype), torch.zeros(tokens, dtype=torch.int64),
            rope_cos_sin_cache(64, dim), torch.empty((2, 8, bs, kv_heads, dim), dtype=getattr(torch, p.get("cache_dtype", dtype_name))),
            torch.zeros(tokens, dtype=torch.int64), heads, weight, weight, 1e-6,
        )
    elif kernel == "w4a16":
        from tokenmill.kernels.triton.w4a16_gemm import choose_config, counters_needed, w4a16_gemm

        n, k, group = p.get("n", 6144), p.get("k", 4096), p.get("group", 128)  # default: Llama-3-8B's qkv projection
        dtype = getattr(torch, p.get("dtype", "bfloat16"))
        zeros = torch.empty((k // group, n), dtype=torch.uint8) if p.get("zeros") else None
        # The GPU's choice, with the inline-PTX dequant the GPU runs (the CPU would pick the plain one).
        config = dict(p.get("config") or choose_config(p["m"], n, k, group, 132), DEQUANT_ASM=True)
        w4a16_gemm(torch.empty((p["m"], k), dtype=dtype), torch.empty((k // 8, n), dtype=torch.int32),
                   torch.empty((k // group, n), dtype=dtype), zeros, group, torch.empty(n, dtype=dtype) if p.get("bias") else None,
                   torch.zeros(counters_needed(n), dtype=torch.int32), config)
    elif kernel == "w4a16_dequant":
        from tokenmill.kernels.triton.w4a16_gemm import dequantize_weight

        n, k, group = 28672, 4096, 128
        dtype = getattr(torch, p.get("dtype", "bfloat16"))
        zeros = torch.empty((k // group, n), dtype=torch.uint8) if p.get("zeros") else None
        dequantize_weight(torch.empty((k // 8, n), dtype=torch.int32), torch.empty((k // group, n), dtype=dtype), zeros,
                          group, k, dtype, out=torch.empty((k, n), dtype=dtype), dequant_asm=True)
    elif kernel == "silu_and_mul_fp8":
        activation.silu_and_mul_fp8(torch.empty((64, 2 * 14336), dtype=bf16))
    elif kernel == "token_logprobs":
        from tokenmill.kernels.triton.token_logprobs import token_logprobs

        token_logprobs(torch.empty((1024, 151936), dtype=bf16), torch.zeros(1024, dtype=torch.int64), p["top"])
    elif kernel == "quantize_fp8":
        from tokenmill.kernels.triton.fp8_gemm import quantize_fp8

        quantize_fp8(torch.empty((64, 14336), dtype=bf16))
    elif kernel in ("rms_norm_fp8", "fused_add_rms_norm_fp8"):
        x = torch.empty((256, 4096), dtype=bf16)
        residual = torch.empty_like(x) if kernel == "fused_add_rms_norm_fp8" else None
        rmsnorm.rms_norm_fp8(x, torch.empty(4096, dtype=bf16), 1e-5, residual=residual)
    elif kernel == "fused_moe":
        from tokenmill.kernels.triton.fused_moe import fused_experts

        dtype_name, tokens, experts, top_k, hidden, inter = _COMPILE_MOE[p["shape"]]
        dtype = getattr(torch, dtype_name)
        # The alignment's torch ops run here on the CPU: the ids must be valid experts.
        fp8 = p["shape"].endswith("-fp8w")
        stored = torch.float8_e4m3fn if fp8 else dtype
        scales = dict(w13_scale=torch.ones(experts, 2 * inter), w2_scale=torch.ones(experts, hidden)) if fp8 else {}
        fused_experts(torch.empty((tokens, hidden), dtype=dtype), torch.empty((experts, 2 * inter, hidden), dtype=stored),
                      torch.empty((experts, hidden, inter), dtype=stored), torch.ones((tokens, top_k)),
                      torch.zeros((tokens, top_k), dtype=torch.int64), **scales)
    elif kernel == "moe_route":
        from tokenmill.kernels.triton.moe_routing import route_top_k

        route_top_k(torch.empty((100, p["experts"]), dtype=bf16), p["top_k"], True)
    elif kernel == "fp8_gemm":
        from tokenmill.kernels.triton.fp8_gemm import fp8_gemm

        fp8 = torch.float8_e4m3fn
        n, k = p.get("n", 6144), p.get("k", 4096)
        fp8_gemm(torch.empty((p["m"], k), dtype=fp8), torch.empty(p["m"]), torch.empty((n, k), dtype=fp8),
                 torch.empty(n), None, bf16, torch.zeros(100_000, dtype=torch.int32))
    elif kernel == "quantize_fp8_groups":
        from tokenmill.kernels.triton.block_fp8_gemm import quantize_fp8_groups

        quantize_fp8_groups(torch.empty((64, 12288), dtype=bf16))
    elif kernel == "block_fp8_gemm":
        from tokenmill.kernels.triton.block_fp8_gemm import block_fp8_gemm

        fp8 = torch.float8_e4m3fn
        n, k = p.get("n", 6144), p.get("k", 4096)
        block_fp8_gemm(torch.empty((p["m"], k), dtype=fp8), torch.empty((p["m"], k // 128)), torch.empty((n, k), dtype=fp8),
                       torch.empty((n // 128, k // 128)), None, bf16, torch.zeros(100_000, dtype=torch.int32))
    from tokenmill.kernels.triton.w4a16_gemm import SWAPPED_MAX_M

    launched = report[start:]
    assert launched, "the wrapper launched no kernel"
    if kernel == "sample_tokens":
        names = {entry["kernel"] for entry in launched}
        wide = {"_round_draw_kernel", "_round_weigh_kernel", "_wide_histogram_kernel", "_wide_compact_kernel"}
        assert wide <= names, f"the wide top-p launches were not all compiled: {sorted(wide - names)}"
    for entry in launched:
        print(f"  sm_90 {entry}", flush=True)
        assert entry["shared"] <= _SM90_MAX_SHARED, f"{entry['kernel']} needs {entry['shared']} B of shared memory"
        # fp32 is a test-only path (FMA dots); a few spilled bytes there cost nothing we ship.
        # The matmul's odd-shape case (K = 72, N = 200: no row is 16-byte aligned, so every load is a
        # masked scalar one) spills 8 B; that shape only checks correctness, the model shapes must not.
        spill_allowed = 64 if p.get("shape") == "bias-fp16-tails" else 0
        if entry["float_inputs"]:
            assert entry["spill_bytes"] <= spill_allowed, f"{entry['kernel']} spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] in ("_w4a16_kernel", "_fp8_gemm_kernel", "_fp8_swapped_kernel", "_block_fp8_gemm_kernel",
                               "_block_fp8_swapped_kernel"):
            assert entry["wgmma"] or entry["mma_sync"], f"{entry['kernel']}: dots are not on tensor cores"
            assert entry["spill_bytes"] == 0, f"{entry['kernel']} spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] == "_moe_gemm_kernel":
            assert entry["wgmma"] or entry["mma_sync"], "the MoE GEMM's dots are not on tensor cores"
            assert entry["spill_bytes"] == 0, f"the MoE GEMM spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] == "_token_logprobs_kernel":
            assert entry["spill_bytes"] == 0, f"the token logprobs kernel spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] in ("_align_kernel", "_chunk_counts_kernel", "_chunk_rows_kernel", "_chunk_scatter_kernel"):
            # int inputs only, like _rank_kernel below
            assert entry["spill_bytes"] == 0, f"the MoE alignment's {entry['kernel']} spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] == "_rank_kernel":  # int inputs only: the float check above does not see it
            assert entry["spill_bytes"] == 0, f"the decode ranking spills {entry['spill_bytes']} B of registers"
        if entry["kernel"] in ("_paged_attention_kernel", "_paged_attention_fixed_split_kernel", "_varlen_attention_kernel",
                               "_queue_decode_kernel") and entry["float_inputs"]:
            assert entry["wgmma"] or entry["mma_sync"], "bf16/fp16 attention dots are not on tensor cores"
        if (entry["kernel"] == "_paged_attention_kernel" and p.get("shape") in _TWO_PROGRAMS_AN_SM
                and "cache_dtype" not in p and not p.get("deterministic")):
            # The 16-bit prefill tiles (8 warps) run two programs an SM only at <= 128 registers a thread:
            # at 130 one fits, and P5's prefill attention step took 1.5x as long (docs/perf.md 110).
            assert entry["registers"] * entry["options"]["num_warps"] * 32 * 2 <= 65536, (
                f"the prefill tile needs {entry['registers']} registers a thread: one program an SM, not two")
        if entry["kernel"] == "_w4a16_kernel" and p["m"] <= SWAPPED_MAX_M:
            # Decode sizes: the dequantized weight is the wgmma's register operand, made from words
            # that stream in asynchronously; it never goes through shared memory (the reshape of the
            # old GPTQ-ordered layout stored 83 values a thread; what is left is the split-K epilogue).
            assert entry["wgmma"], "the decode-size W4A16 dot is not a warpgroup MMA"
            assert entry["st_shared"] <= 32, f"W4A16 stores {entry['st_shared']} values a thread to shared memory"
        if entry["kernel"] == "_fp8_swapped_kernel":
            # Weights and tokens stream into shared memory through asynchronous copies (a synchronous
            # load a K step, as before the split's start was written as a multiple of BLOCK_K, stalls
            # on every step); what is left are the scales and the split-K epilogue's partials.
            assert entry["wgmma"], "the swapped fp8 dot is not a warpgroup MMA"
            assert entry["sync_loads"] <= 64, f"the swapped fp8 GEMM has {entry['sync_loads']} synchronous loads"
        if entry["kernel"] == "_matmul_kernel" and entry["float_inputs"]:
            # A warpgroup MMA at every M (mma.sync would round differently: see kernels/triton/matmul.py).
            assert entry["wgmma"] and not entry["mma_sync"], "the batch-invariant matmul is not on wgmma"
            if p["shape"] in ("qwen3-0.6b", "llama3-8b"):
                # Both operands stream through asynchronous copies (a plain load would stall every K step).
                assert entry["sync_loads"] == 0, f"the matmul reads {entry['sync_loads']} operands with synchronous loads"


def _compile_worker_main(names: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the sm_90 compile worker must not interpret"
    results: dict[str, str | None] = {}
    try:
        report: list[dict[str, Any]] = []
        _install_compile_only_launcher(report)
    except Exception:  # noqa: BLE001  (an older/newer triton without this internal API)
        reason = "SKIP: cannot compile for sm_90 offline here: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
        print(RESULT_PREFIX + json.dumps({name: reason for name in names}), flush=True)
        return
    for name in names:
        start = time.perf_counter()
        try:
            _check_compile_sm90(CASES[name][1], report)
            results[name] = None
        except Exception:  # noqa: BLE001
            results[name] = traceback.format_exc()
        print(f"{name}: {'ok' if results[name] is None else 'FAIL'} {time.perf_counter() - start:.2f}s", flush=True)
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _compile_worker_main(json.loads(sys.argv[2]))
