"""End to end on tiny random models: greedy tokens and logprobs against Hugging Face, and the
engine's mechanisms (batching, prefix caching, preemption, chunked prefill) leaving outputs unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from reference import hf_greedy, hf_model
from tokenmill import LLM, SamplingParams

ARCHITECTURES = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir", "tiny_phi3_dir", "tiny_granite_dir", "tiny_smollm3_dir",
                 "tiny_qwen3_moe_dir", "tiny_qwen2_moe_dir", "tiny_mixtral_dir"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_llm(path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=64 * 2**20, seed=0)
    options.update(kwargs)
    return LLM(str(path), **options)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def llama_prompts(llama_llm):
    return random_prompts(llama_llm.llm_engine.config.vocab_size, [5, 23, 40, 1, 17, 33], seed=1)


@pytest.mark.parametrize("fixture", ARCHITECTURES)
def test_greedy_tokens_and_logprobs_match_hf(fixture, request):
    path = request.getfixturevalue(fixture)
    llm = make_llm(path)
    prompts = random_prompts(llm.llm_engine.config.vocab_size, [3, 18, 37])
    params = GREEDY.clone(logprobs=0)
    outputs = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    reference = hf_model(str(path))
    for prompt, output in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(reference, prompt, params.max_tokens)
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-4
        assert completion.cumulative_logprob == pytest.approx(sum(ours), abs=1e-4)
        assert completion.finish_reason == "length" and output.finished
        assert output.prompt_token_ids == prompt


def test_batch_equals_each_prompt_alone(llama_llm, llama_prompts):
    batched = token_ids(llama_llm.generate(as_inputs(llama_prompts), GREEDY, use_tqdm=False))
    alone = [token_ids(llama_llm.generate(as_inputs([p]), GREEDY, use_tqdm=False))[0] for p in llama_prompts]
    assert batched == alone


def test_prefix_cache_hit_gives_same_output(tiny_llama_dir, llama_llm, llama_prompts):
    base = llama_prompts[2]  # 40 tokens: two full blocks of 16 are shareable
    variants = [base, base[:36] + [7, 8, 9], base + [11, 12]]
    cold = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    expected = token_ids(cold.generate(as_inputs(variants), GREEDY, use_tqdm=False))
    llama_llm.generate(as_inputs([base]), GREEDY, use_tqdm=False)  # warm the cache
    outputs = llama_llm.generate(as_inputs(variants), GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert all(o.num_cached_tokens >= 32 for o in outputs)


def test_skip_reading_prefix_cache_computes_the_whole_prompt(llama_llm):
    """Two prompts sharing 40 tokens (two full blocks): the second, with skip_reading_prefix_cache,
    takes no cached block, and gives the same tokens; the blocks it computes still serve others."""
    base = random_prompts(llama_llm.llm_engine.config.vocab_size, [40], seed=21)[0]  # no other test uses it
    variants = [base + [5, 6], base + [7, 8], base + [9]]
    skip = GREEDY.clone(skip_reading_prefix_cache=True)
    first = llama_llm.generate(as_inputs(variants[:1]), skip, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    skipping = llama_llm.generate(as_inputs(variants[1:2]), skip, use_tqdm=False)[0]
    reading = llama_llm.generate(as_inputs(variants[1:2]), GREEDY, use_tqdm=False)[0]
    assert skipping.num_cached_tokens == 0 and reading.num_cached_tokens >= 32  # first's blocks were committed
    assert skipping.outputs[0].token_ids == reading.outputs[0].token_ids
    default = llama_llm.generate(as_inputs(variants[2:]), GREEDY.clone(skip_reading_prefix_cache=False), use_tqdm=False)[0]
    assert default.num_cached_tokens >= 32


def test_cache_creation_tokens_count_the_full_prompt_blocks_a_request_computed(llama_llm):
    """vLLM's num_cache_creation_tokens: the prompt tokens a request computed into full blocks of the
    prefix cache (16-token blocks here): all of a new 42-token prompt's 32, none of a repeat's, and a
    sibling sharing 40 tokens adds only its third block's worth."""
    block = llama_llm.llm_engine.config.block_size
    base = random_prompts(llama_llm.llm_engine.config.vocab_size, [40], seed=23)[0]  # no other test uses it
    first = llama_llm.generate(as_inputs([base + [5, 6]]), GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, first.num_cache_creation_tokens) == (0, 42 // block * block)
    again = llama_llm.generate(as_inputs([base + [5, 6]]), GREEDY, use_tqdm=False)[0]
    assert again.num_cache_creation_tokens == 0 and again.num_cached_tokens == 42 // block * block
    longer = llama_llm.generate(as_inputs([base + list(range(3, 13))]), GREEDY, use_tqdm=False)[0]  # 50 tokens
    assert longer.num_cached_tokens == 40 // block * block
    assert longer.num_cache_creation_tokens == 50 // block * block - longer.num_cached_tokens
    # vLLM's fields for what tokenmill does not do are there, and None.
    assert (first.lora_request, first.encoder_prompt, first.encoder_prompt_token_ids, first.kv_transfer_params,
            first.ec_transfer_params, first.outputs[0].lora_request, first.outputs[0].routed_experts) == (None,) * 7


def test_prefix_key_collision_never_reuses_another_prompts_block(tiny_llama_dir, llama_prompts, monkeypatch):
    """Every prefix-cache key forced equal, so each block's key collides with every other's: a hit
    is checked on the block's token ids, so no prompt computes on another prompt's keys and values."""
    from tokenmill.engine import kv_cache

    first, second = llama_prompts[2], llama_prompts[5]  # 40 and 33 tokens, different from the first block on
    cold = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    expected = [token_ids(cold.generate(as_inputs([p]), GREEDY, use_tqdm=False))[0] for p in (first, second, first)]
    monkeypatch.setattr(kv_cache, "chain_hash", lambda parent, tokens: b"one key for every block")

    def one_by_one() -> tuple[list[list[int]], list[int]]:
        llm = make_llm(tiny_llama_dir)  # prefix caching on; each prompt finds the cache its predecessors left
        outputs = [llm.generate(as_inputs([p]), GREEDY, use_tqdm=False)[0] for p in (first, second, first)]
        return token_ids(outputs), [o.num_cached_tokens for o in outputs]

    outputs, cached = one_by_one()
    assert outputs == expected
    # second reuses nothing; first again hits its own first block (16 tokens), and no more: the
    # one key now names that block, whose tokens are not first's second block.
    assert cached == [0, 0, 16]
    # The key alone, as the lookup was before the token check: second computes on first's block.
    monkeypatch.setattr(kv_cache.BlockPool, "lookup", lambda self, key, tokens: self.cached.get(key))
    outputs, cached = one_by_one()
    assert cached[1] > 0 and outputs[1] != expected[1]


def test_preemption_under_a_tiny_kv_pool_gives_same_output(tiny_llama_dir, llama_llm, llama_prompts):
    params = GREEDY.clone(max_tokens=30)
    expected = token_ids(llama_llm.generate(as_inputs(llama_prompts), params, use_tqdm=False))
    per_block = llama_llm.llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, kv_cache_memory_bytes=9 * per_block, enable_prefix_caching=False)
    outputs = small.generate(as_inputs(llama_prompts), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == expected


def test_preemption_keeps_every_prompt_position_scored_once(tiny_llama_dir, llama_llm, monkeypatch):
    """Prompt logprobs (k = 1, without decoded tokens) of sequences preempted in the middle of their
    prefill and computed again (a 7-block pool, 32 tokens a step): each position appears once, with
    the values an ample pool gives; the positions scored a second time are left out."""
    from tokenmill.engine.output_processor import OutputProcessor

    prompts = random_prompts(llama_llm.llm_engine.config.vocab_size, [60, 55, 50, 45], seed=3)
    params = GREEDY.clone(max_tokens=12, prompt_logprobs=1, detokenize=False)
    expected = llama_llm.generate(as_inputs(prompts), params, use_tqdm=False)
    rescored = []
    record = OutputProcessor.record_prompt_logprobs

    def spy(self, result):
        for chunk in result.prompt_logprobs.read() if result.prompt_logprobs is not None else ():
            rescored.append(max(0, len(chunk.seq.request.prompt_logprobs) - chunk.first))
        record(self, result)

    monkeypatch.setattr(OutputProcessor, "record_prompt_logprobs", spy)
    per_block = llama_llm.llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, kv_cache_memory_bytes=7 * per_block, enable_prefix_caching=False,
                     max_num_batched_tokens=32)
    outputs = small.generate(as_inputs(prompts), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0 and any(rescored), rescored
    for prompt, want, got in zip(prompts, expected, outputs, strict=True):
        assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
        for position in range(1, len(prompt)):
            mine, theirs = got.prompt_logprobs[position], want.prompt_logprobs[position]
            assert list(mine) == list(theirs) and list(mine)[0] == prompt[position]
            for token, entry in mine.items():
                assert entry.rank == theirs[token].rank and entry.decoded_token is None
                assert entry.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)


def test_chunked_prefill_gives_same_output(tiny_llama_dir, llama_llm, llama_prompts):
    expected = token_ids(llama_llm.generate(as_inputs(llama_prompts), GREEDY, use_tqdm=False))
    chunked = make_llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = chunked.generate(as_inputs(llama_prompts), GREEDY, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert chunked.llm_engine.stats.num_steps > len(llama_prompts) * GREEDY.max_tokens / 4


def test_prompt_of_exactly_max_model_len_gets_one_token(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, max_model_len=32)
    prompt = random_prompts(llm.llm_engine.config.vocab_size, [32])[0]
    out = llm.generate(as_inputs([prompt]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    ref, _ = hf_greedy(hf_model(str(tiny_llama_dir)), prompt, 1)
    assert out.token_ids == ref


def test_prompt_forms_and_outputs_in_input_order(llama_llm, llama_prompts):
    tokenizer = llama_llm.get_tokenizer()
    text = "hello world"
    outputs = llama_llm.generate([text, {"prompt": text}, {"prompt_token_ids": tokenizer.encode(text)}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs[:2]] == [text, text]
    assert token_ids(outputs)[0] == token_ids(outputs)[1] == token_ids(outputs)[2]
    single = llama_llm.generate(text, GREEDY, use_tqdm=False)
    assert len(single) == 1 and token_ids(single)[0] == token_ids(outputs)[0]
    ids = [int(o.request_id) for o in outputs]
    assert ids == sorted(ids)


def test_token_id_lists_are_prompts_as_in_vllm(llama_llm, llama_prompts):
    """vLLM's rule: a list starting with an int is one prompt of token ids; a list of such lists
    is several; each gives what its {"prompt_token_ids": ...} form gives."""
    expected = token_ids(llama_llm.generate(as_inputs(llama_prompts[:2]), GREEDY, use_tqdm=False))
    single = llama_llm.generate(llama_prompts[0], GREEDY, use_tqdm=False)
    assert len(single) == 1 and token_ids(single) == expected[:1] and single[0].prompt_token_ids == llama_prompts[0]
    assert token_ids(llama_llm.generate(llama_prompts[:2], GREEDY, use_tqdm=False)) == expected
    mixed = llama_llm.generate([llama_prompts[0], {"prompt_token_ids": llama_prompts[1]}], GREEDY, use_tqdm=False)
    assert token_ids(mixed) == expected


def test_cache_salt_shares_blocks_only_within_a_salt(llama_llm):
    """vLLM's cache_salt: prompts with the same salt share prefix-cache blocks, prompts with another
    salt or none do not; the tokens are the same either way."""
    base = random_prompts(llama_llm.llm_engine.config.vocab_size, [40], seed=22)[0]  # no other test uses it
    run = lambda tail, **salt: llama_llm.generate([{"prompt_token_ids": base + tail, **salt}], GREEDY, use_tqdm=False)[0]
    first = run([5], cache_salt="alice")
    other_salt, unsalted, same_salt = run([6], cache_salt="bob"), run([7]), run([8], cache_salt="alice")
    assert first.num_cached_tokens == other_salt.num_cached_tokens == unsalted.num_cached_tokens == 0
    assert same_salt.num_cached_tokens >= 32
    assert run([9]).num_cached_tokens >= 32  # the unsalted prompt's blocks serve unsalted prompts
    plain = llama_llm.generate([{"prompt_token_ids": base + [5]}], GREEDY.clone(skip_reading_prefix_cache=True), use_tqdm=False)
    assert first.outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_per_prompt_sampling_params(llama_llm, llama_prompts):
    params = [GREEDY.clone(max_tokens=k) for k in (1, 4, 7)]
    outputs = llama_llm.generate(as_inputs(llama_prompts[:3]), params, use_tqdm=False)
    assert [len(t) for t in token_ids(outputs)] == [1, 4, 7]
    with pytest.raises(ValueError, match="3 sampling_params for 2 prompts"):
        llama_llm.generate(as_inputs(llama_prompts[:2]), params, use_tqdm=False)


def test_kv_cache_is_sized_from_kv_cache_memory_bytes(tiny_llama_dir, llama_llm):
    per_block = llama_llm.llm_engine.executor.runner.kv_bytes_per_block()
    llm = make_llm(tiny_llama_dir, kv_cache_memory_bytes=20 * per_block + 5)
    assert llm.llm_engine.kv.pool.num_blocks == 20
    assert torch.all(llm.llm_engine.executor.runner.kv_caches[0][:, 0] == 0)  # the null block is zeroed
