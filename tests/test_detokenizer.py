"""Incremental detokenization against the tokenizer's own decode: a completion's text is what its
tokens add to the prompt's text, also when a token-id prompt ends inside a UTF-8 character."""

from __future__ import annotations

import pytest

from support.tiny_models import build_tiny_tokenizer
from tokenmill.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def stream_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True, stop=[], include_stop_str_in_output=False)
    for token in output:
        detok.add_token(token)
    return detok.text


def added_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    """decode(prompt + output) past the prompt's last complete character (a dangling byte of the
    prompt decodes as U+FFFD on its own, and as part of a character once the output completes it)."""
    complete = list(prompt)
    while complete and tokenizer.decode(complete).endswith("\ufffd"):
        complete.pop()
    return tokenizer.decode(prompt + output)[len(tokenizer.decode(complete)):]


def test_completion_text_is_what_the_tokens_add_to_the_prompt(tokenizer):
    cafe = tokenizer.encode("un café noir", add_special_tokens=False)
    split = next(i for i in range(1, len(cafe)) if tokenizer.decode(cafe[:i]).endswith("\ufffd"))
    output = tokenizer.encode(' {"a": 1} — ok', add_special_tokens=False)
    cases = {
        "whole characters": (tokenizer.encode("hello there", add_special_tokens=False), output),
        "ends inside a character the output never completes": (cafe[:split], output),
        "ends inside a character the output completes": (cafe[:split], cafe[split:]),
        "a broken character first, whole ones after": (cafe[split:], output),
    }
    for name, (prompt, out) in cases.items():
        assert stream_text(tokenizer, prompt, out) == added_text(tokenizer, prompt, out), name
    assert stream_text(tokenizer, cafe[:split], cafe[split:]).startswith("é")  # completed across the boundary


def stop_after_min_tokens(tokenizer, text: str, stop: list[str], min_tokens: int) -> tuple[str, str | None]:
    """The stream of ``text``'s tokens with stop strings counted only past the first ``min_tokens``
    tokens (the scheduler's check_stop passes num_out > min_tokens)."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True, stop=stop, include_stop_str_in_output=False)
    for num_out, token in enumerate(tokenizer.encode(text, add_special_tokens=False), start=1):
        found = detok.add_token(token, check_stop=num_out > min_tokens)
        if found is not None:
            return detok.text, found
    return detok.text, None


def test_a_stop_string_wholly_below_min_tokens_does_not_count(tokenizer):
    """vLLM (check_stop_strings, its tests/detokenizer/test_min_tokens.py): text made by the first
    min_tokens tokens is not searched; a stop string counts only where it ends in later text. Each
    stop string is searched from its own length back, so a short one ("c") lying wholly in the
    unchecked text is not found because a longer one ("xyz") is also given."""
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("abcdefgh", add_special_tokens=False)) == list("abcdefgh")
    assert stop_after_min_tokens(tokenizer, "abcdefgh", ["c"], 3) == ("abcdefgh", None)
    assert stop_after_min_tokens(tokenizer, "abcdefgh", ["c", "xyz"], 3) == ("abcdefgh", None)
    assert stop_after_min_tokens(tokenizer, "abcdefgh", ["xyz", "bc"], 3) == ("abcdefgh", None)
    # A stop string that starts in the unchecked text and ends past it counts.
    assert stop_after_min_tokens(tokenizer, "abcdefgh", ["cd", "xyz"], 3) == ("ab", "cd")
    assert stop_after_min_tokens(tokenizer, "abcdefgh", ["c", "xyz"], 2) == ("ab", "c")
