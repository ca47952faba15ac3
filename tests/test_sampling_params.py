"""SamplingParams: vLLM's defaults, and errors that name the field and the allowed range."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.min_tokens == 0


def test_single_stop_string_becomes_a_list_and_top_k_minus_one_means_off():
    p = SamplingParams(stop="\n", top_k=-1)
    assert p.stop == ["\n"] and p.top_k == 0


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"n": 0}, "n", ">= 1"),
        ({"top_k": -5}, "top_k", ">= 1"),
        ({"min_p": 2.0}, "min_p", "[0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "<= max_tokens"),
        ({"logprobs": -1}, "logprobs", ">= 0"),
        ({"temperature": "hot"}, "temperature", "a finite number"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop_token_ids": [-3]}, "stop_token_ids", "non-negative"),
    ],
)
def test_invalid_values_name_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert f"SamplingParams.{field}=" in message and allowed in message


def test_greedy_normalises_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)
    assert p.temperature == 0.0 and p.top_p == 1.0 and p.top_k == 0


def test_from_optional_rejects_unknown_fields():
    assert SamplingParams.from_optional(max_tokens=5, seed=None).max_tokens == 5
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_optional(max_token=5)


@pytest.mark.parametrize("field, value", [
    ("max_tokens", True), ("n", True), ("seed", False), ("logprobs", True), ("prompt_logprobs", True),
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


# vLLM 0.26's SamplingParams fields a user sets (its internal ones, output_text_buffer_length and the
# underscored ones, left out). A vLLM script passing any of them must construct ours.
VLLM_0_26_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
    "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "output_kind", "skip_clone", "structured_outputs", "logit_bias",
    "allowed_token_ids", "extra_args", "routed_experts_prompt_start", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection",
}
NOT_YET = {"logprob_token_ids", "flat_logprobs"}  # known gaps: a TypeError names them today


def test_every_vllm_field_is_a_field_here_but_the_known_gaps():
    import dataclasses

    ours = {f.name for f in dataclasses.fields(SamplingParams)}
    assert VLLM_0_26_FIELDS - ours == NOT_YET


def test_vllm_026_fields_defaults():
    p = SamplingParams()
    assert (p.repetition_detection, p.skip_reading_prefix_cache, p.skip_clone) == (None, None, False)
    assert (p.routed_experts_prompt_start, p.thinking_token_budget) == (0, None)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM: -1 means unlimited
    assert SamplingParams(skip_clone=True, skip_reading_prefix_cache=True, routed_experts_prompt_start=0).skip_clone


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("skip_clone", 1, "True or False"),
    ("skip_reading_prefix_cache", "yes", "None, True or False"),
    ("routed_experts_prompt_start", 4, "0: tokenmill has no mixture-of-experts models"),
    ("routed_experts_prompt_start", True, "0: tokenmill has no mixture-of-experts models"),
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
