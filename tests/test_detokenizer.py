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
