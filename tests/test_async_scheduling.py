"""Asynchronous scheduling (step N+1 launched before step N's ids are read back) must not change
a single output. On the CPU nothing overlaps, but the bookkeeping is the same code as on a GPU:
tokens in flight fed to the next step from the device, sequences that stopped while a step was
in flight dropping that step's token, max_tokens sequences left out of the next step.

Each test runs the same workload through an engine with async_scheduling=False (the synchronous
path, itself checked against Hugging Face in test_generate.py) and one with it on.
"""

from __future__ import annotations

import pytest

from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import SamplingParams


def completions(outputs) -> list[tuple]:
    """Everything but logprobs, which may differ in the last bits: a sequence that stopped while a
    step was in flight still fills a row of that step, and batch shape changes fp32 rounding."""
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outputs for c in o.outputs]


def logprobs(outputs) -> list[float]:
    return [lp.logprob for o in outputs for c in o.outputs for step in c.logprobs for lp in step.values()]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return make_llm(tiny_llama_dir, async_scheduling=False), make_llm(tiny_llama_dir, async_scheduling=True)


@pytest.fixture(scope="module")
def prompts(engines):
    return random_prompts(engines[0].llm_engine.config.vocab_size, [5, 23, 40, 1, 17, 33, 9, 12], seed=3)


def run_both(engines, prompts, params):
    sync, overlapped = engines
    before = overlapped.llm_engine.stats.num_overlapped_steps
    expected = sync.generate(as_inputs(prompts), params, use_tqdm=False)
    got = overlapped.generate(as_inputs(prompts), params, use_tqdm=False)
    return expected, got, overlapped.llm_engine.stats.num_overlapped_steps - before


def test_greedy_with_mixed_lengths_and_early_stops(engines, prompts):
    # Stop tokens picked from a first greedy run make some sequences end mid-batch while the
    # others go on, so tokens sampled for them in the step already in flight must be dropped.
    probe = engines[0].generate(as_inputs(prompts), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    stop_ids = [probe[0].outputs[0].token_ids[2], probe[3].outputs[0].token_ids[5]]
    params = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, stop_token_ids=stop_ids, logprobs=2) for i in range(len(prompts))]
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert any(c.finish_reason == "stop" for o in expected for c in o.outputs)
    assert any(c.finish_reason == "length" for o in expected for c in o.outputs)
    assert logprobs(got) == pytest.approx(logprobs(expected), abs=1e-5)
    assert [[list(step) for step in c.logprobs] for o in got for c in o.outputs] == \
        [[list(step) for step in c.logprobs] for o in expected for c in o.outputs]
    assert overlapped > 0


def test_seeded_sampling_with_n_and_stop_strings(engines, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=14, stop=["e"], min_tokens=2)
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert overlapped > 0


def test_prompt_logprobs_and_chunked_prefill(tiny_llama_dir, engines, prompts):
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, ignore_eos=True)
    sync = make_llm(tiny_llama_dir, async_scheduling=False, max_num_batched_tokens=8, max_num_seqs=4)
    chunked = make_llm(tiny_llama_dir, async_scheduling=True, max_num_batched_tokens=8, max_num_seqs=4)
    expected = sync.generate(as_inputs(prompts), params, use_tqdm=False)
    got = chunked.generate(as_inputs(prompts), params, use_tqdm=False)
    assert completions(got) == completions(expected)
    flat = lambda outs: [lp.logprob for o in outs for pos in o.prompt_logprobs[1:] for lp in pos.values()]  # noqa: E731
    assert flat(got) == pytest.approx(flat(expected), abs=1e-5)
    assert chunked.llm_engine.stats.num_overlapped_steps > 0


def test_preemption_under_a_tiny_pool(tiny_llama_dir, engines, prompts):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = engines[0].generate(as_inputs(prompts), params, use_tqdm=False)
    per_block = engines[0].llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, async_scheduling=True, kv_cache_memory_bytes=9 * per_block, enable_prefix_caching=False)
    got = small.generate(as_inputs(prompts), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert completions(got) == completions(expected)


def test_requests_reading_their_history_step_synchronously(engines, prompts):
    # A repetition penalty needs every earlier id on the host: while such a request is live the
    # engine reads each step back before scheduling the next, and outputs stay exact.
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5 if i == 0 else 1.0)
              for i in range(len(prompts))]
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert overlapped < 3  # at most the steps after the penalised request finished


@pytest.mark.parametrize("max_tokens", [100, 7])
def test_no_token_is_computed_past_max_tokens_or_max_model_len(tiny_llama_dir, max_tokens):
    # A sequence whose in-flight token is its last is not scheduled again: past max_model_len
    # (32, two full blocks) it would need a block the block table has no room for.
    sync = make_llm(tiny_llama_dir, async_scheduling=False, max_model_len=32)
    fast = make_llm(tiny_llama_dir, async_scheduling=True, max_model_len=32)
    prompts = random_prompts(sync.llm_engine.config.vocab_size, [20, 31, 16], seed=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = sync.generate(as_inputs(prompts), params, use_tqdm=False)
    got = fast.generate(as_inputs(prompts), params, use_tqdm=False)
    assert completions(got) == completions(expected)
    assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, got)] == \
        [min(32, len(p) + max_tokens) for p in prompts]
    assert fast.llm_engine.stats.num_batched_tokens == sync.llm_engine.stats.num_batched_tokens


def test_abandoned_stream_leaves_the_engine_clean(engines, prompts):
    _, llm = engines
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    stream = llm.stream(as_inputs(prompts[:3]), params)
    for _ in range(4):
        next(stream)
    stream.close()  # aborts the requests while a step is in flight
    expected = engines[0].generate(as_inputs(prompts), params, use_tqdm=False)
    assert completions(llm.generate(as_inputs(prompts), params, use_tqdm=False)) == completions(expected)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.num_usable_blocks
