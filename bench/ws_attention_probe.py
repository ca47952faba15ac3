"""A question for a later change, not engine code: what would Triton 3.6's warp specialisation on sm_90
give causal prefill attention? (docs/perf.md 109.)

Entry 31 found the engine's prefill tile at ~276 TFLOP/s (35% of peak) and named FA3's warp
specialisation (a producer warpgroup loading, two consumer warpgroups taking turns at the MMAs
and the softmax) as what would overlap its issue and tensor time. Compiled offline, Triton 3.6's
Hopper pass (``NVGPUWarpSpecialization``) does build that from a ``tl.range(...,
warp_specialize=True)`` loop, but only with ``num_warps=4`` (12 warps result), with K and V read
through TMA tensor descriptors, and with one loop (a second, masked loop after it fails the pass):
so the probe masks every tile. The engine's prefill reads keys token by token through the block
table, which TMA cannot; this probe reads contiguous K and V (a whole prompt's own keys, as in a
step whose prompts are not continued chunks) to price the idea before building it. On an H100
(lease BQ) the warp-specialised rows never returned (each under a 40 s timeout), the probe without
it ran 1.13-1.22x the engine's kernel and cuDNN's SDPA 1.7-1.8x. The ``longest_first`` row
launches every sequence's last query block first (the most keys under the causal mask): whether
the order of the triangle's uneven programs costs the causal step part of its rate (``--full``, no
mask, ran 445 TFLOP/s where the causal step ran 344).

Causal attention of B sequences of S tokens, Qwen3-0.6B's heads (16 query heads, 8 kv, 128 wide)
as slices of one qkv output. Rows: the probe kernel with and without warp specialisation, the
engine's paged kernel on the same problem (block 16, contiguous blocks) and torch's SDPA
(flash and cuDNN back ends where present), each checked against SDPA's math back end first.
``--interpret`` runs the probe kernels' logic on the CPU (TRITON_INTERPRET=1, fp16, small).

    python bench/ws_attention_probe.py [--shapes 8x2048 16x1024 4x4096] [--probes 012345] [--no-others] [--full]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

_LOG2E = 1.4426950408889634


@triton.jit
def _probe_kernel(q_desc, k_desc, v_desc, o_ptr, seq_len, scale_log2, stride_o, GROUP: tl.constexpr, HEADS: tl.constexpr,
                  WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr,
                  LONGEST_FIRST: tl.constexpr):
    q_blocks = seq_len // BM
    groups = tl.num_programs(0) // q_blocks  # (sequence, head) pairs
    if LONGEST_FIRST:  # every pair's last query block (the most keys under the mask), then the one before, ...
        q_block = q_blocks - 1 - tl.program_id(0) // groups
        group = tl.program_id(0) % groups
    else:  # a pair's blocks one after the other, first to last
        q_block = tl.program_id(0) % q_blocks
        group = tl.program_id(0) // q_blocks
    head = group % HEADS
    row0 = (group // HEADS) * seq_len
    q = q_desc.load([row0 + q_block * BM, head * D])
    rows = q_block * BM + tl.arange(0, BM)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    col = (head // GROUP) * D
    tiles = (q_block + 1) * (BM // BN) if CAUSAL else seq_len // BN
    for tile in tl.range(0, tiles, warp_specialize=WS):
        k = k_desc.load([row0 + tile * BN, col])
        qk = tl.dot(q, k.T)
        if CAUSAL:
            keys = tile * BN + tl.arange(0, BN)
            qk = tl.where(keys[None, :] <= rows[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row0 + tile * BN, col])
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    acc = acc / l_i[:, None]
    dims = tl.arange(0, D)
    tl.store(o_ptr + (row0 + rows)[:, None] * stride_o + head * D + dims[None, :], acc.to(o_ptr.dtype.element_ty))


def probe_attention(qkv: torch.Tensor, seqs: int, seq_len: int, heads: int, kv_heads: int, dim: int, *, ws: bool,
                    num_warps: int, num_stages: int, block_m: int = 128, block_n: int = 64, causal: bool = True,
                    longest_first: bool = False) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor

    tokens = seqs * seq_len
    out = torch.empty((tokens, heads * dim), dtype=qkv.dtype, device=qkv.device)
    stride = qkv.stride(0)
    q = TensorDescriptor(qkv, [tokens, heads * dim], [stride, 1], [block_m, dim])
    k = TensorDescriptor(qkv[:, heads * dim:], [tokens, kv_heads * dim], [stride, 1], [block_n, dim])
    v = TensorDescriptor(qkv[:, (heads + kv_heads) * dim:], [tokens, kv_heads * dim], [stride, 1], [block_n, dim])
    grid = (seq_len // block_m * seqs * heads,)
    _probe_kernel[grid](q, k, v, out, seq_len, dim**-0.5 * _LOG2E, out.stride(0), GROUP=heads // kv_heads, HEADS=heads,
                        WS=ws, BM=block_m, BN=block_n, D=dim, CAUSAL=causal, LONGEST_FIRST=longest_first,
                        num_warps=num_warps, num_stages=num_stages)
    return out


def sdpa(qkv: torch.Tensor, seqs: int, seq_len: int, heads: int, kv_heads: int, dim: int, backend: Any = None,
         causal: bool = True) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def split(first: int, count: int) -> torch.Tensor:
        return qkv[:, first * dim:(first + count) * dim].reshape(seqs, seq_len, count, dim).transpose(1, 2)

    q, k, v = split(0, heads), split(heads, kv_heads), split(heads + kv_heads, kv_heads)
    if backend is None:
        out = scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True).to(qkv.dtype)
    else:
        with sdpa_kernel(backend):
            out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).reshape(seqs * seq_len, heads * dim)


def engine_prefill(qkv: torch.Tensor, seqs: int, seq_len: int, heads: int, kv_heads: int, dim: int) -> Any:
    """The engine's paged kernel on the same prompts: their K and V stored in a block-16 cache first
    (outside the timed call), the default launch config."""
    from tokenmill.kernels.triton import paged_attention

    block = 16
    tokens = seqs * seq_len
    cache = torch.empty((2, tokens // block, block, kv_heads, dim), dtype=qkv.dtype, device=qkv.device)
    cache[0] = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens // block, block, kv_heads, dim)
    cache[1] = qkv[:, (heads + kv_heads) * dim:].reshape(tokens // block, block, kv_heads, dim)
    starts = torch.arange(0, tokens + 1, seq_len, dtype=torch.int32, device=qkv.device)
    lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=qkv.device)
    tables = torch.arange(tokens // block, dtype=torch.int32, device=qkv.device).reshape(seqs, seq_len // block)
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    config = paged_attention.choose_config(num_tokens=tokens, num_seqs=seqs, num_heads=heads, num_kv_heads=kv_heads,
                                           head_dim=dim, dtype=qkv.dtype, max_query_len=seq_len, max_seq_len=seq_len,
                                           device=qkv.device)

    def run() -> torch.Tensor:
        return paged_attention.paged_attention(q, cache, starts, lens, tables, dim**-0.5, max_query_len=seq_len,
                                               max_seq_len=seq_len, config=config).reshape(tokens, heads * dim)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["8x2048", "16x1024", "4x4096"], help="SEQSxTOKENS, tokens a multiple of 128")
    parser.add_argument("--probes", default="012345", help="which probe rows to run (indices into the list below)")
    parser.add_argument("--no-others", action="store_true", help="the probe rows only (not the engine's kernel or SDPA)")
    parser.add_argument("--full", action="store_true", help="attention without the causal mask (every key of the sequence)")
    parser.add_argument("--interpret", action="store_true", help="the probe kernels' logic on the CPU, fp16, one small shape")
    args = parser.parse_args()
    causal = not args.full
    heads, kv_heads, dim = 16, 8, 128
    # (warp specialised, warps, stages, key tile, longest query blocks first)
    probes = [(True, 4, 3, 64, False), (True, 4, 2, 128, False), (True, 4, 2, 64, False), (False, 8, 3, 64, False),
              (False, 4, 3, 64, False), (False, 8, 3, 64, True)]
    if args.interpret:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        sys.path.insert(0, str(ROOT / "tests"))
        from support.triton_interpreter import patch_triton_interpreter_for_numpy

        patch_triton_interpreter_for_numpy()
        heads, kv_heads, dim = 4, 2, 32
        torch.manual_seed(0)
        qkv = torch.randn(2 * 256, (heads + 2 * kv_heads) * dim, dtype=torch.float16)
        want = sdpa(qkv, 2, 256, heads, kv_heads, dim, causal=causal)
        for ws, warps, stages, block_n, longest_first in probes:
            got = probe_attention(qkv, 2, 256, heads, kv_heads, dim, ws=ws, num_warps=warps, num_stages=stages, block_n=block_n,
                                  causal=causal, longest_first=longest_first)
            print(json.dumps({"probe": [ws, warps, stages, block_n, longest_first],
                              "max_abs_err": (got.float() - want.float()).abs().max().item()}))
        return
    from gpu_timing import _provenance, _time_graph
    from torch.nn.attention import SDPBackend

    for shape in args.shapes:
        seqs, seq_len = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        qkv = torch.randn(seqs * seq_len, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device="cuda")
        want = sdpa(qkv, seqs, seq_len, heads, kv_heads, dim, causal=causal)
        flops = 4 * seqs * heads * dim * seq_len * ((seq_len + 1) / 2 if causal else seq_len)
        runs: list[tuple[str, dict[str, Any], Any]] = [
            (f"probe ws={ws} warps={w} stages={s} block_n={n}" + (" longest_first" if lf else ""),
             {"ws": ws, "num_warps": w, "num_stages": s, "block_n": n, "longest_first": lf},
             lambda ws=ws, w=w, s=s, n=n, lf=lf: probe_attention(qkv, seqs, seq_len, heads, kv_heads, dim, ws=ws, num_warps=w,
                                                                 num_stages=s, block_n=n, causal=causal, longest_first=lf))
            for i, (ws, w, s, n, lf) in enumerate(probes) if str(i) in args.probes
        ]
        if not args.no_others:
            if causal:  # the engine's prefill is causal only
                runs.append(("engine paged prefill", {}, engine_prefill(qkv, seqs, seq_len, heads, kv_heads, dim)))
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                backend = getattr(SDPBackend, name)
                runs.append((f"sdpa {name.lower()}", {}, lambda b=backend: sdpa(qkv, seqs, seq_len, heads, kv_heads, dim, b, causal)))
        for label, knobs, fn in runs:
            row: dict[str, Any] = {**_provenance("ws_attention_probe", label), "seqs": seqs, "seq_len": seq_len, "causal": causal,
                                   **knobs}
            try:
                row["max_abs_err"] = round((fn().float() - want.float()).abs().max().item(), 5)
                median, best = _time_graph(fn)
                row.update(us=round(median, 1), tflops=round(flops / median / 1e6, 1), best_us=round(best, 1))
            except Exception as error:  # noqa: BLE001  (a probe that does not compile or run is a row too)
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
