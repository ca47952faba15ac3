"""peer_bench.py's workloads on a mixture-of-experts shape: Qwen3-30B-A3B (48 layers, 128 experts of
768 intermediate features, 8 a token, renormalised; ~30.5 B parameters, 61 GB in bf16: one H200 or
H100 holds it with ~10-60 GB of KV cache), random weights, any engine with vLLM's offline API.

    python bench/moe_peer_bench.py ENGINE qwen3-30b-a3b|mixtral-8x7b WORKLOAD [WORKLOAD ...]

e.g. ``tokenmill qwen3-30b-a3b nano uniform`` beside ``vllm qwen3-30b-a3b nano uniform`` in one
lease. peer_bench.py is the team's shared script, kept unchanged: this one only adds the shape to
its table and runs its main.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from script_usage import check_usage  # noqa: E402
import peer_bench  # noqa: E402

peer_bench.CONFIGS["qwen3-30b-a3b"] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
    rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
    attention_bias=False,
)

# Mixtral-8x7B (32 layers, 8 experts of 14,336 intermediate features, 2 a token; ~46.7 B parameters,
# 93 GB in bf16: one H200, not one H100).
peer_bench.CONFIGS["mixtral-8x7b"] = dict(
    architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
    num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=32000, tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=32768,
    rms_norm_eps=1e-5, hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, sliding_window=None,
)

if __name__ == "__main__":
    check_usage(__doc__, 2)
    peer_bench.main()
