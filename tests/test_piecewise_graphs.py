"""The prompt-step graphs' buckets and limit (worker/piecewise_graphs.py; the graphs themselves need
a GPU: tests/gpu/test_engine_gpu.py::test_prompt_step_graphs_equal_eager)."""

from __future__ import annotations

import pytest

from tokenmill.worker.piecewise_graphs import max_graph_tokens, token_buckets


@pytest.mark.parametrize("max_tokens", [16, 100, 256, 400, 5000, 8192, 16384])
def test_buckets_cover_every_step_with_at_most_an_eighth_of_padding(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        size = next(b for b in buckets if b >= tokens)
        assert size - tokens < max(16, tokens / 8 + 1), (tokens, size)


def test_graphs_stop_where_the_gemms_outlast_the_launches():
    # Qwen3-0.6B's decoder layers (28 of ~15.7M weights) against Llama-3-8B's (32 of ~218M).
    small, large = max_graph_tokens(28, 440_000_000, 16384), max_graph_tokens(32, 6_980_000_000, 16384)
    assert 8192 <= small <= 16384 and 512 <= large <= 2048
    assert large in token_buckets(16384) and small in token_buckets(16384)
    assert max_graph_tokens(2, 10_000, 400) == 400  # a tiny model: every step the budget allows
    assert max_graph_tokens(80, 400_000_000_000, 16384) == 256  # never below 256 tokens


def test_weight_count_takes_the_experts_a_token_meets(tiny_qwen3_moe_dir):
    """A mixture-of-experts layer's count is its attention's linear weights and top_k experts' (a token's
    GEMMs), from the config: Qwen3-MoE with 8 experts, 2 a token, one dense layer of three."""
    import torch
    from transformers import AutoConfig

    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.worker.piecewise_graphs import linear_weight_count

    c = AutoConfig.from_pretrained(tiny_qwen3_moe_dir)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    routed = c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
    dense = 3 * c.hidden_size * c.intermediate_size
    expected = c.num_hidden_layers * attention + (c.num_hidden_layers - 1) * routed + dense
    ours = load_model(resolve_model(str(tiny_qwen3_moe_dir)), torch.float32, torch.device("cpu"), "dummy")
    assert linear_weight_count(ours) == expected


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_phi3_dir"])
def test_weight_count_is_the_decoder_layers_linear_weights(fixture, request):
    """What the graphs' limit is estimated from equals the weights of transformers' own linear
    layers in the decoder layers (Phi-3 stores fused qkv and gate_up projections)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenmill.models.loader import load_model
    from tokenmill.models.source import resolve_model
    from tokenmill.worker.piecewise_graphs import linear_weight_count

    path = str(request.getfixturevalue(fixture))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    expected = sum(m.weight.numel() for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear))
    ours = load_model(resolve_model(path), torch.float32, torch.device("cpu"), "dummy")
    assert linear_weight_count(ours) == expected > 0
