"""The request queue: enqueue / wait_for_completion, and imap's bounded streaming."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from test_generate import GREEDY, as_inputs, make_llm, random_prompts, token_ids
from test_streaming import forbid_idle_spin
from tokenmill import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=64)


def test_enqueue_then_wait_returns_outputs_in_enqueue_order(llm):
    prompts = random_prompts(llm.llm_engine.config.vocab_size, [4, 30, 9, 17], seed=3)
    expected = token_ids(llm.generate(as_inputs(prompts), GREEDY, use_tqdm=False))
    first = llm.enqueue(as_inputs(prompts[:2]), GREEDY)
    second = llm.enqueue(as_inputs(prompts[2:]), [GREEDY.clone(), GREEDY.clone()])
    assert llm.llm_engine.stats.num_steps >= 0 and llm.llm_engine.get_num_unfinished_requests() == 4
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == first + second
    assert token_ids(outputs) == expected
    assert llm.wait_for_completion(use_tqdm=False) == []


def test_an_interrupted_wait_keeps_what_finished_and_the_next_wait_goes_on(llm, monkeypatch):
    """Ctrl-C (or an error) during wait_for_completion loses nothing: the finished outputs are kept
    and the unfinished requests stay queued, so calling it again returns every output, in enqueue
    order, as an uninterrupted run gives them."""
    prompts = random_prompts(llm.llm_engine.config.vocab_size, [4, 30, 9, 17], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 12, 3, 12)]
    expected = token_ids(llm.generate(as_inputs(prompts), params, use_tqdm=False))
    ids = llm.enqueue(as_inputs(prompts), params)
    real_step, steps = llm.llm_engine.step, []

    def interrupted(*args, **kwargs):
        steps.append(1)
        if len(steps) == 6:  # after the 2- and 3-token requests finished, before the 12-token ones
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(llm.llm_engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.wait_for_completion(use_tqdm=False)
    monkeypatch.setattr(llm.llm_engine, "step", real_step)
    assert sorted(llm._queued_done) == [ids[0], ids[2]] and llm.llm_engine.get_num_unfinished_requests() == 2
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    assert token_ids(outputs) == expected
    assert llm.wait_for_completion(use_tqdm=False) == [] and not llm.llm_engine.has_unfinished_requests()


def test_enqueue_rejects_the_whole_call_on_a_bad_prompt(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.enqueue([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": []}], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()


def test_enqueue_chat(llm):
    conversation = [{"role": "user", "content": "hello there"}]
    ids = llm.enqueue_chat([conversation, conversation], GREEDY)
    outputs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outputs] == ids
    assert token_ids(outputs)[0] == token_ids(outputs)[1] == token_ids(llm.chat(conversation, GREEDY, use_tqdm=False))[0]


def test_enqueue_chat_takes_vllms_positional_order(llm):
    """vLLM's order: messages, sampling_params, use_tqdm, lora_request, priority, chat_template, ..."""
    conversation = [{"role": "user", "content": "hello there"}]
    template = "{% for m in messages %}{{ m['content'] }} and more{% endfor %}"
    ids = llm.enqueue_chat([conversation], GREEDY, False, None, [3], template)
    templated = llm.generate(["hello there and more"], GREEDY, use_tqdm=False)
    assert token_ids(llm.wait_for_completion(use_tqdm=False)) == token_ids(templated)
    assert len(ids) == 1
    with pytest.raises(ValueError, match="priority must be an integer or a list of 1 integers"):
        llm.enqueue_chat([conversation], GREEDY, priority=[1, 2])


@pytest.mark.slow  # 10,000 requests under tracemalloc
def test_imap_streams_10000_prompts_with_flat_memory(llm):
    vocab = llm.llm_engine.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    limit = 128

    def prompts():
        for i in range(10_000):
            yield {"prompt_token_ids": [3 + i % (vocab - 3), 3 + (7 * i) % (vocab - 3), 5]}

    seen = bytearray(30_000)  # allocated before tracing starts, so the bookkeeping itself stays flat
    in_flight_max = 0
    gc.collect()
    tracemalloc.start()
    try:
        for count, output in enumerate(llm.imap(prompts(), params, max_in_flight=limit), start=1):
            assert output.finished and len(output.outputs[0].token_ids) == 1
            slot = int(output.request_id) % len(seen)
            assert not seen[slot], f"request {output.request_id} came back twice"
            seen[slot] = 1
            in_flight_max = max(in_flight_max, llm.llm_engine.get_num_unfinished_requests())
            if count == 1_000:
                gc.collect()
                early = tracemalloc.get_traced_memory()[0]
        gc.collect()
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert sum(seen) == 10_000
    assert in_flight_max <= limit
    # Holding 9,000 more outputs (or prompts) would cost megabytes; streaming keeps it flat.
    assert late - early < 512 * 1024, (early, late)


def test_imap_takes_one_prompt_as_generate_does(llm):
    """A single text, prompt dict or token-id list is one prompt, not an iterable of prompts (characters, keys)."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for prompt in ("hello", {"prompt": "hello"}, [5, 6, 7]):
        outputs = list(llm.imap(prompt, params))
        assert token_ids(outputs) == token_ids(llm.generate(prompt, params, use_tqdm=False))


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_imap_refuses_a_bad_max_in_flight(llm, limit):
    with pytest.raises(ValueError, match=rf"max_in_flight={limit!r} is invalid: must be None or an integer >= 1"):
        llm.imap([[5, 6, 7]], GREEDY, max_in_flight=limit)


def test_imap_checks_its_sampling_params_at_the_call(llm):
    """As stream() and generate() do: a bad sampling_params raises from the imap() call itself, not
    at the first next() far from it, and nothing is left queued; an imap dropped unread aborts what
    it queued."""
    changed = SamplingParams(max_tokens=4)
    changed.n = 0  # set after construction, as vLLM's examples set fields of get_default_sampling_params()
    too_many = llm.llm_engine.config.max_logprobs + 1
    bad_calls = [
        ("not params", r"sampling_params"),
        ([GREEDY], r"sampling_params"),
        (changed, r"SamplingParams.n=0 is invalid"),
        (SamplingParams(logprobs=too_many), rf"logprobs={too_many}"),  # the engine's check, against the model
    ]
    for params, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            llm.imap(({"prompt_token_ids": [5, 6, i + 3]} for i in range(100)), params, max_in_flight=4)
        assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes
    llm.imap([[5, 6, 7], [8, 9]], GREEDY)  # dropped unread
    gc.collect()
    assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes


def test_imap_names_a_bad_prompt_by_its_index_in_the_input(llm):
    stream = llm.imap([[5, 6, 7], [8, 9], [], [4]], GREEDY, max_in_flight=1)
    with pytest.raises(ValueError, match=r"prompts\[2\] is empty"):
        list(stream)
    assert not llm.llm_engine.has_unfinished_requests()


def test_imap_stopped_early_leaves_nothing_running(llm):
    stream = llm.imap(({"prompt_token_ids": [5, 6, i % 50 + 3]} for i in range(1000)), GREEDY, max_in_flight=32)
    next(stream)
    stream.close()
    assert not llm.llm_engine.has_unfinished_requests()


def test_imap_yields_outputs_that_a_generate_between_two_items_finished(tiny_llama_dir, monkeypatch):
    """generate() called while an imap is open steps the imap's requests too: one that finishes
    there must still come out of the imap (not be dropped, leaving the imap waiting forever)."""
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16)  # the long prompt's prefill takes 3 steps
    forbid_idle_spin(llm, monkeypatch)
    prompts = as_inputs(random_prompts(llm.llm_engine.config.vocab_size, [4, 40], seed=5))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    stream = llm.imap(prompts, params)
    first = next(stream)  # the short prompt's: the long one is still running
    assert first.prompt_token_ids == prompts[0]["prompt_token_ids"] and llm.llm_engine.has_unfinished_requests()
    llm.generate(prompts[:1], params, use_tqdm=False)  # runs the long prompt's request to its end
    rest = list(stream)
    assert [o.prompt_token_ids for o in rest] == [prompts[1]["prompt_token_ids"]] and rest[0].finished
    assert token_ids([first, *rest]) == token_ids(llm.generate(prompts, params, use_tqdm=False))
    assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes


def test_enqueued_requests_finishing_during_another_call_are_kept(tiny_llama_dir):
    # generate() steps the engine for everyone: an enqueued request that finishes meanwhile must
    # still come back from wait_for_completion, not be dropped with the other call's strays.
    llm = make_llm(tiny_llama_dir)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.enqueue(as_inputs([[5, 6, 7], [8, 9]]), short)
    llm.generate(as_inputs([[10, 11, 12, 13]]), long, use_tqdm=False)
    done = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in done] == ids
    expected = llm.generate(as_inputs([[5, 6, 7], [8, 9]]), short, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in done] == [o.outputs[0].token_ids for o in expected]


@pytest.mark.parametrize("prompts", [None, 5, b"bytes"])
def test_imap_refuses_what_is_no_prompt_when_called(llm, prompts):
    """As generate does, and at the call: iterating None failed at the first next() with a bare TypeError."""
    with pytest.raises(ValueError, match=r"prompts must be a prompt \(text, token ids or a prompt dict\) or a list of them, got"):
        llm.imap(prompts, GREEDY)
