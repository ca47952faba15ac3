"""Varlen attention (pooling: packed whole prompts, no cache) against its twin on a CUDA GPU: P6's
step shapes, lengths around the tile edges, causal and bidirectional, every launch-shape knob, fp32,
and the backend's two entry points without host syncs.

Skipped without CUDA (tests/gpu/conftest.py). Triton is imported inside the tests only.
``TOKENMILL_KERNEL_DRYRUN=1 TRITON_INTERPRET=1`` runs the same logic on the CPU interpreter with
tiny lengths and fp16 for bf16 (tests/support/gpu_kernel_cases.py), graph/sync tests skipped.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from support.gpu_kernel_cases import DEVICE, DRYRUN, _attn_tol, _count, _dtype, _len

# ---------------------------------------------------------------- varlen attention (pooling: whole prompts, no cache)
VARLEN_HEADS = {  # name: (num_heads, num_kv_heads, head_dim)
    "qwen3-0.6b": (16, 8, 128),
    "minilm": (12, 12, 32),
    "bert-base": (12, 12, 64),
    "llama3-8b": (32, 8, 128),
    "g4-d256": (16, 4, 256),
    "g3-d80": (12, 4, 80),  # head_dim padded to 128 in the kernel
}
VARLEN_SCENARIOS = {  # name: lengths of one step's packed prompts
    "p6-qwen3": lambda rng: [rng.randint(8, 384) for _ in range(_count(96))],
    "p6-minilm": lambda rng: [rng.randint(8, 128) for _ in range(_count(512))],
    # Lengths around the 64-key and 64/128-token tiles (a dry run keeps only the short ones).
    "edges": lambda rng: [1, 2, 17, 0, 3] if DRYRUN else [1, 2, 63, 64, 65, 127, 128, 129, 1, 0, 3],
    "long": lambda rng: [_len(4096), _len(1500), 1, _len(777)],
}


def _check_varlen(heads: str, lens: list[int], dtype: torch.dtype, causal: bool, config: Any = None, pad: int = 3) -> None:
    from tokenmill.kernels.reference import varlen_attention_ref
    from support.kernel_cases import make_varlen_batch
    from tokenmill.kernels.triton.varlen_attention import varlen_attention

    num_heads, num_kv_heads, head_dim = VARLEN_HEADS[heads]
    batch = make_varlen_batch(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                              device=DEVICE, num_pad_tokens=pad, seed=len(lens))
    scale = head_dim**-0.5
    out = torch.full_like(batch.q, float("nan"))
    varlen_attention(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal=causal, max_seqlen=max(lens), out=out, config=config)
    expected = varlen_attention_ref(batch.q, batch.k, batch.v, batch.cu_seqlens, scale, causal)
    n = sum(lens)
    torch.testing.assert_close(out[:n].float(), expected[:n].float(), **_attn_tol(dtype), msg=lambda m: f"{config}: {m}")
    assert torch.isnan(out[n:]).all(), "rows past the last sequence were written"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("heads", list(VARLEN_HEADS))
@pytest.mark.parametrize("scenario", list(VARLEN_SCENARIOS))
def test_varlen_attention_matches_reference(scenario: str, heads: str, causal: bool, dtype: str) -> None:
    lens = VARLEN_SCENARIOS[scenario](random.Random(11))
    _check_varlen(heads, lens, _dtype(dtype), causal)


VARLEN_CONFIGS = [  # (block_q, tile_n, num_warps, num_stages)
    (16, 16, 4, 2), (32, 32, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (128, 64, 8, 3), (32, 64, 8, 4),
]


@pytest.mark.parametrize("cfg", VARLEN_CONFIGS, ids=lambda c: "bq{}-n{}-w{}-st{}".format(*c))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_varlen_attention_forced_configs(cfg: tuple[int, int, int, int], causal: bool) -> None:
    """Every launch-shape knob gives the same answer (the benchmark's sweep must be correct)."""
    from tokenmill.kernels.triton.varlen_attention import VarlenAttentionConfig

    config = VarlenAttentionConfig(block_q=cfg[0], tile_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    _check_varlen("qwen3-0.6b", VARLEN_SCENARIOS["edges"](None), _dtype("bfloat16"), causal, config)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_varlen_attention_fp32(causal: bool) -> None:
    _check_varlen("g3-d80", VARLEN_SCENARIOS["edges"](None), torch.float32, causal)


@pytest.mark.skipif(DRYRUN, reason="CUDA only")
def test_varlen_backend_never_syncs() -> None:
    """A pooling step's attention, both entry points, launches without a host sync."""
    from tokenmill.attention.metadata import AttentionMetadata, QKVPrologue
    from tokenmill.attention.varlen_backend import VarlenAttentionBackend
    from support.kernel_cases import make_varlen_batch, rope_cos_sin_cache

    lens = VARLEN_SCENARIOS["p6-qwen3"](random.Random(2))
    batch = make_varlen_batch(lens, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device=DEVICE)
    tokens = batch.qkv.shape[0]
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(empty, batch.cu_seqlens, batch.cu_seqlens.diff(), torch.empty(len(lens), 0, dtype=torch.int32, device=DEVICE),
                             0, lens, lens, max(lens), max(lens))
    positions = torch.cat([torch.arange(n, device=DEVICE) for n in lens])
    weight = torch.ones(128, dtype=torch.bfloat16, device=DEVICE)
    prologue = QKVPrologue(16, 8, 128, rope_cos_sin_cache(512, 128, device=DEVICE), weight, weight, 1e-6)
    backend = VarlenAttentionBackend()

    def step() -> None:
        backend.attend(batch.q, batch.k, batch.v, meta, 0.1, causal=False)
        backend.forward_qkv(batch.qkv.contiguous(), positions, prologue, None, meta, 0.1)

    step()  # compile first: the first launch of a new specialisation may sync
    torch.cuda.synchronize()
    contiguous = batch.qkv.contiguous()  # made before the check: the step itself copies nothing
    assert contiguous.shape[0] == tokens
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.attend(batch.q, batch.k, batch.v, meta, 0.1, causal=False)
        backend.forward_qkv(contiguous, positions, prologue, None, meta, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
