"""Output kinds and token streaming, and prompt truncation, on a tiny random Llama: deltas must
join into exactly the text and tokens of a plain generate call."""

from __future__ import annotations

import pytest

from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=8)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.llm_engine.config.vocab_size, [5, 23, 11], seed=3)


def forbid_idle_spin(llm, monkeypatch) -> None:
    """Make a loop that steps an engine with nothing left to run fail instead of spinning forever
    (an iterator waiting for an output some other call already took)."""
    engine = llm.llm_engine
    step = engine.step
    idle = 0

    def guarded_step(*args, **kwargs):
        nonlocal idle
        idle = 0 if engine.has_unfinished_requests() else idle + 1
        assert idle < 100, "stepping an engine with nothing to run: waiting for an output that will never come"
        return step(*args, **kwargs)

    monkeypatch.setattr(engine, "step", guarded_step)


def join_deltas(joined: dict[str, tuple[list[int], str]], out) -> None:
    ids, text = joined.get(out.request_id, ([], ""))
    joined[out.request_id] = (ids + out.outputs[0].token_ids, text + out.outputs[0].text)


def test_stream_deltas_join_into_the_generate_output(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    expected = {o.request_id: o for o in llm.generate(as_inputs(prompts), params, use_tqdm=False)}
    joined: dict[int, tuple[list[int], str, int]] = {}
    finished = 0
    for out in llm.stream(as_inputs(prompts), params):
        ids, text, num_lp = joined.get(int(out.request_id), ([], "", 0))
        c = out.outputs[0]
        assert len(c.token_ids) >= 1 and len(c.logprobs) == len(c.token_ids)
        joined[int(out.request_id)] = (ids + c.token_ids, text + c.text, num_lp + len(c.logprobs))
        finished += out.finished
    assert finished == len(prompts)
    by_index = sorted(joined.items())
    for (_, (ids, text, num_lp)), want in zip(by_index, sorted(expected.values(), key=lambda o: int(o.request_id))):
        assert ids == want.outputs[0].token_ids and text == want.outputs[0].text and num_lp == len(ids)


def test_streams_read_in_turn_each_get_all_their_tokens(llm, prompts, monkeypatch):
    """Two streams read alternately: each one's step advances the other's requests too, whose
    deltas (and final outputs) must reach the other stream, not be dropped."""
    forbid_idle_spin(llm, monkeypatch)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0] for o in llm.generate(as_inputs(prompts[:2]), [short, long], use_tqdm=False)]
    streams = [llm.stream(as_inputs([prompts[0]]), short), llm.stream(as_inputs([prompts[1]]), long)]
    joined: list[dict[str, tuple[list[int], str]]] = [{}, {}]
    finished = [0, 0]
    while any(s is not None for s in streams):
        for i, stream in enumerate(streams):
            out = next(stream, None) if stream is not None else None
            if out is None:
                streams[i] = None
                continue
            join_deltas(joined[i], out)
            finished[i] += out.finished
    assert finished == [1, 1]
    assert [list(j.values()) for j in joined] == [[(w.token_ids, w.text)] for w in want]
    assert not llm.llm_engine.has_unfinished_requests()


def test_generate_between_two_stream_items(llm, prompts, monkeypatch):
    """generate() called while a stream is open steps the stream's requests to their end: the
    stream still yields every token and its final output afterwards."""
    forbid_idle_spin(llm, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = {o.request_id: o.outputs[0] for o in llm.generate(as_inputs(prompts), params, use_tqdm=False)}
    stream = llm.stream(as_inputs(prompts), params)
    joined: dict[str, tuple[list[int], str]] = {}
    join_deltas(joined, next(stream))
    inner = llm.generate(as_inputs(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in inner] == [w.token_ids for w in want.values()]
    finals = 0
    for out in stream:
        join_deltas(joined, out)
        finals += out.finished
    assert finals == len(prompts)
    assert sorted(joined.values()) == sorted((w.token_ids, w.text) for w in want.values())


def test_a_stream_whose_requests_sleep_aborted_ends(llm, prompts, monkeypatch):
    forbid_idle_spin(llm, monkeypatch)
    stream = llm.stream(as_inputs(prompts), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert not next(stream).finished
    llm.sleep()  # mode="abort": the stream's requests are gone
    llm.wake_up()
    assert not any(out.finished for out in stream)  # the deltas made before the abort, then the end
    assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes


def test_stream_checks_its_arguments_at_the_call(llm, prompts):
    """A bad argument raises from the stream() call itself, as from generate(), not at the first next()
    far from it; nothing is left queued. A stream dropped unread aborts its requests."""
    bad_calls = [
        (SamplingParams(temperature=1.0, n=1, best_of=3), r"best_of=3 .*DELTA"),
        ([SamplingParams(), SamplingParams()], r"sampling_params"),  # two params for three prompts
        ("not params", r"sampling_params"),
    ]
    for params, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            llm.stream(as_inputs(prompts), params)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.stream([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": [llm.llm_engine.config.vocab_size]}])
    assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes
    llm.stream(as_inputs(prompts), SamplingParams(max_tokens=8, ignore_eos=True))  # dropped unread
    assert not llm.llm_engine.has_unfinished_requests() and not llm._mailboxes


@pytest.mark.parametrize("flat", [False, True])
def test_request_output_add_folds_deltas_into_the_final_output(llm, prompts, flat):
    """vLLM's RequestOutput.add: DELTA outputs aggregated equal the FINAL_ONLY output (n=2, with
    logprobs, plain and flat); CUMULATIVE outputs added without aggregating end as the last one."""
    params = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=9, ignore_eos=True, logprobs=2, flat_logprobs=flat)
    want = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0]
    engine = llm.llm_engine
    folded: dict = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(f"add-{kind.name}", {"prompt_token_ids": prompts[1]}, params.clone(output_kind=kind))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in folded:
                folded[out.request_id].add(out, aggregate=out.request_id == "add-DELTA")
            else:
                folded[out.request_id] = out
    for got in folded.values():
        assert got.finished
        assert sorted((c.index, c.token_ids, c.text, c.finish_reason) for c in got.outputs) == \
            sorted((c.index, c.token_ids, c.text, c.finish_reason) for c in want.outputs)
        for c in got.outputs:
            expected = next(w for w in want.outputs if w.index == c.index)
            assert len(c.logprobs) == len(expected.logprobs) == len(c.token_ids)
            for mine, theirs in zip(c.logprobs, expected.logprobs):  # two requests in a step, not one: last bits move
                assert {t: lp.rank for t, lp in mine.items()} == {t: lp.rank for t, lp in theirs.items()}
                assert [lp.logprob for lp in mine.values()] == pytest.approx([lp.logprob for lp in theirs.values()], abs=1e-5)
            assert c.cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-4)


def test_stream_holds_back_text_a_stop_string_may_cut(llm, prompts):
    free = llm.generate(as_inputs([prompts[1]]), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    full = free[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    want = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].outputs[0].text
    streamed = "".join(out.outputs[0].text for out in llm.stream(as_inputs([prompts[1]]), params))
    assert streamed == want and stop not in streamed


def test_engine_output_kinds(llm, prompts):
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(f"kind-{kind.name}", {"prompt_token_ids": prompts[0]},
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=kind))
    seen: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.outputs[0].token_ids)
    cumulative, delta, final = seen["kind-CUMULATIVE"], seen["kind-DELTA"], seen["kind-FINAL_ONLY"]
    assert len(final) == 1 and len(final[0]) == 5
    assert [len(x) for x in cumulative] == [1, 2, 3, 4, 5] and cumulative[-1] == final[0]
    assert [len(x) for x in delta] == [1, 1, 1, 1, 1] and sum(delta, []) == final[0]


@pytest.mark.parametrize("flat", [False, True])
def test_delta_outputs_carry_the_prompt_logprobs_once(llm, prompts, flat):
    """vLLM's DELTA rule: the first output holds every prompt position's logprobs, later ones none
    ([]); cumulative outputs repeat them whole. Checked against a final-only run's."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2, flat_logprobs=flat)
    want = llm.generate(as_inputs([prompts[1]]), params, use_tqdm=False)[0].prompt_logprobs
    assert len(want) == len(prompts[1])
    engine = llm.llm_engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine.add_request(f"plp-{kind.name}", {"prompt_token_ids": prompts[1]}, params.clone(output_kind=kind))
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.prompt_logprobs)
    delta, cumulative = seen["plp-DELTA"], seen["plp-CUMULATIVE"]
    assert len(delta) == len(cumulative) == 4
    assert list(delta[0]) == list(want) and all(len(later) == 0 for later in delta[1:])
    assert all(list(whole) == list(want) for whole in cumulative)


def test_generate_returns_whole_outputs_whatever_the_kind(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = llm.generate(as_inputs([prompts[0]]), params, use_tqdm=False)[0].outputs[0].token_ids
    delta = llm.generate(as_inputs([prompts[0]]), params.clone(output_kind=RequestOutputKind.DELTA), use_tqdm=False)
    assert delta[0].outputs[0].token_ids == plain and len(plain) == 6


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, prompts):
    long = prompts[1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cut = llm.generate(as_inputs([long]), params.clone(truncate_prompt_tokens=7), use_tqdm=False)[0]
    tail = llm.generate(as_inputs([long[-7:]]), params, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-7:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    whole = llm.generate(as_inputs([long]), params.clone(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == long


@pytest.mark.parametrize(("field", "value"), [("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2), ("output_kind", 7)])
def test_bad_kind_or_truncation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_best_of_is_refused_for_delta_outputs(llm, prompts):
    """best_of > n returns the n samples of highest cumulative logprob, known only once all have
    finished; a delta stream would have given index 0 the new tokens of whichever sample led at each
    step (found by tests/test_engine_differential.py's fuzz). As vLLM V0: best_of must equal n there."""
    params = SamplingParams(temperature=1.0, seed=3, n=1, best_of=3, max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match=r"best_of=3 .*DELTA"):
        list(llm.stream(as_inputs(prompts[:1]), params))
    with pytest.raises(ValueError, match=r"best_of=3 .*DELTA"):
        llm.llm_engine.add_request("best-of-delta", {"prompt_token_ids": prompts[0]},
                                   params.clone(output_kind=RequestOutputKind.DELTA))
    assert not llm.llm_engine.has_unfinished_requests()
    # best_of == n streams (the samples keep their indexes), and generate is unaffected.
    llm.generate(as_inputs(prompts[:1]), params, use_tqdm=False)
    assert sum(1 for _ in llm.stream(as_inputs(prompts[:1]), params.clone(n=2, best_of=2))) > 1
