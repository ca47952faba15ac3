"""Varlen attention's cases and checks under the interpreter (packed whole prompts without a cache,
for pooling), run by the workers of ``test_kernels_interpret.py`` (which merges ``CASES`` and
``CHECKS`` into its own): the kernel against ``reference.varlen_attention_ref`` under both masks,
and whole pooling models through ``VarlenAttentionBackend`` against transformers.
"""

from __future__ import annotations

from typing import Any

CASES: dict[str, tuple[str, dict[str, Any]]] = {}


def _case(check: str, name: str, **params: Any) -> None:
    CASES[name] = (check, params)


for _dt in ("float32", "float16"):
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
# Whole pooling models on the GPU path's attention (the varlen backend, and for the decoder the fused
# qkv prologue) against transformers: a BERT encoder (bidirectional) and a Qwen3 embedder (causal, GQA).
_case("pooling_varlen", "pooling-varlen-bert-and-qwen3-vs-transformers")


def _tol(dtype: Any) -> dict[str, float]:
    import torch

    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}


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

    # Two steps of max_num_seqs 4: one token, one tile (16) and past it. Longer prompts' tiles are the
    # varlen cases' above; here each token costs the interpreter three qkv-prologue programs a layer.
    lens = [1, 5, 17, 2, 16]
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



CHECKS = {"varlen": _check_varlen, "pooling_varlen": _check_pooling_varlen}
