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
