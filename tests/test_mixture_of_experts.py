"""Mixture-of-experts decoders beyond the shared architecture tests (tests/test_models.py and
tests/test_generate.py run Qwen3-MoE, Qwen2-MoE and Mixtral against transformers like every
other decoder): the routing is really exercised and really checked, the CPU experts loop against
the plain-torch reference the GPU kernel is tested with, tensor parallelism over the experts, and
clear errors for what is not supported.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.models.loader import load_model
from tokenmill.models.source import resolve_model

ATOL = 1e-4


def _ours(path: Path) -> torch.nn.Module:
    return load_model(resolve_model(str(path)), torch.float32, torch.device("cpu"), "auto")


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _sparse_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    from tokenmill.models.layers.moe import SparseMoeBlock

    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def test_tokens_spread_over_the_experts_and_a_wrong_routing_shows(tiny_qwen3_moe_dir, hf_reference, paged_cache):
    """The tiny model's routing sends tokens to most experts with unequal weights (so the
    architecture tests compare real routing), and the comparison with transformers catches an
    unrenormalised top k, two experts swapped, or an expert's down projection off by a little."""
    model = _ours(tiny_qwen3_moe_dir)
    tokens = _tokens(23, model.config.vocab_size, seed=11)
    ref = _hf_logits(hf_reference(tiny_qwen3_moe_dir), tokens)
    blocks = _sparse_blocks(model)
    assert len(blocks) == 2 and len(model.model.layers) == 3  # layer 1 is dense (mlp_only_layers)

    routed = []
    hooks = [b.gate.register_forward_hook(lambda module, args, out: routed.append(out)) for b in blocks]
    torch.testing.assert_close(paged_cache(model).step([(0, tokens)])[0], ref, atol=ATOL, rtol=0)
    for hook in hooks:
        hook.remove()
    for weights, ids in routed:
        assert len(set(ids.flatten().tolist())) >= 6  # of 8 experts
        torch.testing.assert_close(weights.sum(-1), torch.ones(len(tokens)))  # norm_topk_prob
        assert (weights[:, 0] - weights[:, 1]).abs().min() > 0 and weights.std() > 0.05

    def far_off(change) -> bool:
        wrong = _ours(tiny_qwen3_moe_dir)
        with torch.no_grad():
            change(_sparse_blocks(wrong)[0])
        return (paged_cache(wrong).step([(0, tokens)])[0] - ref).abs().max().item() > 10 * ATOL

    assert far_off(lambda block: setattr(block.gate, "renormalize", False))
    assert far_off(lambda block: block.experts.w13.data.index_copy_(0, torch.tensor([0, 1]), block.experts.w13.data[[1, 0]]))
    assert far_off(lambda block: block.experts.w2.data[3].mul_(1.02))


def test_cpu_experts_loop_matches_the_kernel_reference():
    """``experts_by_loop`` (the CPU's path) against ``fused_moe_ref`` (the Triton kernel's twin in
    the GPU and interpreter tests), with experts that get no token and tokens whose experts repeat."""
    from tokenmill.kernels.reference import fused_moe_ref
    from tokenmill.models.layers.moe import experts_by_loop

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, top_k = 13, 24, 20, 7, 3
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    ids = torch.stack([torch.randperm(5, generator=gen)[:top_k] for _ in range(tokens)])  # experts 5, 6 idle
    weights = torch.rand(tokens, top_k, generator=gen)
    out = experts_by_loop(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    assert out.abs().mean() > 0.1


def test_qwen2_moe_greedy_at_tp2_equals_tp1_and_hf(tiny_qwen2_moe_dir):
    """Each rank keeps half of every expert's (and the shared expert's) intermediate features."""
    from test_tensor_parallel import _greedy_matches, make_llm

    tp2 = make_llm(tiny_qwen2_moe_dir, 2)
    try:
        _greedy_matches(tp2, make_llm(tiny_qwen2_moe_dir, 1), tiny_qwen2_moe_dir, seed=5)
    finally:
        tp2.llm_engine.executor.shutdown()


def test_a_missing_expert_tensor_is_named(tiny_mixtral_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mixtral_missing"
    shutil.copytree(tiny_mixtral_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \(1\) model\.layers\.1\.mlp\.experts\.3\.w2\.weight"):
        _ours(folder)


def test_a_pre_quantized_checkpoint_is_refused_by_name(tiny_qwen3_moe_dir, tmp_path):
    """(quantization="fp8" on a full-precision MoE checkpoint works: tests/test_quantization.py.)"""
    import json

    from tokenmill import LLM

    folder = tmp_path / "qwen3_moe_fp8"
    shutil.copytree(tiny_qwen3_moe_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization=fp8 .* not supported for Qwen3MoeForCausalLM: pre-quantized"):
        LLM(str(folder), dtype="float32", device="cpu", max_model_len=64)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_weights_generate(tiny_mixtral_dir, quantization):
    """load_format="dummy" (the GPU benchmarks' random weights) fills the stacked experts too, as fp8
    codes and scales under quantization="fp8" (dequantized here, on the CPU)."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(tiny_mixtral_dir), load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
              kv_cache_memory_bytes=8 * 2**20, quantization=quantization)
    experts = _sparse_blocks(llm.llm_engine.executor.runner.model)[0].experts
    assert experts.w13.abs().sum() > 0 and torch.isfinite(experts.w2).all()
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_qwen2_moe_without_a_shared_expert_matches_transformers(tiny_models_root, hf_reference, paged_cache):
    """shared_expert_intermediate_size=0: transformers still builds the shared expert, zero wide (it
    adds nothing), and saves its empty tensors and its gate; they were refused as unexpected tensors."""
    from transformers import Qwen2MoeConfig

    from support.tiny_models import save_tiny_model, tiny_config_kwargs

    config = Qwen2MoeConfig(**tiny_config_kwargs(num_hidden_layers=1), moe_intermediate_size=32,
                            shared_expert_intermediate_size=0, num_experts=4, num_experts_per_tok=2,
                            architectures=["Qwen2MoeForCausalLM"])
    folder = save_tiny_model(tiny_models_root, "qwen2_moe_no_shared_expert", config, seed=31)
    model = _ours(folder)
    assert _sparse_blocks(model)[0].shared_expert is None
    tokens = _tokens(17, config.vocab_size, seed=12)
    torch.testing.assert_close(paged_cache(model).step([(0, tokens)])[0], _hf_logits(hf_reference(folder), tokens),
                               atol=ATOL, rtol=0)
