"""``kv_cache_dtype="fp8"``: keys and values stored as float8 e4m3 (saturating, scale 1, as vLLM
without calibrated scales) and read back in the model's dtype.

The reference is Hugging Face transformers in fp32 with one change, made through its public
attention registry: the attention function rounds the (rotated) keys and values to float8 e4m3
before attending, which is what reading them from an fp8 cache amounts to. Greedy tokens and
logprobs must match that reference, and the reference must differ from plain fp32 attention (so
the test would catch a cache that silently stayed in fp32).
"""

from __future__ import annotations

import functools

import pytest
import torch

from reference import hf_greedy, hf_model, hf_next_logprobs
from test_generate import GREEDY, as_inputs, make_llm, random_prompts
from tokenmill import LLM


def _round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    limit = torch.finfo(torch.float8_e4m3fn).max  # saturating, as vLLM's fp8 cache
    return x.clamp(-limit, limit).to(torch.float8_e4m3fn).to(x.dtype)


@functools.lru_cache(maxsize=4)
def _hf_fp8_kv_model(path: str):
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, _round_to_fp8(key), _round_to_fp8(value), *args, **kwargs)

    AttentionInterface.register("tokenmill_test_fp8_kv", fp8_kv_attention)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="tokenmill_test_fp8_kv").eval()


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_fp8_cache_matches_hf_with_fp8_keys_and_values(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = make_llm(path, kv_cache_dtype="fp8")
    prompts = random_prompts(llm.llm_engine.config.vocab_size, [4, 19, 37], seed=3)
    params = GREEDY.clone(logprobs=0)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    fp8_reference, fp32_reference = _hf_fp8_kv_model(str(path)), hf_model(str(path))
    largest_fp8_effect = 0.0
    for prompt, output in zip(prompts, outputs):
        tokens, logprobs = hf_greedy(fp8_reference, prompt, params.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-4
        full = [float(hf_next_logprobs(fp32_reference, prompt + tokens[:i])[t]) for i, t in enumerate(tokens)]
        largest_fp8_effect = max(largest_fp8_effect, max(abs(a - b) for a, b in zip(full, logprobs)))
    assert largest_fp8_effect > 1e-3, "fp8 rounding changed nothing: the comparison would not catch an fp32 cache"


def test_fp8_cache_holds_more_blocks_and_survives_preemption_and_prefix_hits(tiny_llama_dir):
    fp32 = make_llm(tiny_llama_dir)
    fp8 = make_llm(tiny_llama_dir, kv_cache_dtype="fp8_e4m3")
    assert fp8.llm_engine.config.kv_cache_dtype == torch.float8_e4m3fn
    per_block = fp8.llm_engine.executor.runner.kv_bytes_per_block()
    assert 4 * per_block == fp32.llm_engine.executor.runner.kv_bytes_per_block()  # 1 byte a value against 4
    prompts = random_prompts(fp8.llm_engine.config.vocab_size, [30, 30, 12], seed=5)
    prompts[1][:20] = prompts[0][:20]  # the second prompt hits the first one's fp8 blocks
    params = GREEDY.clone(max_tokens=30)
    cold = make_llm(tiny_llama_dir, kv_cache_dtype="fp8", enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in cold.generate(as_inputs(prompts), params, use_tqdm=False)]
    fp8.generate(as_inputs(prompts[:1]), params, use_tqdm=False)
    warm = fp8.generate(as_inputs(prompts), params, use_tqdm=False)
    assert warm[1].num_cached_tokens >= 16
    assert [o.outputs[0].token_ids for o in warm] == expected
    small = make_llm(tiny_llama_dir, kv_cache_dtype="fp8", kv_cache_memory_bytes=7 * per_block, enable_prefix_caching=False)
    outputs = small.generate(as_inputs(prompts), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_unknown_kv_cache_dtype_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8'.*one of"):
        LLM(str(tiny_llama_dir), kv_cache_dtype="int8", device="cpu")


def test_fp8_store_saturates_instead_of_overflowing_to_nan():
    from tokenmill.attention.torch_backend import store_kv
    from tokenmill.kernels.reference import store_kv_ref

    k = torch.tensor([[[1000.0, -1000.0, 447.0, 3.0]]])  # one token, one kv head, head_dim 4
    v = -k
    for store in (store_kv, store_kv_ref):
        cache = torch.zeros((2, 1, 2, 1, 4), dtype=torch.float8_e4m3fn)
        store(k, v, cache, torch.tensor([1]))
        assert cache[0, 0, 1, 0].float().tolist() == [448.0, -448.0, 448.0, 3.0]  # 447 rounds to 448
        assert cache[1, 0, 1, 0].float().tolist() == [-448.0, 448.0, -448.0, -3.0]
        assert not cache.float().isnan().any()
