"""A step that raises midway (an engine bug, Ctrl-C) fails the call that was stepping, and only that
call: the engine is left as a finished call leaves it, and requests of other callers (enqueued ones)
run on to the outputs a fresh engine gives them. A request's own logits processor that raises ends
that request alone, with finish_reason "error"."""

from __future__ import annotations

import itertools
import re

import pytest

from test_generate import as_inputs, make_llm
from tokenmill import BeamSearchParams, SamplingParams

PROMPTS = as_inputs([[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], list(range(20, 40))])
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, repetition_penalty=1.2, logit_bias={30: 2.0}),
    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    # Sample 1 starts from a copy of sample 0's partial prompt block (a copy planned in the step that fails).
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True, logprobs=0),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine(tiny_llama_dir, async_scheduling: bool):
    return make_llm(tiny_llama_dir, async_scheduling=async_scheduling, block_size=16, max_model_len=64)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list:
    return completions(engine(tiny_llama_dir, False).generate(PROMPTS, PARAMS, use_tqdm=False))


def completions(outputs) -> list:
    """Each completion's tokens and summed logprob (a token computed from wrong keys and values moves it)."""
    return [(c.token_ids, pytest.approx(c.cumulative_logprob or 0.0, abs=1e-4)) for o in outputs for c in o.outputs]


def fail_on_call(monkeypatch, owner, name: str, call: int, error: BaseException) -> None:
    """``owner.name`` raises ``error`` on its ``call``-th call (counted from now)."""
    original, calls = getattr(owner, name), itertools.count(1)

    def failing(*args, **kwargs):
        if next(calls) == call:
            raise error
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def assert_idle(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert engine.kv.num_free_blocks == engine.kv.num_usable_blocks and engine._in_flight is None


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["launch", "read_back", "output"])
def test_a_failed_call_leaves_enqueued_requests_to_finish_as_before(tiny_llama_dir, expected, monkeypatch,
                                                                    async_scheduling, where):
    """Before, such a step left the enqueued requests with tokens counted in flight that never came
    (wait_for_completion: "the scheduler could not place any request"), a planned block copy never
    made (wrong tokens), or a finished request's output never built (lost, or waited on forever)."""
    llm = engine(tiny_llama_dir, async_scheduling)
    ids = llm.enqueue(PROMPTS, PARAMS)
    e = llm.llm_engine
    owner, name = {"launch": (e.executor, "execute_model"), "read_back": (e.scheduler, "update_from_output"),
                   "output": (e.output_processor, "request_output")}[where]
    fail_on_call(monkeypatch, owner, name, 2, RuntimeError("a bug"))  # the step where n=2's sample 1 is admitted
    with pytest.raises(RuntimeError, match="a bug"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    fail_on_call(monkeypatch, e, "step", 200, AssertionError("no progress in 200 steps"))  # a wedged engine fails, not hangs
    done = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in done] == ids
    assert completions(done) == expected
    assert_idle(llm)


def test_ctrl_c_mid_generate_leaves_the_engine_as_a_finished_call_does(tiny_llama_dir, expected, monkeypatch):
    llm = engine(tiny_llama_dir, True)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    slots = {name: len(getattr(llm.llm_engine.executor.runner, name).table) for name in ("penalties", "logit_bias")}
    fail_on_call(monkeypatch, llm.llm_engine.executor, "execute_model", 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)  # before: the interrupted step was left in flight, for the next call to read back
    assert completions(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected
    assert {name: len(getattr(llm.llm_engine.executor.runner, name).table) for name in slots} == slots


def test_a_beam_group_interrupted_before_it_moves_on_reports_again(tiny_llama_dir, monkeypatch):
    """Every beam of a group had reported, held until the group moves on; the step failed before it
    did. Before, the held beams were never scheduled again: "the scheduler could not place any request"."""
    from tokenmill.engine.beam_search import BeamSearch

    beams = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    requests = [("beams", PROMPTS[0], beams), ("greedy", PROMPTS[1], GREEDY)]

    def run(e) -> dict:
        for request_id, prompt, params in requests:
            e.add_request(request_id, prompt, params)
        outputs = {}
        for _ in range(200):  # a wedged engine fails the test, not hangs it
            if not e.has_unfinished_requests():
                break
            try:
                outputs.update((o.request_id, completions([o])) for o in e.step(finished_only=True))
            except KeyboardInterrupt:
                pass  # a driver that goes on (the batch job's loop, say)
        return outputs

    e = engine(tiny_llama_dir, False).llm_engine
    reference = run(e)
    fail_on_call(monkeypatch, BeamSearch, "advance", 2, KeyboardInterrupt())
    assert run(e) == reference


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_whose_logits_processor_raises_ends_alone(tiny_llama_dir, expected, async_scheduling):
    """Before, the processor's error failed the whole call (the other requests' results lost) and,
    driving LLMEngine.step, every later step too, without naming the request."""
    calls = itertools.count()

    def breaks_on_third_call(output_ids, logits):
        if next(calls) == 2:
            raise ZeroDivisionError("bad row")
        return logits

    llm = engine(tiny_llama_dir, async_scheduling)
    broken = GREEDY.clone(logits_processors=[breaks_on_third_call])
    outputs = llm.generate([*PROMPTS, PROMPTS[0]], [*PARAMS, broken], use_tqdm=False)
    assert completions(outputs[:-1]) == expected
    failed = outputs[-1]
    assert failed.finished and failed.outputs[0].finish_reason == "error" and len(failed.outputs[0].token_ids) == 2
    assert re.fullmatch(r"SamplingParams.logits_processors\[0\] \(.*breaks_on_third_call\) raised ZeroDivisionError: "
                        "bad row", failed.error)
    assert_idle(llm)
