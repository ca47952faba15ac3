"""SamplingParams.repetition_detection: the detector against a brute-force reference, the order of
the stop rules, and the engine finishing looping completions early (finish_reason "repetition",
stop_reason "repetition_detected") with exactly the tokens up to the one that closed the loop."""

from __future__ import annotations

import random

import pytest

from test_generate import as_inputs, make_llm, random_prompts
from tokenmill import RepetitionDetectionParams, SamplingParams
from tokenmill.engine.request import Request, Sequence, max_output_tokens
from tokenmill.engine.scheduler import check_stop
from tokenmill.repetition_detection import ends_in_repetition

EOS = 2


def reference_ends_in_repetition(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    """Brute force: build every candidate pattern from the tail and repeat it min_count times."""
    if params.max_pattern_size == 0:
        return False
    for length in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        window = length * params.min_count
        if len(tokens) >= window and tokens[len(tokens) - window:] == tokens[len(tokens) - length:] * params.min_count:
            return True
    return False


def reference_stop(tokens: list[int], params: RepetitionDetectionParams, min_tokens: int = 0) -> int | None:
    """How many tokens a completion keeps: the first prefix (of at least min_tokens) ending in a
    repetition, checking every window; None if no prefix of ``tokens`` does."""
    for end in range(max(1, min_tokens), len(tokens) + 1):
        if reference_ends_in_repetition(tokens[:end], params):
            return end
    return None


def test_detector_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    hits = 0
    for _ in range(3000):
        alphabet = rng.randint(1, 4)  # few symbols: repetitions are common, so both answers get tested
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 30))]
        largest = rng.randint(0, 6)
        params = RepetitionDetectionParams(largest, rng.randint(0, largest), rng.randint(2, 4) if largest else 0)
        expected = reference_ends_in_repetition(tokens, params)
        assert ends_in_repetition(tokens, params) == expected, (tokens, params)
        hits += expected
    assert 300 < hits < 2700


def test_detector_on_planted_patterns():
    params = RepetitionDetectionParams(max_pattern_size=5, min_pattern_size=3, min_count=3)
    assert ends_in_repetition([9, 1, 2, 3, 1, 2, 3, 1, 2, 3], params)
    assert not ends_in_repetition([9, 1, 2, 3, 1, 2, 3, 1, 2, 4], params)  # last copy broken
    assert not ends_in_repetition([1, 2, 3, 1, 2, 3], params)  # two copies only
    assert not ends_in_repetition([7, 7, 7, 8, 8, 8], RepetitionDetectionParams(1, 0, 4))
    assert ends_in_repetition([5] * 9, params) and not ends_in_repetition([5] * 8, params)  # a run has every period
    assert not ends_in_repetition([5] * 8, RepetitionDetectionParams(max_pattern_size=0))  # off


@pytest.mark.parametrize(("kwargs", "field", "allowed"), [
    ({"max_pattern_size": -1}, "max_pattern_size", ">= 0"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size", "<= max_pattern_size (2)"),
    ({"max_pattern_size": 2, "min_count": 1}, "min_count", ">= 2 when max_pattern_size > 0"),
    ({"max_pattern_size": 2}, "min_count", ">= 2"),
    ({"max_pattern_size": 2.0, "min_count": 2}, "max_pattern_size", "an integer"),
    ({"max_pattern_size": True, "min_count": 2}, "max_pattern_size", "an integer"),
    ({"min_pattern_size": -2}, "min_pattern_size", ">= 0"),
])
def test_invalid_params_name_field_value_and_rule(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        RepetitionDetectionParams(**kwargs)
    assert f"RepetitionDetectionParams.{field}={kwargs.get(field, 0)!r} is invalid" in str(err.value)
    assert allowed in str(err.value)
    with pytest.raises(ValueError, match=f"RepetitionDetectionParams.{field}="):
        SamplingParams(repetition_detection=kwargs)  # the dict form, as a batch row carries it


def test_numpy_integers_are_taken_as_vllms_dataclass_takes_them():
    """vLLM's RepetitionDetectionParams is a plain dataclass (no type checks): numpy's integers, as a
    DataFrame row carries them, pass; kept as Python ints for the scheduler and the JSON writers."""
    import numpy as np

    params = RepetitionDetectionParams(np.int64(3), np.int32(1), np.int64(2))
    assert params == RepetitionDetectionParams(3, 1, 2)
    assert all(type(getattr(params, f)) is int for f in ("max_pattern_size", "min_pattern_size", "min_count"))
    dict_form = SamplingParams(repetition_detection={"max_pattern_size": np.int64(3), "min_count": np.int64(2)})
    assert dict_form.repetition_detection == RepetitionDetectionParams(3, 0, 2)
    with pytest.raises(ValueError, match=r"RepetitionDetectionParams.min_count=1 is invalid: must be >= 2"):
        RepetitionDetectionParams(max_pattern_size=np.int64(2), min_count=np.int64(1))


def test_sampling_params_takes_the_object_or_a_dict():
    p = SamplingParams(repetition_detection={"max_pattern_size": 3, "min_count": 2, "min_pattern_size": None})
    assert p.repetition_detection == RepetitionDetectionParams(3, 0, 2)  # None: not set (Arrow structs)
    assert SamplingParams().repetition_detection is None
    assert RepetitionDetectionParams() == RepetitionDetectionParams(0, 0, 0)  # vLLM's defaults: off
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['count'\]"):
        SamplingParams(repetition_detection={"max_pattern_size": 3, "count": 2})
    with pytest.raises(ValueError, match="SamplingParams.repetition_detection=3 is invalid"):
        SamplingParams(repetition_detection=3)


# --- check_stop: where repetition stands among the stop rules ----------------------------------


class FakeDetokenizer:
    """Reports ``stop`` as the stop string completed by the next token."""

    def __init__(self, stop: str | None):
        self.stop = stop

    def add_token(self, token: int, check_stop: bool) -> str | None:
        return self.stop if check_stop else None


@pytest.mark.parametrize(("params", "stop_string", "expected"), [
    ({}, None, ("repetition", "repetition_detected")),
    ({"max_tokens": 4}, None, ("length", None)),  # vLLM tests length first
    ({"stop_token_ids": [5]}, None, ("stop", 5)),
    ({"ignore_eos": True}, "ab", ("stop", "ab")),  # a stop string in the same token wins (vLLM's front end)
    ({"min_tokens": 5}, None, (None, None)),  # not before min_tokens
    ({"min_tokens": 4}, None, ("repetition", "repetition_detected")),
])
def test_check_stop_order(params, stop_string, expected):
    sp = SamplingParams(repetition_detection=RepetitionDetectionParams(2, 1, 2), **params)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
    request = Request("r", None, [10, 11], sp)
    request.max_output_tokens = max_output_tokens(sp.max_tokens, 2, 64)
    seq = Sequence(0, 0, request, request.prompt_token_ids, output_token_ids=[4, 5, 4, 5])
    seq.detokenizer = FakeDetokenizer(stop_string)  # type: ignore[assignment]
    check_stop(seq, 5, frozenset({EOS}))
    assert (seq.finish_reason, seq.stop_reason) == expected


# --- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_num_seqs=8, disable_log_stats=False)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.llm_engine.config.vocab_size, [5, 17, 9, 23], seed=5)


NOISE, CYCLE = [40, 41, 42, 43, 44], [50, 51, 52]
LOOP = RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=2, min_count=3)


def forced_loop(output_ids, logits):
    """Five distinct tokens, then 50 51 52 forever: the loop closes at token 5 + 3 * 3 = 14."""
    position = len(output_ids)
    want = NOISE[position] if position < len(NOISE) else CYCLE[(position - len(NOISE)) % len(CYCLE)]
    logits.fill_(float("-inf"))
    logits[want] = 0.0
    return logits


def forced(max_tokens=40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logits_processors=[forced_loop], **kwargs)


def test_a_forced_loop_finishes_where_it_closes(llm, prompts):
    free = llm.generate(as_inputs(prompts[:1]), forced(), use_tqdm=False)[0].outputs[0]
    assert reference_stop(free.token_ids, LOOP) == 14
    out = llm.generate(as_inputs(prompts[:1]), forced(repetition_detection=LOOP), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:14] == NOISE + CYCLE * 3
    assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    # min_tokens holds the check back: the tail is periodic from then on, so it ends at min_tokens.
    late = llm.generate(as_inputs(prompts[:1]), forced(repetition_detection=LOOP, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert late.token_ids == free.token_ids[:20] and late.finish_reason == "repetition"
    # The length rule comes first when both fire on the same token (vLLM's order).
    capped = llm.generate(as_inputs(prompts[:1]), forced(14, repetition_detection=LOOP), use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 14 and (capped.finish_reason, capped.stop_reason) == ("length", None)
    assert out.text == capped.text and out.text.endswith("PQR" * 3)  # the same tokens, the same text: nothing cut
    # (Stop ids and stop strings before repetition: test_check_stop_order; min_tokens masks stop ids
    # in the sampler, so an engine run cannot make both fire on one token.)


def test_model_loops_end_where_the_reference_says(llm, prompts):
    """Greedy over three allowed tokens: the random model falls into loops of its own. Each run
    with detection keeps exactly the prefix of the free run the brute-force reference picks."""
    params = SamplingParams(temperature=0.0, max_tokens=36, ignore_eos=True, allowed_token_ids=[60, 61, 62])
    free = [o.outputs[0].token_ids for o in llm.generate(as_inputs(prompts), params, use_tqdm=False)]
    detect = RepetitionDetectionParams(max_pattern_size=6, min_pattern_size=1, min_count=3)
    outs = llm.generate(as_inputs(prompts), params.clone(repetition_detection=detect), use_tqdm=False)
    stops = [reference_stop(tokens, detect) for tokens in free]
    assert any(stop is not None for stop in stops)
    for tokens, stop, out in zip(free, stops, outs):
        c = out.outputs[0]
        if stop is None:
            assert c.token_ids == tokens and c.finish_reason == "length"
        else:
            assert c.token_ids == tokens[:stop] and (c.finish_reason, c.stop_reason) == ("repetition", "repetition_detected")


def test_each_of_n_samples_stops_on_its_own(llm, prompts):
    # Seeded draws depend on (seed, position) only, so the run with detection is a prefix of the free one.
    params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=24, ignore_eos=True, allowed_token_ids=[70, 71])
    detect = RepetitionDetectionParams(max_pattern_size=2, min_count=3)
    free = llm.generate(as_inputs(prompts[1:2]), params, use_tqdm=False)[0].outputs
    got = llm.generate(as_inputs(prompts[1:2]), params.clone(repetition_detection=detect), use_tqdm=False)[0].outputs
    stops = [reference_stop(c.token_ids, detect) for c in free]
    assert len(set(stops)) > 1  # samples stop at different points
    for want, stop, c in zip(free, stops, got):
        assert c.token_ids == want.token_ids[:stop]
        assert c.finish_reason == ("repetition" if stop is not None else "length")


def test_delta_stream_ends_with_the_repetition(llm, prompts):
    params = forced(repetition_detection=LOOP, logprobs=1)
    whole = llm.generate(as_inputs(prompts[:2]), params, use_tqdm=False)
    parts: dict[str, list] = {}
    for out in llm.stream(as_inputs(prompts[:2]), params):
        parts.setdefault(out.request_id, []).append(out.outputs[0])
    assert len(parts) == 2
    for deltas, want in zip(sorted(parts.values(), key=len), whole):
        assert sum((d.token_ids for d in deltas), []) == want.outputs[0].token_ids == NOISE + CYCLE * 3
        assert "".join(d.text for d in deltas) == want.outputs[0].text
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["repetition"]
        assert deltas[-1].stop_reason == "repetition_detected"


def successes(llm) -> dict[str, float]:
    return {m.labels["finished_reason"]: m.value for m in llm.get_metrics() if m.name == "vllm:request_success"}


def test_engine_step_outputs_and_metrics(llm, prompts):
    pytest.importorskip("prometheus_client")
    before = successes(llm)
    engine = llm.llm_engine
    engine.add_request("loop", {"prompt_token_ids": prompts[0]}, forced(repetition_detection=LOOP))
    seen = []
    while engine.has_unfinished_requests():
        seen += [out.outputs[0] for out in engine.step()]
    assert [len(c.token_ids) for c in seen] == list(range(1, 15))  # CUMULATIVE: one output per token
    assert [c.finish_reason for c in seen] == [None] * 13 + ["repetition"]
    after = successes(llm)
    assert after["repetition"] == before["repetition"] + 1 and after["length"] == before["length"]
