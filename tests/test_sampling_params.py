"""SamplingParams: vLLM's defaults, and errors that name the field and the allowed range."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tokenmill import RequestOutputKind, SamplingParams
from tokenmill.sampling_params import BeamSearchParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.min_tokens == 0
    assert p.logprob_token_ids is None and p.flat_logprobs is False and p.num_logprobs is None


def test_single_stop_string_becomes_a_list_and_top_k_minus_one_means_off():
    p = SamplingParams(stop="\n", top_k=-1)
    assert p.stop == ["\n"] and p.top_k == 0


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"temperature": -0.1}, "temperature", "in [0, 2]"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"n": 0}, "n", ">= 1"),
        ({"top_k": -5}, "top_k", ">= 1"),
        ({"min_p": 2.0}, "min_p", "[0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "<= max_tokens"),
        ({"logprobs": -2}, "logprobs", "-1 (the whole vocabulary)"),
        ({"temperature": "hot"}, "temperature", "a finite number"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "non-negative"),
        ({"logprob_token_ids": [1, -2]}, "logprob_token_ids", "integers >= 0"),
        ({"logprob_token_ids": [1.0]}, "logprob_token_ids", "integers >= 0"),
        ({"logprob_token_ids": 5}, "logprob_token_ids", "a list of token ids"),
        ({"logprob_token_ids": list(range(129))}, "logprob_token_ids", "at most 128 token ids (got 129)"),
        ({"logprobs": 2, "logprob_token_ids": [1, 2, 3]}, "logprob_token_ids", "as long as logprobs (2)"),
        ({"logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids", "as long as logprobs (1)"),
        ({"flat_logprobs": "yes"}, "flat_logprobs", "True or False"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias", "integer token ids"),  # was taken as token 1
        ({"logits_processors": print}, "logits_processors", "a list of callables"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "keys among ['json', 'regex'"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert f"SamplingParams.{field}=" in message and allowed in message


def test_num_logprobs_counts_listed_ids_as_vllm_does():
    assert SamplingParams(logprob_token_ids=(4, 2, 9)).num_logprobs == 3  # a tuple becomes a list
    assert SamplingParams(logprob_token_ids=(4, 2, 9)).logprob_token_ids == [4, 2, 9]
    assert SamplingParams(logprobs=3, logprob_token_ids=[4, 2, 9]).num_logprobs == 3
    assert SamplingParams(logprob_token_ids=list(range(128))).num_logprobs == 128
    assert SamplingParams(logprob_token_ids=[]).num_logprobs is None  # an empty list asks for nothing
    assert SamplingParams(logprobs=0, logprob_token_ids=[]).num_logprobs == 0
    assert SamplingParams(logprobs=4).num_logprobs == 4


# vLLM 0.26's public SamplingParams fields and their declared defaults (read from its
# sampling_params.py), and those tokenmill does not have yet.
VLLM_0_26_FIELDS = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 1.0,
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": None, "stop_token_ids": None, "ignore_eos": False,
    "max_tokens": 16, "min_tokens": 0, "logprobs": None, "prompt_logprobs": None, "logprob_token_ids": None,
    "flat_logprobs": False, "detokenize": True, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False, "output_kind": RequestOutputKind.CUMULATIVE, "skip_clone": False,
    "output_text_buffer_length": 0, "structured_outputs": None, "logit_bias": None, "allowed_token_ids": None,
    "extra_args": None, "routed_experts_prompt_start": 0, "bad_words": None, "skip_reading_prefix_cache": None,
    "thinking_token_budget": None, "repetition_detection": None,
}
NOT_YET = {"output_text_buffer_length"}  # vLLM's internal detokenizer setting, not one a user sets


def test_fields_and_declared_defaults_match_vllm():
    ours = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert not NOT_YET & set(ours), "implemented now: take it off NOT_YET"
    for name, default in VLLM_0_26_FIELDS.items():
        if name not in NOT_YET:
            assert name in ours and ours[name] == default, name


def test_greedy_normalises_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)
    assert p.temperature == 0.0 and p.top_p == 1.0 and p.top_k == 0


def test_from_optional_rejects_unknown_fields():
    assert SamplingParams.from_optional(max_tokens=5, seed=None).max_tokens == 5
    # As vLLM's from_optional: None is the default for the other fields, but max_tokens=None is no cap
    # (up to max_model_len), not the default 16.
    given = SamplingParams.from_optional(n=None, temperature=None, top_p=None, max_tokens=None)
    assert (given.n, given.temperature, given.top_p, given.max_tokens) == (1, 1.0, 1.0, None)
    assert SamplingParams.from_optional().max_tokens == 16
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_optional(max_token=5)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("n", True), ("seed", False),
    ("best_of", True), ("top_k", 2.0), ("min_tokens", True), ("truncate_prompt_tokens", True),
    ("ignore_eos", "no"), ("ignore_eos", 1), ("skip_special_tokens", "false"), ("detokenize", None),
    ("include_stop_str_in_output", 0), ("spaces_between_special_tokens", "yes"),
    ("temperature", float("inf")), ("top_p", float("nan")), ("min_p", float("-inf")),
    ("presence_penalty", float("nan")), ("repetition_penalty", float("inf")), ("temperature", True),
    ("logit_bias", {"5": float("nan")}), ("logit_bias", {"5": float("inf")}), ("stop_token_ids", [True]),
])
def test_types_are_strict_and_numbers_finite(field, value):
    """As vLLM's request models check them: bool is not an integer, a string is not a bool, inf/nan are refused."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_vllm_026_fields_defaults():
    p = SamplingParams()
    assert (p.repetition_detection, p.skip_reading_prefix_cache, p.skip_clone) == (None, None, False)
    assert (p.routed_experts_prompt_start, p.thinking_token_budget) == (0, None)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM: -1 means unlimited
    assert SamplingParams(skip_clone=True, skip_reading_prefix_cache=True, routed_experts_prompt_start=0).skip_clone


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("skip_clone", 1, "True or False"),
    ("skip_reading_prefix_cache", "yes", "None, True or False"),
    ("routed_experts_prompt_start", 4, "0: tokenmill returns no routed experts"),
    ("routed_experts_prompt_start", True, "0: tokenmill returns no routed experts"),
    ("thinking_token_budget", 100, "tokenmill has no reasoning parsers"),
    ("thinking_token_budget", 0, "tokenmill has no reasoning parsers"),
    ("thinking_token_budget", -2, "a non-negative integer or -1 (unlimited)"),
    ("thinking_token_budget", 1.5, "a non-negative integer or -1 (unlimited)"),
    ("thinking_token_budget", True, "a non-negative integer or -1 (unlimited)"),
])
def test_vllm_026_fields_refuse_what_does_not_apply(field, value, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}={value!r} is invalid" in str(err.value) and allowed in str(err.value)


def test_clone_is_a_deep_copy_as_in_vllm():
    """vLLM's clone() deep-copies: a copy's lists changed in place leave the original alone;
    skip_clone=True makes it shallow. clone(**changes) (tokenmill's) replaces fields shallowly."""
    original = SamplingParams(stop=["a"], allowed_token_ids=[1, 2], logit_bias={3: 1.0}, extra_args={"k": [1]})
    copied = original.clone()
    copied.stop.append("b")
    copied.allowed_token_ids.append(3)
    copied.logit_bias[4] = 2.0
    copied.extra_args["k"].append(2)
    assert (original.stop, original.allowed_token_ids, original.logit_bias, original.extra_args) == (
        ["a"], [1, 2], {3: 1.0}, {"k": [1]})
    shallow = SamplingParams(stop=["a"], skip_clone=True)
    assert shallow.clone().stop is shallow.stop
    changed = original.clone(max_tokens=5)
    assert changed.max_tokens == 5 and changed.stop == original.stop
    with pytest.raises(ValueError, match="max_tokens"):
        original.clone(max_tokens=-1)


# vLLM's SamplingParams is a msgspec Struct, whose constructor checks no types: a field its
# _verify_args never isinstance-checks takes numpy's numbers (a budget, seed or id read from an array
# or a DataFrame), while n, best_of, top_k and stop_token_ids are checked with isinstance(x, int),
# which numpy's integers fail. tokenmill stores what it takes as the Python number it equals.
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 7), ("min_tokens", 2), ("logprobs", 3), ("prompt_logprobs", 0), ("seed", 1234),
    ("truncate_prompt_tokens", 5), ("truncate_prompt_tokens", -1), ("routed_experts_prompt_start", 0),
])
@pytest.mark.parametrize("numpy_type", [np.int64, np.int32, np.int16])
def test_numpy_integers_taken_where_vllm_checks_no_type(field, value, numpy_type):
    got = getattr(SamplingParams(**{field: numpy_type(value)}), field)
    assert got == value and type(got) is int


def test_numpy_values_of_lists_and_floats_taken_as_python_numbers():
    p = SamplingParams(seed=np.int64(-1), allowed_token_ids=[np.int64(3), 4], logprob_token_ids=np.array([5, 6]).tolist(),
                       temperature=np.float32(0.5), top_p=np.float64(0.25), min_p=np.float16(0.5),
                       presence_penalty=np.int64(1), frequency_penalty=np.float32(-0.5), repetition_penalty=np.float32(1.5))
    assert p.seed is None  # vLLM: seed == -1 means no seed, a numpy -1 too
    assert p.allowed_token_ids == [3, 4] and all(type(t) is int for t in p.allowed_token_ids)
    assert [type(t) for t in SamplingParams(logprob_token_ids=[np.int32(5)]).logprob_token_ids] == [int]
    numbers = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    assert numbers == (0.5, 0.25, 0.5, 1, -0.5, 1.5)
    assert [type(x) for x in numbers] == [float, float, float, int, float, float]
    beam = BeamSearchParams(np.int64(2), np.int32(8), temperature=np.float32(0.5), length_penalty=np.int64(1))
    assert (beam.beam_width, beam.max_tokens, beam.temperature, beam.length_penalty) == (2, 8, 0.5, 1)
    assert [type(x) for x in (beam.beam_width, beam.max_tokens, beam.temperature)] == [int, int, float]


@pytest.mark.parametrize("field, value", [
    ("n", np.int64(2)), ("best_of", np.int64(2)), ("top_k", np.int64(5)), ("stop_token_ids", [np.int64(3)]),
    ("allowed_token_ids", [np.float64(3.0)]), ("max_tokens", np.float64(5.0)), ("seed", np.bool_(True)),
    ("temperature", np.str_("0.5")),
])
def test_numpy_values_refused_where_vllm_refuses_them(field, value):
    """vLLM's isinstance(x, int) checks (n, best_of, top_k, stop_token_ids) refuse numpy integers;
    a float is no integer and a numpy bool or string no number, whatever library made them."""
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=") as err:
        SamplingParams(**{field: value})
    if field in ("n", "best_of", "top_k", "stop_token_ids"):
        assert "vLLM's isinstance(x, int) check refuses numpy integers here (pass int(x))" in str(err.value)
