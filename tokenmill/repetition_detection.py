"""Repetition detection: end a completion whose output has fallen into a loop (vLLM's
``SamplingParams.repetition_detection``).

Models sometimes get stuck emitting the same few tokens over and over ("abcabcabc...", one emoji
repeated) until max_tokens. With ``RepetitionDetectionParams(max_pattern_size=P, min_count=C)`` a
sequence finishes as soon as its output ends in some pattern of L tokens (``min_pattern_size <= L
<= P``) repeated C times back to back: ``finish_reason="repetition"``, ``stop_reason=
"repetition_detected"``, the tokens up to and including the one that completed the loop kept.

The scheduler's `check_stop` asks after every new output token (once min_tokens are out, and after
the stop and length rules), so the test below runs per token per sequence: it rejects a pattern
length on one comparison in the common case and compares the rest as list slices, in C.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tokenmill.param_checks import as_python_number, check, is_int

FINISH_REASON = "repetition"
STOP_REASON = "repetition_detected"
_check = functools.partial(check, owner="RepetitionDetectionParams")


@dataclass
class RepetitionDetectionParams:
    """Which repeated patterns end a completion (vLLM's fields, defaults and rules).

    max_pattern_size: the longest pattern, in tokens, looked for; 0 turns detection off.
    min_pattern_size: the shortest; 0 means 1. At most max_pattern_size.
    min_count: how many back-to-back copies of the pattern end the completion; >= 2 when
        max_pattern_size > 0.
    """

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            # vLLM's dataclass checks no types, so numpy's integers pass; kept as Python ints.
            value = as_python_number(getattr(self, name))
            setattr(self, name, value)
            _check(is_int(value), name, value, "an integer")
        _check(self.max_pattern_size >= 0, "max_pattern_size", self.max_pattern_size, ">= 0 (0 turns detection off)")
        _check(self.min_pattern_size >= 0, "min_pattern_size", self.min_pattern_size, ">= 0 (0 means 1)")
        _check(self.min_pattern_size <= self.max_pattern_size, "min_pattern_size", self.min_pattern_size,
               f"<= max_pattern_size ({self.max_pattern_size}); set both to 0 to turn detection off")
        if self.max_pattern_size > 0:
            _check(self.min_count >= 2, "min_count", self.min_count,
                   f">= 2 when max_pattern_size > 0 ({self.max_pattern_size}); max_pattern_size=0 turns detection off")

    @classmethod
    def coerce(cls, value: Any) -> "RepetitionDetectionParams":
        """``value`` as a RepetitionDetectionParams: itself, or built from a dict (a JSON or Arrow
        row's object, as vLLM's server accepts it). A None entry means "not set": Arrow structs
        carry every key, filling the ones a row left out with nulls."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"SamplingParams.repetition_detection={value!r} is invalid: must be None, a "
                             "RepetitionDetectionParams or a dict of its fields")
        given = {k: v for k, v in value.items() if v is not None}
        unknown = sorted(set(given) - {"max_pattern_size", "min_pattern_size", "min_count"})
        if unknown:
            raise ValueError(f"SamplingParams.repetition_detection has unknown field(s) {unknown}; "
                             "allowed: max_pattern_size, min_pattern_size, min_count")
        return cls(**given)


def ends_in_repetition(token_ids: list[int], params: RepetitionDetectionParams) -> bool:
    """Whether ``token_ids`` ends in ``params.min_count`` back-to-back copies of one pattern whose
    length is in [min_pattern_size (0: 1), max_pattern_size]."""
    count = params.min_count
    if params.max_pattern_size <= 0 or count < 2:
        return False
    n = len(token_ids)
    last = token_ids[-1] if n else None
    for length in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        span = length * count
        if span > n:
            return False  # longer patterns need even more tokens
        # The tail of `span` tokens is `count` copies of its last `length` iff it has period
        # `length`: every token equals the one `length` before it. Checking the last token first
        # rejects almost every length without building the slices.
        if token_ids[n - 1 - length] != last:
            continue
        if token_ids[n - span : n - length] == token_ids[n - span + length :]:
            return True
    return False
