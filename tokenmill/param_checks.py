"""How a parameter object refuses a value, in one place: the error names the class and field, the
value, and what is allowed (``SamplingParams.top_p=2 is invalid: must be in (0, 1]``)."""

from __future__ import annotations

import numbers
from typing import Any


def is_int(value: Any) -> bool:
    """An integer, and not a bool (vLLM's request models refuse True for an int field)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An integer of Python's or another library's (numpy's), and not a bool: for the values vLLM
    takes without an isinstance check, so numpy's integers pass there."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, and not a bool (NaN and infinities included: callers bound the range)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_python_number(value: Any) -> Any:
    """An integer or real number of another library (numpy's, read from an array or a DataFrame) as the
    Python int or float it equals; anything else (bools, strings, None, lists) as it is, for the
    caller's checks to judge. vLLM's parameter objects are msgspec Structs, whose constructors check no
    types, so a field vLLM never isinstance-checks takes numpy's numbers; stored as Python numbers,
    the engine, outputs and JSON writers meet one kind."""
    if type(value) in (int, float) or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def is_foreign_int(value: Any) -> bool:
    """An integer that is no Python int (numpy's): what vLLM's ``isinstance(x, int)`` checks refuse."""
    return isinstance(value, numbers.Integral) and not isinstance(value, int)


def check(ok: bool, name: str, value: Any, allowed: str, owner: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: must be {allowed}")
