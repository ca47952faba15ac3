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
from tokenmill import RepetitionDetectionParams, SamplingParams


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
    # A Python logits processor reads every earlier id on the host: while such a request is live
    # the engine reads each step back before scheduling the next, and outputs stay exact.
    def no_repeats(output_ids, logits):
        logits[list(output_ids)] = float("-inf")
        return logits

    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logits_processors=[no_repeats] if i == 0 else None)
              for i in range(len(prompts))]
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert overlapped < 3  # at most the steps after that request finished


def _penalty_workload(engines, prompts) -> list[SamplingParams]:
    """Every penalty and logit control that keeps its state on the device, mixed over the batch:
    greedy and seeded sampled rows (unseeded draws would differ with the number of steps), n > 1,
    min_tokens held against stop ids that the unconstrained run does produce, and multi-token bad
    words taken from that run's own outputs."""
    probe = engines[0].generate(as_inputs(prompts), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)
    out = [o.outputs[0].token_ids for o in probe]
    tokenizer = engines[0].get_tokenizer()
    bad_words = [tokenizer.decode(out[1][3:5]), tokenizer.decode(out[4][:1])]
    stops = [out[0][1], out[2][0]]
    settings = [
        dict(temperature=0, repetition_penalty=1.4),
        dict(temperature=0.9, seed=5, frequency_penalty=0.8, presence_penalty=0.3, top_k=20),
        dict(temperature=0, bad_words=bad_words, repetition_penalty=1.2),
        dict(temperature=0, min_tokens=6, stop_token_ids=stops, presence_penalty=1.0),
        dict(temperature=1.1, seed=9, n=3, repetition_penalty=1.3, top_p=0.8, logit_bias={out[5][2]: 4.0}),
        dict(temperature=0, allowed_token_ids=sorted(set(out[6] + out[7]))[:6], frequency_penalty=0.5),
        dict(temperature=0.7, seed=11, bad_words=bad_words, min_p=0.05, logit_bias={out[3][0]: -100.0}),
        dict(temperature=0),
    ]
    return [SamplingParams(max_tokens=14, ignore_eos=True, **settings[i % len(settings)]) for i in range(len(prompts))]


def test_penalties_and_logit_controls_overlap_and_match_sync(engines, prompts):
    params = _penalty_workload(engines, prompts)
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert overlapped >= 10  # the engine no longer waits for each step of these requests
    plain = engines[0].generate(as_inputs(prompts), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
                                use_tqdm=False)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0 and p.n == 1]
    assert any(expected[i].outputs[0].token_ids != plain[i].outputs[0].token_ids for i in greedy_rows)


def test_penalties_under_preemption(tiny_llama_dir, engines, prompts):
    # A pool that cannot hold every sequence: sequences are preempted and recomputed. The plan
    # reports them to the runner, which drops their penalty counts, bans and recent ids and rebuilds
    # them from the tokens the host knows when they sample again.
    params = [p.clone(max_tokens=30) for p in _penalty_workload(engines, prompts)]
    expected = engines[0].generate(as_inputs(prompts), params, use_tqdm=False)
    per_block = engines[0].llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, async_scheduling=True, kv_cache_memory_bytes=9 * per_block, enable_prefix_caching=False)
    penalties = small.llm_engine.executor.runner.penalties
    refilled = []
    fill = penalties._fill

    def spy(new, to_device):
        refilled.extend(len(seq.output_token_ids) for _, seq in new if seq.output_token_ids)
        fill(new, to_device)

    penalties._fill = spy
    got = small.generate(as_inputs(prompts), params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert refilled, "no preempted sequence with outputs had its penalty state rebuilt"
    assert completions(got) == completions(expected)


def test_repetition_stops_drop_the_token_in_flight(engines, prompts):
    # A loop is found only once its last token is read back, a step after the next one was
    # launched: the in-flight token must be dropped, as after a stop token. Few allowed tokens make
    # the random model loop (greedy rows) or repeat by chance (seeded rows, n > 1); a logit bias
    # forces a run of one token.
    detect = RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    settings = [
        dict(temperature=0, allowed_token_ids=[60, 61, 62]),
        dict(temperature=1.0, seed=4, n=3, allowed_token_ids=[70, 71]),
        dict(temperature=0, logit_bias={33: 100.0}, min_tokens=5),
        dict(temperature=0),  # no detection asked: runs to max_tokens
    ]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, repetition_detection=detect if i % 4 != 3 else None,
                             **settings[i % 4]) for i in range(len(prompts))]
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    reasons = [c.finish_reason for o in expected for c in o.outputs]
    assert reasons.count("repetition") >= 6 and "length" in reasons
    assert overlapped >= 10


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


def test_grammars_keep_the_overlap(tiny_llama_dir, engines, prompts):
    """Structured outputs no longer force synchronous steps: a step with grammar rows launches its
    forward, the previous step's tokens reach the matchers, then its draw (StepResult.pending_draw).
    Rows under a JSON schema and a regex beside free rows, seeded so each row's draws are its own:
    the same completions as the synchronous engine, every constrained one complete and valid; also
    with n=2 under preemption."""
    import json

    from tokenmill import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    kinds = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-c]{2,9}!"), None]
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=40 if kinds[i % 3] else 3 + i,
                             structured_outputs=kinds[i % 3]) for i in range(len(prompts))]
    expected, got, overlapped = run_both(engines, prompts, params)
    assert completions(got) == completions(expected)
    assert overlapped > 0
    # Forked matchers (n=2) in a pool too small for every sequence: preempted ones recompute.
    forked = [p.clone(n=2) for p in params]
    per_block = engines[0].llm_engine.executor.runner.kv_bytes_per_block()
    small = make_llm(tiny_llama_dir, async_scheduling=True, kv_cache_memory_bytes=9 * per_block, enable_prefix_caching=False)
    got_small = small.generate(as_inputs(prompts), forked, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0 and small.llm_engine.stats.num_overlapped_steps > 0
    assert completions(got_small) == completions(engines[0].generate(as_inputs(prompts), forked, use_tqdm=False))
    tokenizer = engines[1].get_tokenizer()
    for i, out in enumerate(got):
        text = tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)  # .text may carry a broken prompt byte
        if i % 3 == 0:
            assert out.outputs[0].finish_reason == "stop" and set(json.loads(text)) == {"a", "b"}, text
        elif i % 3 == 1:
            assert out.outputs[0].finish_reason == "stop" and text.endswith("!"), text
