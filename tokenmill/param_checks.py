"""How a parameter object refuses a value, in one place: the error names the class and field, the
value, and what is allowed (``SamplingParams.top_p=2 is invalid: must be in (0, 1]``)."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer, and not a bool (vLLM's request models refuse True for an int field)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool (NaN and infinities included: callers bound the range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(ok: bool, name: str, value: Any, allowed: str, owner: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: must be {allowed}")
